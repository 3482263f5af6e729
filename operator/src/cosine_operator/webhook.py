"""Admission checks the CRD's CEL rules cannot express, and the kopf validating webhook for them.

CEL (in ``crds/``) covers bounds, ``minReplicas <= maxReplicas``, at least one pool, unique pool
names and model/ngram consistency (an ngram pool takes no model and no engine). Here: pass-through
pod fields Pod Security ``restricted`` would refuse (hostPath volumes, host mount propagation), tokenizer
compatibility between each model drafter and the verifier (CEL cannot know model families; the
table is :data:`cosine_spec.catalogue.TOKENIZER_FAMILIES`), and
the length of child names built from the object's name (CEL on ``spec`` cannot see
``metadata.name``), and verifier shapes vLLM cannot run (``spec.verifier.parallelism``: its ranks
against the GPUs of a group, which CEL cannot read from the verbatim ``resources``), and model
URIs of a scheme no puller serves (:func:`cosine_spec.catalogue.model_source_problems`).
What is admitted but costs an outage is a warning (:func:`cluster_warnings`; kubectl prints it).

Only what a person writes is checked (:func:`spec_checked`): a CREATE, and an UPDATE that changes
the spec of an object not being deleted. kopf writes its finalizers and annotations with a PATCH of
the object itself, an UPDATE to admission (kopf ``_cogs/clients/patching.py``): refusing it because
the spec fails a rule a later release added would leave a cluster that can never finish deleting.
A field this release does not know is refused only where the change brings it; one the stored
object already had (a later release's CRD default, filled in on read) is admitted with a warning.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import kopf
from cosine_spec.catalogue import gguf_source, model_source_problems, tokenizer_problems
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.contract import CLUSTER_PLURAL, GROUP, VERSION
from cosine_spec.pods import PodOverrides
from cosine_spec.verifier_spec import engine_args_problems, parallelism_problems, speculator_problems

from cosine_operator.builders.names import drafter_name, model_job_name, verifier_name
from cosine_operator.builders.pods import rollout_strategy, surge_update, unavailable_replicas

MAX_NAME_LENGTH = 63  # DNS-1035 label: Services and Deployments of the children
# The volume types Pod Security's `restricted` profile admits ("Volume Types" control,
# https://kubernetes.io/docs/concepts/security/pod-security-standards/): the workload pods run
# restricted, so a pass-through volume of another type (hostPath above all) is refused here.
RESTRICTED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                                "persistentVolumeClaim", "projected", "secret"})


def pod_override_problems(field: str, pod: PodOverrides) -> list[str]:
    """What a role's pass-through pod fields (``field``: ``spec.verifier`` or
    ``spec.drafterPools[i]``) would add beyond Pod Security ``restricted``: a volume of a type it
    does not admit (``hostPath``, ``nfs``, ...), or a mount that propagates to the host
    (``mountPropagation: Bidirectional`` needs a privileged container). Each message names the field."""
    problems = []
    for i, volume in enumerate(pod.volumes):
        kinds = [k for k in volume if k != "name"]
        for kind in kinds:
            if kind not in RESTRICTED_VOLUMES:
                problems.append(f"{field}.volumes[{i}].{kind}: volume type {kind!r} is not allowed (the pods run "
                                f"under Pod Security 'restricted': {', '.join(sorted(RESTRICTED_VOLUMES))})")
    for i, mount in enumerate(pod.volume_mounts):
        if mount.get("mountPropagation") == "Bidirectional":
            problems.append(f"{field}.volumeMounts[{i}].mountPropagation: Bidirectional needs a privileged "
                            "container, which these pods never run")
    return problems


def spec_checked(operation: str | None, spec: Any, old_spec: Any, deleting: bool) -> bool:
    """Whether admission checks this write's spec: a CREATE, or an UPDATE that changes the spec of
    an object not being deleted. An UPDATE that leaves the spec as stored changes metadata only
    (kopf's finalizer and annotation patches, a label, ``kubectl annotate``): admitted whatever the
    spec, so an object a later, stricter release refuses can still be deleted and handled."""
    if operation != "UPDATE":
        return True
    return not deleting and spec != old_spec


def validate_cluster(name: str, spec: Mapping[str, Any], *, tolerated: Collection[str] = (),
                     warnings: list[str] | None = None) -> list[str]:
    """Every problem CEL cannot catch, each message starting with the offending field's path.

    A field this release does not know is a problem unless its path is in ``tolerated`` (it was in
    the stored object: :func:`unknown_fields`), then a line in ``warnings`` (if given)."""
    problems: list[str] = []
    unknown: dict[str, str] = {}
    try:
        cluster = parse_cluster_spec(spec, unknown=unknown)
    except ValueError as e:
        message = str(e)
        return [message if message.startswith("spec.") else f"spec: {message}"]
    for path, message in unknown.items():
        if path not in tolerated:
            problems.append(message)
        elif warnings is not None:
            warnings.append(f"{path}: unknown to this operator, ignored (the CRDs are newer than the operator?)")
    problems += pod_override_problems("spec.verifier", cluster.verifier.pod)
    problems += parallelism_problems(cluster.verifier)
    problems += speculator_problems(cluster.verifier)
    problems += engine_args_problems(cluster.verifier)
    problems += model_source_problems(cluster)
    longest = verifier_name(name) + "-worker"  # a multi-node verifier's worker NetworkPolicy
    if cluster.verifier.nodes > 1 and len(longest) > MAX_NAME_LENGTH:
        problems.append(f"spec.verifier.parallelism.nodes: child name {longest!r} is {len(longest)} characters, "
                        f"over {MAX_NAME_LENGTH}; shorten the cluster name")
    if cluster.model_cache is not None:  # the pull Job's name is also its pods' job-name label: a label value
        job = model_job_name(name, {})  # the length of any of its names
        if len(job) > MAX_NAME_LENGTH:
            problems.append(f"spec.modelCache: the model pull Job's name {job!r} is {len(job)} characters, over "
                            f"{MAX_NAME_LENGTH}; shorten the cluster name")
    for i, pool in enumerate(cluster.drafter_pools):
        field = f"spec.drafterPools[{i}]"
        problems += pod_override_problems(field, pool.pod)
        longest = drafter_name(name, pool.name)
        if len(longest) > MAX_NAME_LENGTH:
            problems.append(
                f"{field}.name: child name {longest!r} is {len(longest)} characters, over "
                f"{MAX_NAME_LENGTH}; shorten the pool or cluster name"
            )
        if pool.resolved_engine == "llamacpp" and pool.model is not None and gguf_source(pool.model) is None:
            problems.append(
                f"{field}.model: {pool.model!r} has no GGUF file for llama.cpp (this pool's engine: "
                f"{'engine: llamacpp' if pool.engine else 'the default on a pod without nvidia.com/gpu'}); "
                "name the model's GGUF repository (by convention '<repo>-GGUF' on the Hugging Face Hub) or "
                f"a .gguf path or s3:// or gs:// object, or set {field}.engine: vllm"
            )
    return problems + tokenizer_problems(cluster)


def cluster_warnings(spec: Mapping[str, Any]) -> list[str]:
    """What an admitted spec costs that its author may not know, each message starting with the
    field: a verifier whose roll may take down every replica before a successor is Ready (one GPU
    replica by default: ``maxSurge`` 0, a new pod takes the old one's GPU), so every change to its
    pods (a config change, an operator upgrade that rolls every pod) leaves no verifier for a whole
    model load. ``[]`` for a spec :func:`validate_cluster` refuses."""
    try:
        v = parse_cluster_spec(spec).verifier
    except ValueError:
        return []
    if v.nodes > 1:  # a LeaderWorkerSet's groups roll by rollout.maxSurge alone
        strategy = {"type": "RollingUpdate", "rollingUpdate": surge_update(v.rollout.max_surge or 0)}
    else:
        strategy = rollout_strategy(v.pod, v.rollout.max_surge)
    if unavailable_replicas(strategy, v.replicas) < v.replicas:
        return []
    return [f"spec.verifier.replicas: {v.replicas} and no surge: every change to the verifier's pods (a config "
            "change, an upgrade) may take every verifier down at once, for a whole model load. Set "
            "spec.verifier.rollout.maxSurge: 1 where the node pool can add a node, or run more replicas"]


def unknown_fields(spec: Any) -> frozenset[str]:
    """The paths of the fields of ``spec`` this release does not know (none if it does not parse)."""
    unknown: dict[str, str] = {}
    try:
        parse_cluster_spec(spec or {}, unknown=unknown)
    except ValueError:
        pass
    return frozenset(unknown)


@kopf.on.validate(GROUP, VERSION, CLUSTER_PLURAL, id="validate-cosinecluster")
def cosinecluster_validate(name: str | None, spec: Mapping[str, Any], operation: str | None, body: kopf.Body,
                           old: kopf.Body | None, warnings: list[str], **_: Any) -> None:
    """Reject a CoSineCluster whose spec fails :func:`validate_cluster` (HTTP 422, all messages),
    where :func:`spec_checked` says the write is a person's; admit one with :func:`cluster_warnings`
    in kopf's ``warnings`` (the AdmissionReview's, which kubectl prints)."""
    old_spec = old.get("spec") if old is not None else None
    if not spec_checked(operation, spec, old_spec, bool(body.metadata.get("deletionTimestamp"))):
        return
    problems = validate_cluster(name or "", spec, tolerated=unknown_fields(old_spec), warnings=warnings)
    if problems:
        raise kopf.AdmissionError("; ".join(problems), code=422)
    warnings.extend(cluster_warnings(spec))
