"""What every role's pods take from the spec: the runtime image (``spec.image`` and a role's own
``image``) and the pod overrides copied verbatim into a pod template (Kubernetes' own types)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from cosine_spec.contract import GPU_RESOURCE
from cosine_spec.schema import Checked, spec_field

# The runtime image's tag when none is given: this release (the chart's appVersion, which tags the
# images: Makefile VERSION; tests/test_version.py keeps them equal); GPU pods get its CUDA build.
RUNTIME_TAG = "0.2.0"
CUDA_TAG_SUFFIX = "-cuda"
# The runtime image's repository and pull policy when neither the spec nor the operator names one.
RUNTIME_REPOSITORY = "ghcr.io/cosine-project/cosine"
RUNTIME_PULL_POLICY = "IfNotPresent"

# Where the runtime writes, in a pod whose root filesystem is read-only: HOME_DIR, which holds every
# cache of what it compiles (vLLM's torch.compile cache at VLLM_CACHE_ROOT, Triton's kernels and
# driver stub at TRITON_CACHE_DIR, FlashInfer's and CUDA's under HOME and XDG_CACHE_HOME, as vLLM
# 0.32's envs.py and Triton 3.9's knobs.py read them), and TMP_DIR (vLLM's IPC sockets, Triton's
# build directories): each an emptyDir of the pod's.
HOME_DIR = "/home/cosine"  # the image's user's home (Dockerfile)
TMP_DIR = "/tmp"
CACHE_DIR = f"{HOME_DIR}/.cache"
# The runtime's environment in every pod, and in its image (the Dockerfile's ENV, kept equal by
# tests/operator/test_images.py): the caches above, and no usage statistics sent to vLLM's server
# (vllm/usage/usage_lib.py: VLLM_NO_USAGE_STATS or DO_NOT_TRACK).
RUNTIME_ENV: Mapping[str, str] = MappingProxyType({
    "HOME": HOME_DIR,
    "XDG_CACHE_HOME": CACHE_DIR,
    "VLLM_CACHE_ROOT": f"{CACHE_DIR}/vllm",
    "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
})


@dataclass(frozen=True)
class RoleImage(Checked):
    """``spec.verifier.image`` / ``spec.drafterPools[].image``: this role's image, field by field
    over ``spec.image`` (unset fields: ``spec.image``'s)."""

    SPEC_PATH: ClassVar[str] = "spec.<role>.image"
    repository: str | None = spec_field("repository", None)
    tag: str | None = spec_field("tag", None)
    pull_policy: str | None = spec_field("pullPolicy", None, enum=("Always", "IfNotPresent", "Never"))


@dataclass(frozen=True)
class ImageSpec(Checked):
    """``spec.image``: the runtime image of every role (``cosine`` entrypoint; the operator has its
    own). Unset fields are the operator's default image's (:meth:`under`: the chart's
    ``runtimeImage``), which the CRD therefore does not default; then :data:`RUNTIME_REPOSITORY`,
    ``IfNotPresent``, and for the tag this release's, :data:`RUNTIME_TAG`, with
    :data:`CUDA_TAG_SUFFIX` on a pod that requests ``nvidia.com/gpu`` (the CUDA build, ``make
    images-cuda``) and without on any other (the CPU build)."""

    SPEC_PATH: ClassVar[str] = "spec.image"
    repository: str | None = spec_field("repository", None)
    tag: str | None = spec_field("tag", None)
    pull_policy: str | None = spec_field("pullPolicy", None, enum=("Always", "IfNotPresent", "Never"))

    def under(self, default: ImageSpec) -> ImageSpec:
        """These fields over ``default``'s, field by field (``default``: the operator's)."""
        return ImageSpec(repository=self.repository or default.repository, tag=self.tag or default.tag,
                         pull_policy=self.pull_policy or default.pull_policy)

    def for_pod(self, role: RoleImage, gpu: bool) -> tuple[str, str]:
        """``(repository:tag, pullPolicy)`` of a pod of a role: the role's fields over these,
        then the defaults, the tag for the pod's device (``gpu``: it requests ``nvidia.com/gpu``)."""
        tag = role.tag or self.tag or RUNTIME_TAG + (CUDA_TAG_SUFFIX if gpu else "")
        repository = role.repository or self.repository or RUNTIME_REPOSITORY
        return f"{repository}:{tag}", role.pull_policy or self.pull_policy or RUNTIME_PULL_POLICY


@dataclass(frozen=True)
class PodOverrides:
    """Scheduling, identity and environment of a role's pods, copied verbatim into its pod template
    (Kubernetes' own types)."""

    SPEC_PATH: ClassVar[str] = "spec.<role>"
    resources: Mapping[str, Any] = spec_field("resources", default_factory=dict, verbatim=True)
    node_selector: Mapping[str, str] = spec_field("nodeSelector", default_factory=dict, verbatim=True)
    tolerations: tuple[Mapping[str, Any], ...] = spec_field("tolerations", (), verbatim=True)
    affinity: Mapping[str, Any] = spec_field("affinity", default_factory=dict, verbatim=True)
    env: tuple[Mapping[str, Any], ...] = spec_field("env", (), verbatim=True)
    image_pull_secrets: tuple[Mapping[str, Any], ...] = spec_field("imagePullSecrets", (), verbatim=True)
    # Workload Identity (GKE) or IRSA (EKS): the pods' service account
    service_account_name: str | None = spec_field("serviceAccountName", None, verbatim=True)
    priority_class_name: str | None = spec_field("priorityClassName", None, verbatim=True)
    runtime_class_name: str | None = spec_field("runtimeClassName", None, verbatim=True)
    volumes: tuple[Mapping[str, Any], ...] = spec_field("volumes", (), verbatim=True)  # extra pod volumes
    # in the role's main container
    volume_mounts: tuple[Mapping[str, Any], ...] = spec_field("volumeMounts", (), verbatim=True)
    strategy: Mapping[str, Any] = spec_field("strategy", default_factory=dict, verbatim=True)  # Deployment strategy
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = spec_field("topologySpreadConstraints", (),
                                                                             verbatim=True)
    pod_annotations: Mapping[str, str] = spec_field("podAnnotations", default_factory=dict, verbatim=True)
    pod_labels: Mapping[str, str] = spec_field("podLabels", default_factory=dict, verbatim=True)  # ours win on a clash

    @property
    def gpu_count(self) -> int:
        """``nvidia.com/gpu`` per pod: its limit, else its request (Kubernetes sets one from the
        other for extended resources), 0 if neither. Raises ``ValueError`` on a non-integer."""
        for k in ("limits", "requests"):
            value = (self.resources.get(k) or {}).get(GPU_RESOURCE)
            if value is not None:
                return int(value)
        return 0

    @property
    def requests_gpu(self) -> bool:
        """Whether the container asks for ``nvidia.com/gpu`` (in its limits or its requests)."""
        return self.gpu_count > 0
