"""A target leaf that stacks fewer atoms than were saved (fewer experts or layers): found by name.

A `Stacked` leaf of `n` entries reads atoms `0 .. n-1` of its template, which all exist when the
checkpoint holds more, so a restore would silently drop the rest (e.g. the experts of a
4-expert checkpoint restored as 2, when no router shape gives it away). `stack_overrun` asks
whether the checkpoint has the atom *one past the end* of any stacked axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .patterns import (
    Averaged,
    Fused,
    Partitioned,
    Replicated,
    Stacked,
    VocabPadded,
    expand_template,
)
from .rename import Renamed

# patterns that keep the atom's name (so the innermost Stacked template names the atom)
_NAME_KEEPING = (Replicated, Averaged, Partitioned, VocabPadded)


def _keeps_name(p: Any) -> bool:
    if isinstance(p, Fused):
        return not p.atoms
    return isinstance(p, _NAME_KEEPING) or type(p).kind in ("Identity", "Transposed")


def _atom_template(inside: tuple[Any, ...], stacked: str) -> str | None:
    """The name template of the atoms a stacked entry reads, from the patterns inside the run of
    `Stacked` (atom outward): the innermost `Stacked`'s own template, unless a pattern renames
    the atom (`Renamed`, `Fused` with `atoms`: the one nearest the atom names it, its first
    part for a Fused); None where that cannot be told (another `Stacked` inside, a pattern of
    unknown kind)."""
    for p in inside:  # nearest the atom first: the last rename applied names the atom
        if isinstance(p, Fused) and p.atoms:
            return str(p.atoms[0])
        if isinstance(p, Renamed):
            return p.atom
        if not _keeps_name(p):
            return None
    return stacked


def stack_overrun(
    chain: tuple[Any, ...], shape: tuple[int, ...], ctx: Any, has: Callable[[str], bool]
) -> tuple[str, int, str] | None:
    """(index name, entries in the leaf, the saved atom past them) of a short stack, or None.

    Only the outermost run of `Stacked` patterns is looked at; the atoms' names come from the
    innermost template, or from the pattern inside the run that renames them (`Renamed`,
    `Fused` with `atoms`: a layer restored short is refused there too).

    Args:
        chain: the leaf's pattern chain, atom outward.
        shape: the leaf's global shape.
        ctx: the leaf's LeafContext (regex match for the templates).
        has: whether the checkpoint has an atom of that name.

    >>> from ucp_jax._src.mapping.patterns import LeafContext
    >>> import re
    >>> ctx = LeafContext("layers.w", re.fullmatch(r"layers\\.(.*)", "layers.w"), {})
    >>> saved = {"b.0.e.0.w", "b.0.e.1.w", "b.0.e.2.w", "b.1.e.0.w"}
    >>> chain = (Stacked(r"b.{i}.e.{e}.\\1", axes=0, index="e"), Stacked(r"b.{i}.e.\\1", axes=0))
    >>> stack_overrun(chain, (2, 2, 8), ctx, saved.__contains__)
    ('e', 2, 'b.0.e.2.w')
    """
    outer: list[tuple[Stacked, int]] = []
    dims = list(shape)
    k = len(chain)
    while k > 0 and isinstance(chain[k - 1], Stacked):
        p = chain[k - 1]
        raw = p.axes if isinstance(p.axes, tuple) else (p.axes,)
        if not dims or any(not -len(dims) <= a < len(dims) for a in raw):
            return None
        axes = sorted({a % len(dims) for a in raw})
        n = 1
        for a in axes:
            n *= dims[a]
        outer.append((p, n))
        dims = [d for j, d in enumerate(dims) if j not in axes]
        k -= 1
    inner = _atom_template(chain[:k], outer[-1][0].atoms) if outer else None
    if inner is None:
        return None
    zeros = tuple((p.index, 0) for p, _ in outer)
    base = expand_template(inner, ctx, zeros)
    if not has(base):
        return None
    for p, n in outer:
        env = tuple((q.index, n if q is p else 0) for q, _ in outer)
        probe = expand_template(inner, ctx, env)
        if probe != base and has(probe):
            return p.index, n, probe
    return None


__all__ = ["stack_overrun"]
