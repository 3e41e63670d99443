"""Patterns as the manifest records them: JSON in and out, the registry of pattern kinds.

A manifest names each pattern by its `kind` (``{"type": "Transposed", "perm": [1, 0]}``); reading
it back looks the kind up here. The built-in patterns are registered below; a pattern class
written elsewhere (tests, experiments, `rename.Renamed`) registers itself with `register_pattern`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import PatternError
from .patterns import (
    Averaged,
    Fused,
    FusedMark,
    Partitioned,
    Pattern,
    PatternChain,
    Replicated,
    Stacked,
    Transposed,
    VocabPadded,
)

_KINDS: dict[str, type[Pattern]] = {
    c.kind: c for c in (Replicated, Averaged, Partitioned, Transposed, VocabPadded, Fused, Stacked)
}


def pattern_from_json(d: Mapping[str, Any]) -> Pattern:
    """Rebuild a pattern from its manifest JSON.

    >>> pattern_from_json({"type": "Transposed", "perm": [1, 0]})
    Transposed(perm=(1, 0))

    Raises:
        PatternError: an unknown pattern type (written by a newer ucp_jax).
    """
    d = dict(d)
    kind = d.pop("type")
    if kind == "Identity":
        return Pattern()
    if kind not in _KINDS:
        raise PatternError(f"unknown pattern type {kind!r} in manifest; upgrade ucp_jax")
    cls = _KINDS[kind]
    for k, v in d.items():
        if isinstance(v, list):
            d[k] = tuple(v)
    return cls(**d)


def register_pattern(cls: type[Pattern]) -> type[Pattern]:
    """Make a Pattern subclass readable from manifests by its `kind` (usable as a decorator).

    The built-in patterns are registered here; a new pattern class is written in `patterns` and
    added to `_KINDS`, or, outside it (tests, experiments), registered with this function.
    """
    _KINDS[cls.kind] = cls
    return cls


def chain_to_json(chain: Sequence[Pattern]) -> list[dict[str, Any]]:
    """A pattern chain (atom outward) as the manifest records it.

    >>> chain_to_json((VocabPadded(50257), Partitioned(1)))
    [{'type': 'VocabPadded', 'size': 50257, 'axis': 0}, {'type': 'Partitioned', 'axis': 1}]
    """
    return [p.to_json() for p in chain]


def chain_from_json(data: Sequence[Mapping[str, Any]]) -> PatternChain:
    """The inverse of `chain_to_json`.

    Raises:
        PatternError: an unknown pattern type (written by a newer ucp_jax).
    """
    return tuple(pattern_from_json(d) for d in data)


def chain_text(data: Sequence[Mapping[str, Any]]) -> str:
    """A recorded chain (manifest JSON) as text for people, e.g. 'VocabPadded(size=10, axis=0)'.

    Reads the JSON as it is (no validation), so that `ucp inspect` shows any manifest.

    >>> chain_text([{"type": "Fused", "sizes": [4, 2], "axis": 1, "shard_axis": None}])
    'Fused(sizes=[4, 2], axis=1)'
    >>> chain_text([])
    'identity'
    """
    if not data:
        return "identity"
    parts = []
    for p in data:
        args = ", ".join(f"{k}={v}" for k, v in p.items() if k != "type" and v is not None)
        parts.append(f"{p['type']}({args})")
    return " -> ".join(parts)


def fused_marks_to_json(marks: Sequence[FusedMark]) -> list[dict[str, Any]]:
    """The `fused` record of an atom: one entry per fusion mark."""
    return [m.to_json() for m in marks]
