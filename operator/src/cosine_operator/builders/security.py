"""What Pod Security's ``restricted`` profile admits: the pods run as the image's non-root user,
with no privilege escalation, no capabilities and the runtime's default seccomp profile; and what a
policy requiring ``readOnlyRootFilesystem`` admits: the runtime image's containers write only to
their volumes."""

from __future__ import annotations

from typing import Any

from cosine_spec.pods import HOME_DIR, TMP_DIR

RUN_AS_USER = 10001  # the image's non-root user (Dockerfile)


def restricted_container() -> dict[str, Any]:
    """A container security context Pod Security ``restricted`` admits (the pod's sets the rest)."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# The runtime's writable places (every container's root filesystem is read-only): HOME, which
# holds the compile caches (cosine_spec.pods.RUNTIME_ENV), and /tmp, each an emptyDir with a
# sizeLimit. An emptyDir outlives the container's restarts, so a restarted engine finds its
# compiled kernels; a GPU pod's caches are larger (Triton's, FlashInfer's, vLLM's torch.compile's).
CACHE_VOLUME, TMP_VOLUME = "cache", "tmp"
CACHE_GIB = {True: 10, False: 2}  # by whether the pod requests a GPU
TMP_GIB = 1


def writable_dirs(gpu: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The mounts and the volumes of the runtime's writable places: HOME (its caches) and /tmp."""
    mounts = [{"name": CACHE_VOLUME, "mountPath": HOME_DIR}, {"name": TMP_VOLUME, "mountPath": TMP_DIR}]
    volumes = [{"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": f"{CACHE_GIB[gpu]}Gi"}},
               {"name": TMP_VOLUME, "emptyDir": {"sizeLimit": f"{TMP_GIB}Gi"}}]
    return mounts, volumes


def read_only_root(container: dict[str, Any], gpu: bool) -> None:
    """``container`` (the runtime image's) with a read-only root filesystem, writing only to its
    volumes and :func:`writable_dirs`."""
    container["volumeMounts"] = [*container.get("volumeMounts", ()), *writable_dirs(gpu)[0]]
    container["securityContext"] = {**container.get("securityContext", {}), "readOnlyRootFilesystem": True}
