"""A verifier replica over several nodes (``spec.verifier.parallelism.nodes`` > 1): a LeaderWorkerSet
of groups running vLLM's multi-node mode, and the choice between it and a Deployment."""

from __future__ import annotations

from cosine_spec.cluster_spec import ClusterSpec
from cosine_spec.contract import CONFIG_FILE, LWS_LEADER_ADDRESS, VERIFIER_HTTP_PORT, VERIFIER_METRICS_PORT

from cosine_operator import capacity_placement, config_hashes
from cosine_operator.builders.names import WORKER_COMPONENT, Manifest, labels, verifier_name
from cosine_operator.builders.pods import build_pod_spec, container_env, pod_template, surge_update
from cosine_operator.builders.workloads import build_verifier_deployment, verifier_template

# LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, LWS v0.7); the variables it gives every container of a
# group are the contract's (LWS_LEADER_ADDRESS, LWS_WORKER_INDEX)
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


def _leader_wait_command(grace_s: int) -> list[str]:
    """A worker's preStop: wait (at most ``grace_s`` - 5 s) until its leader's API port refuses
    connections, i.e. the leader has drained its requests; a group's pods get SIGTERM together,
    and a worker that exits first would fail the leader's in-flight requests."""
    leader = f"(os.environ['{LWS_LEADER_ADDRESS}'],{VERIFIER_HTTP_PORT})"
    script = ("import os,socket,time\n"
              f"end=time.monotonic()+{max(0, grace_s - 5)}\n"
              "while time.monotonic()<end:\n"
              f"    try: socket.create_connection({leader},1).close()\n"
              "    except OSError: break\n"
              "    time.sleep(1)\n")
    return ["python3", "-c", script]


def build_verifier_group(name: str, namespace: str, cluster: ClusterSpec) -> Manifest:
    """LeaderWorkerSet ``N-verifier`` (``spec.verifier.parallelism.nodes`` > 1): ``spec.verifier.replicas``
    groups (at creation only, as the Deployment's) of ``nodes`` pods running vLLM's multi-node mode
    without Ray. The leader is the verifier pod (the API, CoSine's proposer in its engine core, the
    labels the Services, the InferencePool and the drafters' NetworkPolicy select); each worker runs
    the engine alone (``cosine verifier-worker``: ``vllm serve --headless``, its node rank from
    ``LWS_WORKER_INDEX``, the leader from ``LWS_LEADER_ADDRESS``) and carries the component
    ``verifier-worker`` instead. ``RecreateGroupOnPodRestart``: a worker's loss restarts its group
    (vLLM's ranks cannot rejoin a running world). Groups roll one at a time, surging none (a group
    holds whole GPU nodes) unless ``spec.verifier.rollout.maxSurge`` says how many groups may surge."""
    v = cluster.verifier
    leader = verifier_template(name, namespace, cluster)
    worker_container = {
        "name": "verifier",  # the verifier's resources and image defaults
        "command": ["cosine"],
        "args": ["verifier-worker", "--cluster", CONFIG_FILE],
        "env": container_env(v.pod, []),
        "lifecycle": {"preStop": {"exec": {"command": _leader_wait_command(v.termination_grace_s)}}},
    }
    worker_spec = build_pod_spec(cluster, capacity_placement.on_demand(v.pod, cluster), v.image, worker_container, name,
                            [v.model], v.termination_grace_s, None, shm=True)
    worker = pod_template(name, WORKER_COMPONENT, None, worker_spec, VERIFIER_METRICS_PORT,
                       config_hashes.verifier_hash(cluster), v.pod)
    for key in ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"):
        worker["metadata"]["annotations"].pop(key)  # a headless engine serves no metrics
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": verifier_name(name), "namespace": namespace, "labels": labels(name, "verifier")},
        "spec": {
            "replicas": v.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": surge_update(v.rollout.max_surge or 0)},
            "leaderWorkerTemplate": {
                "size": v.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def build_verifier(name: str, namespace: str, cluster: ClusterSpec) -> Manifest:
    """The verifier's workload: a Deployment, or a LeaderWorkerSet when a replica spans nodes."""
    if cluster.verifier.nodes > 1:
        return build_verifier_group(name, namespace, cluster)
    return build_verifier_deployment(name, namespace, cluster)
