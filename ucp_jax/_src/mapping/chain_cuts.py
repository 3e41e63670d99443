"""A patterned leaf's writer boundaries per atom from its per-axis cuts: no per-region work.

`binding.atom_boundaries` maps every writer region of the job through the leaf's pattern chain
and collects the ends of every atom piece: O(regions × pieces) per leaf, and the regions of a
sharded leaf grow with the device count. But the regions of a sharding form a product grid: along
each leaf axis the same intervals (its shards, or their replica slabs), combined in every way. And
every built-in pattern maps an axis's interval whatever the other axes hold: `Fused` and
`VocabPadded` split the interval on their axis, `Transposed` permutes axes, `Stacked` makes one
atom per index of its axes, identities and `Renamed` change at most the name. So the pieces of a
region are the combinations of what its axis intervals map to, and an atom's boundaries along an
axis are the ends of that axis's intervals mapped through the chain, restricted to the pieces of
that atom. `chain_cuts` follows the intervals of each axis down the chain as *lanes* (one per
distinct inner array, with the intervals it receives per axis): O(intervals per axis + atoms).
`tests/test_chain_cuts.py` checks it equals `atom_boundaries` for every pattern and combination.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TypeVar

from .boxes import full_box, interval_ends
from .patterns import (
    Averaged,
    Fused,
    LeafContext,
    Node,
    Partitioned,
    Pattern,
    PatternChain,
    Replicated,
    Stacked,
    Transposed,
    VocabPadded,
    _axis,
)
from .rename import Renamed

Interval = tuple[int, int]
T = TypeVar("T")
_IDENTITIES = (Pattern, Replicated, Averaged, Partitioned)
_KNOWN = (*_IDENTITIES, Renamed, Transposed, VocabPadded, Fused, Stacked)


@dataclasses.dataclass(frozen=True)
class _Lane:
    """One inner array of the chain and the intervals the leaf's regions cover along its axes.

    Attributes:
        node: its name, shape, axis map, index environment and fused marks (box: the full array).
        spans: per axis of the inner array, the distinct intervals of the regions' pieces.
    """

    node: Node
    spans: tuple[tuple[Interval, ...], ...]


def knows(chain: PatternChain) -> bool:
    """Whether every pattern of `chain` is one whose per-axis behaviour `chain_cuts` knows."""
    return all(type(p) in _KNOWN for p in chain)


def chain_cuts(
    chain: PatternChain,
    ctx: LeafContext,
    shape: Sequence[int],
    axes: Sequence[Sequence[Interval]],
) -> dict[str, list[set[int]]] | None:
    """Per atom, per atom axis, the offsets where one writer's piece ends and the next begins.

    Args:
        chain: the leaf's patterns, atom outward.
        ctx: the leaf's name, rule match and mesh axis sizes.
        shape: the leaf's global shape.
        axes: per leaf axis, the distinct intervals of the writer regions along it; the regions
            are every combination of one interval per axis (a product grid).

    Returns:
        What `binding.atom_boundaries` gives for those regions (the sets may be shared between
        atoms: read them, do not change them), or None when the chain holds a pattern whose
        per-axis behaviour is not known here (a registered one): use `atom_boundaries` then.
    """
    if not knows(chain):
        return None
    dims = tuple(int(d) for d in shape)
    full = full_box(dims)
    root = Node(ctx.base or ctx.name, full, dims, full, tuple(range(len(dims))))
    lanes = [_Lane(root, tuple(tuple(a) for a in axes))]
    for p in reversed(chain):
        lanes = [m for lane in lanes for m in _split(p, lane, ctx)]
    out: dict[str, list[set[int]]] = {}
    for lane in lanes:
        assert lane.node.name is not None
        mine = [interval_ends(spans) for spans in lane.spans]  # shared by lanes and leaves
        seen = out.get(lane.node.name)
        out[lane.node.name] = mine if seen is None else [a | b for a, b in zip(seen, mine)]
    return out


def _split(p: Pattern, lane: _Lane, ctx: LeafContext) -> list[_Lane]:
    """The lanes one lane becomes through pattern `p` (padding dropped)."""
    node, spans = lane.node, lane.spans
    if type(p) in _IDENTITIES:
        return [lane]
    if isinstance(p, Renamed):
        return [_Lane(n, spans) for n in p.split(node, ctx)]
    if isinstance(p, Transposed):
        (inner,) = p.split(node, ctx)  # checks the perm; permutes shape, axis map, fused marks
        moved: list[tuple[Interval, ...]] = [()] * len(spans)
        for j, q in enumerate(p.perm):
            moved[q] = spans[j]
        return [_Lane(inner, tuple(moved))]
    if isinstance(p, Fused | VocabPadded):
        return _split_axis(p, lane, ctx)
    assert isinstance(p, Stacked)
    return _split_stacked(p, lane, ctx)


def _split_axis(p: Fused | VocabPadded, lane: _Lane, ctx: LeafContext) -> list[_Lane]:
    """A pattern acting on one axis: each interval of that axis split by the pattern itself."""
    node, spans = lane.node, lane.spans
    ax = _axis(p.axis, node.shape, ctx, p)
    groups: dict[tuple[object, ...], tuple[Node, dict[Interval, None]]] = {}
    for iv in spans[ax]:
        probe = dataclasses.replace(node, box=_put(node.box, ax, iv))
        for sub in p.split(probe, ctx):
            if sub.name is None:  # padding: no atom
                continue
            key = (sub.name, sub.shape, sub.fused)
            group = groups.get(key)
            if group is None:
                group = groups[key] = (sub, {})
            group[1][sub.box[ax]] = None
    out = []
    for sub, ivs in groups.values():
        box = full_box(sub.shape)
        inner = dataclasses.replace(sub, box=box, leaf_box=node.leaf_box)
        out.append(_Lane(inner, _put(spans, ax, tuple(ivs))))
    return out


def _split_stacked(p: Stacked, lane: _Lane, ctx: LeafContext) -> list[_Lane]:
    """One lane per index of the stacked axes that some region covers; those axes removed."""
    node, spans = lane.node, lane.spans
    assert isinstance(p.axes, tuple)
    axes = [_axis(a, node.shape, ctx, p) for a in p.axes]
    kept = tuple(s for j, s in enumerate(spans) if j not in axes)
    out: list[_Lane] = []
    for runs in itertools.product(*(_runs(spans[a]) for a in axes)):
        box = node.box
        for a, run in zip(axes, runs):
            box = _put(box, a, run)
        probe = dataclasses.replace(node, box=box)
        out.extend(_Lane(n, kept) for n in p.split(probe, ctx))
    return out


def _runs(intervals: Sequence[Interval]) -> list[Interval]:
    """The maximal runs of positions that `intervals` cover (empty intervals cover none)."""
    out: list[Interval] = []
    for lo, hi in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _put(t: tuple[T, ...], i: int, v: T) -> tuple[T, ...]:
    return (*t[:i], v, *t[i + 1 :])


__all__ = ["chain_cuts", "knows"]
