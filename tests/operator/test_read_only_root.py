"""The runtime's pods write only to their volumes: a read-only root filesystem in every container
running the runtime, HOME (the compile caches) and /tmp on emptyDirs, and the environment with
which vLLM and Triton find their caches there and vLLM sends no usage statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cosine_spec.cluster_spec import parse_cluster_spec
from cosine_spec.pods import RUNTIME_ENV
from pod_security import pod_specs, writable_root_violations
from test_builders import CLUSTER

from cosine_operator.builders.inventory import build_children
from cosine_operator.builders.workloads import build_verifier_deployment

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "manifests" / "examples").glob("*.yaml"))


def _runtime_containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(workload/container, container, pod spec) of every container running the runtime (``cosine``)."""
    return [(f"{name}/{c['name']}", c, pod) for name, pod in pod_specs(objects)
            for c in [*pod.get("initContainers", ()), *pod["containers"]] if c.get("command") == ["cosine"]]


def _gib(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_runtime_containers_write_only_to_their_pods_volumes(path: Path) -> None:
    """Every container running the runtime (verifiers, drafters, their pulls, the model Job), in
    every example, has a read-only root filesystem (a policy requiring one admits the pod), HOME
    and /tmp on emptyDirs with a size limit, the runtime's environment (its caches under HOME, no
    usage statistics), and a main container that requests the disk of its pod's emptyDirs.
    Catches: caches and /tmp in the container layer (recompiled on every restart, never requested
    as disk), a pod a read-only-root policy refuses."""
    doc = yaml.safe_load(path.read_text())
    objects = build_children(doc["metadata"]["name"], "ns", parse_cluster_spec(doc["spec"]), {})
    found = _runtime_containers(objects)
    assert found
    for name, c, pod in found:
        assert not writable_root_violations({"containers": [c]}), name
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounted = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
        for path_ in ("/home/cosine", "/tmp"):
            assert mounted[path_]["emptyDir"]["sizeLimit"], (name, path_)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert RUNTIME_ENV.items() <= env.items(), name
        if c in pod["containers"] and "ephemeral-storage" in str(c["resources"]):
            on_disk = sum(_gib(v["emptyDir"]["sizeLimit"]) for v in pod["volumes"]
                          if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")
            assert _gib(c["resources"]["requests"]["ephemeral-storage"]) >= on_disk, name


# What vLLM 0.32 and Triton 3.9 themselves make of an environment: where each writes its caches
# (vllm/envs.py; triton/knobs.py; torch's inductor beside vLLM's; a temporary directory) and
# whether vLLM sends usage statistics (vllm/usage/usage_lib.py).
_RESOLVE = """
import json, os, tempfile
import vllm.envs as envs
from vllm.usage.usage_lib import is_usage_stats_enabled
from triton import knobs
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
print(json.dumps({"usage_stats": is_usage_stats_enabled(), "paths": {
    "vllm cache": envs.VLLM_CACHE_ROOT, "vllm config": envs.VLLM_CONFIG_ROOT, "triton cache": knobs.cache.dir,
    "triton home": knobs.cache.home_dir, "home": os.path.expanduser("~"), "inductor": default_cache_dir(),
    "temporary": tempfile.gettempdir(), "vllm ipc": envs.VLLM_RPC_BASE_PATH}}))
"""


def test_the_verifiers_environment_sends_no_usage_statistics_and_caches_on_its_volumes() -> None:
    """The GPU verifier's container environment, as the operator writes it, given to vLLM's and
    Triton's own code: usage statistics off, and every cache and temporary directory they resolve
    under a mount of one of the pod's emptyDirs (a read-only root filesystem refuses anything
    else). Catches: vLLM reporting usage to its server from every pod; a cache in HOME's default,
    the container layer."""
    pod = build_verifier_deployment("demo", "ns", CLUSTER)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    out = subprocess.run([sys.executable, "-c", _RESOLVE], capture_output=True, text=True, timeout=300,
                         env={"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    resolved = json.loads(out.stdout.strip().splitlines()[-1])
    assert resolved["usage_stats"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    writable = [m["mountPath"] for m in c["volumeMounts"] if "emptyDir" in volumes[m["name"]]]
    for what, path in resolved["paths"].items():
        assert any(os.path.commonpath([path, w]) == w for w in writable), (what, path, writable)


def _runtime_image_env() -> dict[str, str]:
    """The ENV of the Dockerfile's runtime stage (the last), ``KEY=value`` pairs."""
    text = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text().replace("\\\n", " ")
    stage = text.rsplit("\nFROM ", 1)[1]
    pairs = [p for line in stage.splitlines() if line.startswith("ENV ") for p in line.split()[1:]]
    return dict(p.split("=", 1) for p in pairs)


def test_the_runtime_images_environment_is_the_pods() -> None:
    """The runtime image (CPU and CUDA builds, `cosine serve` in a container) sets what the operator
    sets in its pods: the caches under HOME, no usage statistics. Catches: an image or a pod whose
    vLLM reports usage, or caches where the other does not mount its volume."""
    env = _runtime_image_env()
    assert RUNTIME_ENV.items() <= env.items(), env
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
