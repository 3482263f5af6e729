"""A `CoSineCluster` manifest as the runtime reads it: the file, the object, its parsed spec.

`cosine serve`, `cosine drafter`, `cosine verifier`, `cosine demo` and `cosine bench` read a
manifest here, once per process, and refuse an invalid one naming the field (the spec types and
their strict parser are the spec distribution's, `cosine_spec.cluster_spec`: one reading of the
spec for the API server's webhook and the runtime alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from cosine_spec.verifier_spec import engine_args_problems

if TYPE_CHECKING:
    from cosine_spec.cluster_spec import ClusterSpec

DEFAULT_CLUSTER = "default_cluster.yaml"


@dataclass(frozen=True)
class Manifest:
    """A CoSineCluster manifest, read and checked once per process (`load_manifest`).

    path: the file (None: the cluster shipped with cosine), which child processes (drafters, a
    `cosine serve`) are given to read themselves. obj: the object as written (copies are derived
    from it, e.g. the bench's ablations). spec: its `spec`, parsed (`ClusterSpec`)."""

    path: Path | None
    obj: dict[str, Any]
    spec: ClusterSpec


def load_manifest(path: Path | None) -> Manifest:
    """Read a CoSineCluster manifest (default: the one shipped for this machine) and check it:
    its spec parsed, `spec.verifier.engineArgs` free of the flags CoSine sets itself
    (`cosine_spec.verifier_spec.engine_args_problems`, the admission webhook's check, for manifests
    no webhook saw) and its pools' tokenizers checked against the target's (`tokenizer_problems`).

    Raises:
        ValueError: not a CoSineCluster, or an invalid spec (the message names the field).
    """
    text = path.read_text() if path else resources.files("cosine").joinpath(DEFAULT_CLUSTER).read_text()
    obj = yaml.safe_load(text)
    if not isinstance(obj, dict) or obj.get("kind") != "CoSineCluster":
        kind = obj.get("kind") if isinstance(obj, dict) else None
        raise ValueError(f"{path or DEFAULT_CLUSTER}: not a CoSineCluster manifest (kind is {kind!r})")
    spec = parse_spec(obj)
    problems = engine_args_problems(spec.verifier) + tokenizer_problems(spec)
    if problems:
        raise ValueError(f"{path or DEFAULT_CLUSTER}: " + "; ".join(problems))
    return Manifest(path, obj, spec)


def parse_spec(obj: dict[str, Any]) -> ClusterSpec:
    """The manifest's `spec` as an `operator.settings.ClusterSpec`.

    Raises:
        ValueError: an invalid spec (a missing or ill-typed field; the message names it).
    """
    from cosine_spec.cluster_spec import parse_cluster_spec

    try:
        return parse_cluster_spec(obj.get("spec") or {})
    except (KeyError, TypeError) as e:
        raise ValueError(f"invalid CoSineCluster spec: {e}") from e


def tokenizer_problems(spec) -> list[str]:
    """`cosine_spec.catalogue.tokenizer_problems` (the admission webhook's check, for manifests
    no webhook saw), with families from the model store (it also knows directories it wrote)."""
    from cosine_spec.catalogue import tokenizer_problems as problems

    from cosine.model_store import tokenizer_family

    return problems(spec, tokenizer_family)
