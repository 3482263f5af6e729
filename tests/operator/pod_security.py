"""Pod Security Standards, ``restricted`` profile (Kubernetes v1.30), as checks on a pod spec.

A stand-in for the API server's Pod Security Admission, which cannot run here (no full cluster):
each check is one control of https://kubernetes.io/docs/concepts/security/pod-security-standards/
(baseline's and restricted's), on the fields our pods and any pod template can set.
"""

from __future__ import annotations

from typing import Any

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                   "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What of ``pod`` (a PodSpec) the ``restricted`` profile forbids; empty when admitted."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{key} is true")
    for v in pod.get("volumes") or ():
        kind = next((k for k in v if k != "name"), None)
        if kind not in ALLOWED_VOLUMES:
            out.append(f"volume {v.get('name')} of type {kind}")
    for s in psc.get("sysctls") or ():
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {s.get('name')}")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    containers = [*(pod.get("initContainers") or ()), *(pod.get("containers") or ()),
                  *(pod.get("ephemeralContainers") or ())]
    for c in containers:
        name, sc = c.get("name"), c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or ()) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps.get('add')}")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile is {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports") or ()):
            out.append(f"{name}: hostPort")
        if (sc.get("procMount") or "Default") != "Default":
            out.append(f"{name}: procMount")
    return out


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload among ``objects``."""
    out = []
    for o in objects:
        spec = o.get("spec") or {}
        if o.get("kind") == "Pod":
            out.append((f"Pod/{o['metadata']['name']}", spec))
        elif o.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
            out.append((f"{o['kind']}/{o['metadata']['name']}", spec["template"]["spec"]))
        elif o.get("kind") == "LeaderWorkerSet":
            group = spec["leaderWorkerTemplate"]
            for role in ("leaderTemplate", "workerTemplate"):
                if role in group:
                    out.append((f"LeaderWorkerSet/{o['metadata']['name']}/{role}", group[role]["spec"]))
    return out


def writable_root_violations(pod: dict[str, Any]) -> list[str]:
    """The containers of ``pod`` (a PodSpec) a policy requiring a read-only root filesystem refuses:
    each one, init and ephemeral containers included, whose ``securityContext`` does not set
    ``readOnlyRootFilesystem: true`` (Gatekeeper library's ``k8spspreadonlyrootfilesystem``;
    Kyverno's ``require-ro-rootfs`` checks the containers alone)."""
    containers = [*(pod.get("initContainers") or ()), *(pod.get("containers") or ()),
                  *(pod.get("ephemeralContainers") or ())]
    return [f"{c.get('name')}: root filesystem writable" for c in containers
            if (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True]
