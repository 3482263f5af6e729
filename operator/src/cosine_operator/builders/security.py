"""What Pod Security's ``restricted`` profile admits: the pods run as the image's non-root user,
with no privilege escalation, no capabilities and the runtime's default seccomp profile."""

from __future__ import annotations

from typing import Any

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
