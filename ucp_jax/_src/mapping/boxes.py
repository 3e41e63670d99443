"""Boxes: hyper-rectangles of an array as (start, stop) per axis, and the slices that index them.

>>> box = ((0, 2), (4, 8))
>>> box_shape(box), box_size(box), to_slices(box)
((2, 4), 8, (slice(0, 2, None), slice(4, 8, None)))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, int], ...]  # (start, stop) per axis
_ENDS: dict[int, tuple[tuple[tuple[int, int], ...], set[int]]] = {}  # id(intervals) -> ends


def box_shape(box: Box) -> tuple[int, ...]:
    """Extent of a box along each axis."""
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    """Number of elements in a box."""
    return math.prod(box_shape(box))


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole array of `shape`."""
    return tuple((0, int(d)) for d in shape)


def overlaps(a: Box, b: Box) -> bool:
    """Whether two boxes of one array share an element (0-d boxes: always).

    >>> overlaps(((0, 2), (0, 4)), ((1, 3), (3, 8))), overlaps(((0, 2),), ((2, 4),)), overlaps((), ())
    (True, False, True)
    """
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


def to_slices(box: Box) -> tuple[slice, ...]:
    """A box as a tuple of slices, for numpy / TensorStore indexing."""
    return tuple(slice(a, b) for a, b in box)


def relative_slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices of box `inner` in an array holding box `outer` (inner lies within outer)."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def index_to_box(index: tuple[slice, ...] | None, shape: Sequence[int]) -> Box:
    """A jax shard index (tuple of slices; None: the whole array) as a box with concrete bounds."""
    index = index or ()
    out = []
    for sl, dim in zip(index, shape):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ValueError(f"strided shard index {index} is not supported")
        out.append((start, max(start, stop)))
    out.extend((0, d) for d in shape[len(index) :])
    return tuple(out)


def interval_ends(intervals: tuple[tuple[int, int], ...]) -> set[int]:
    """Every start and stop of `intervals`; the same set again for the same tuple (planning maps
    the same cached per-axis intervals for many leaves): read it, do not change it.

    >>> sorted(interval_ends(((0, 4), (4, 8))))
    [0, 4, 8]
    """
    hit = _ENDS.get(id(intervals))
    if hit is not None and hit[0] is intervals:
        return hit[1]
    if len(_ENDS) >= 1024:
        _ENDS.clear()
    ends = {x for iv in intervals for x in iv}
    _ENDS[id(intervals)] = (intervals, ends)  # holds the tuple: its id stays its own
    return ends
