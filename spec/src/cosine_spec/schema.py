"""The schema engine of the spec's types: a field declared once with :func:`spec_field` (its key
in the spec, its default, its bounds and its allowed values), checked on construction
(:class:`Checked`), read from a spec mapping as strictly as the API server's schema reads it
(:func:`read_fields`), written back (:func:`to_spec`) and listed for the CRD
(:func:`spec_declarations`, what ``spec/crdgen.py`` writes into ``crds/``).
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, field, fields, is_dataclass
from typing import Any, ClassVar


def spec_field(
    key: str,
    default: Any = MISSING,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    enum: tuple[str, ...] | None = None,
    verbatim: bool = False,
    default_factory: Any = MISSING,
) -> Any:
    """A dataclass field read from the spec key ``key``, with the CRD's default, ``minimum``,
    ``maximum`` (inclusive) and ``enum``; no default: the key is required. ``verbatim``: the value
    is copied into pod templates as written (its inner schema is Kubernetes', not ours)."""
    meta = {"key": key, "minimum": minimum, "maximum": maximum, "enum": enum, "verbatim": verbatim}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


class Checked:
    """Checks every :func:`spec_field`'s bounds and enum on construction."""

    SPEC_PATH: ClassVar[str] = "spec"

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            meta, value = f.metadata, getattr(self, f.name)
            lo, hi, enum = meta.get("minimum"), meta.get("maximum"), meta.get("enum")
            if value is None or (lo is None and hi is None and enum is None):
                continue
            where = f"{self.SPEC_PATH}.{meta['key']}"
            if enum is not None and value not in enum:
                raise ValueError(f"{where} must be one of {list(enum)}, got {value!r}")
            if lo is not None and hi is not None and not lo <= value <= hi:
                raise ValueError(f"{where} must be in [{lo}, {hi}], got {value}")
            if lo is not None and value < lo:
                raise ValueError(f"{where} must be >= {lo}, got {value}")
            if hi is not None and value > hi:
                raise ValueError(f"{where} must be <= {hi}, got {value}")


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


def _coerce(value: Any, hint: Any) -> Any:
    """``value`` as the field type ``hint``, strictly as the API server's schema types read it: an
    ``integer`` is an int (a float only when integral, as JSON decoding gives), never a bool; a
    ``number`` is an int or a float; a ``string`` a str; a ``boolean`` a bool; arrays and objects are
    lists and mappings. Raises ``ValueError`` saying what was expected and what came."""
    if isinstance(hint, types.UnionType):  # `X | None`: the value is not None here
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint) or hint
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"expected an array, got {_type_name(value)} {value!r}")
        item = typing.get_args(hint)[0]
        return tuple(_coerce(v, item) for v in value) if item in (str, int, float, bool) else tuple(value)
    if origin in (Mapping, dict):
        if not isinstance(value, Mapping):
            raise ValueError(f"expected an object, got {_type_name(value)} {value!r}")
        return json.loads(json.dumps(dict(value)))  # a plain deep copy (kopf bodies are views)
    if origin is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if origin is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"expected an integer, got {_type_name(value)} {value!r}")
        return value
    if origin is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"expected a number, got {_type_name(value)} {value!r}")
        return float(value)
    if origin is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {_type_name(value)} {value!r}")
        return value
    return origin(value)


def spec_keys(cls: type) -> frozenset[str]:
    """The spec keys a mapping read into ``cls`` may hold: its fields' keys and those of its
    key-less nested dataclasses (``pod``: :class:`PodOverrides`, read from the same mapping)."""
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in fields(cls):
        key = f.metadata.get("key")
        if key is not None:
            keys.add(key)
        elif isinstance(hints[f.name], type) and is_dataclass(hints[f.name]):
            keys |= spec_keys(hints[f.name])
    return frozenset(keys)


def refuse_unknown(path: str, raw: Mapping[str, Any], known: frozenset[str],
                   unknown: dict[str, str] | None = None) -> None:
    """Raise ``ValueError`` naming ``path.<key>`` for the first key of ``raw`` not in ``known``, with
    the closest known key as a suggestion: what the API server's strict field validation
    (``kubectl apply``'s default since Kubernetes 1.27) answers for a field the schema lacks.

    ``unknown`` (a dict): tolerant instead: every such key's path (``spec.speculation.newField``)
    maps to that message and nothing is raised. Software reading what the API server stored is
    tolerant: a later release's CRD defaults fields this release does not know, on write and on
    read, so a strict reader would refuse every object (:func:`cosine_spec.cluster_spec.read_stored_spec`)."""
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(sorted(known))}"
            message = f"{path}.{key}: unknown field{hint}"
            if unknown is None:
                raise ValueError(message)
            unknown[f"{path}.{key}"] = message


def read_fields(cls: type, raw: Mapping[str, Any], *, unknown: dict[str, str] | None = None, **given: Any) -> Any:
    """``cls`` (a dataclass of :func:`spec_field` fields) from the spec mapping ``raw``: each field
    from its key (absent or null: the field's default), of the field's type; ``given`` sets fields
    directly. Raises ``ValueError`` naming the field on an unknown key, a missing required key, a
    value of the wrong type (no coercion: ``3.9`` is no integer, ``true`` no count, ``123`` no
    string) or one out of bounds. ``unknown``: collect unknown keys there instead of raising
    (:func:`refuse_unknown`)."""
    path = getattr(cls, "SPEC_PATH", "spec")
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path} must be a mapping, got {type(raw).__name__}")
    refuse_unknown(path, raw, spec_keys(cls), unknown)
    hints = typing.get_type_hints(cls)
    kwargs = dict(given)
    for f in fields(cls):
        key = f.metadata.get("key")
        if key is None or f.name in kwargs or is_dataclass(hints[f.name]):
            continue
        value = raw.get(key)
        if value is None:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"{path}.{key} is required")
            continue
        try:
            kwargs[f.name] = _coerce(value, hints[f.name])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}.{key}: {e}") from e
    return cls(**kwargs)


def to_spec(obj: Any) -> dict[str, Any]:
    """The spec mapping of a dataclass of :func:`spec_field` fields, keyed as in the CRD
    (``maxDraftLen``): what :func:`read_fields` reads back into an equal object. Nested
    dataclasses and ``None`` values are left out."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        key, value = f.metadata.get("key"), getattr(obj, f.name)
        if key is None or value is None or is_dataclass(value):
            continue
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def spec_declarations(cls: type, prefix: str = "") -> dict[str, Mapping[str, Any]]:
    """Every :func:`spec_field` under ``cls`` by its spec path (``drafterPools[].replicas``):
    ``default`` (absent when there is none), ``minimum``, ``maximum``, ``enum``, ``verbatim``.
    What the CRD is checked against."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Mapping[str, Any]] = {}
    for f in fields(cls):
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):
            (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        key = f.metadata.get("key")
        if typing.get_origin(hint) is tuple and is_dataclass(typing.get_args(hint)[0]):
            out.update(spec_declarations(typing.get_args(hint)[0], f"{prefix}{key}[]."))
        elif isinstance(hint, type) and is_dataclass(hint):
            # a field without a key (``pod``) is read from the same mapping
            out.update(spec_declarations(hint, f"{prefix}{key}." if key else prefix))
        elif key is not None:
            decl = {k: f.metadata[k] for k in ("minimum", "maximum", "enum", "verbatim")}
            if f.default is not MISSING and f.default is not None and f.default != ():  # () : unset
                decl["default"] = f.default
            out[prefix + key] = decl
    return out
