"""Boxes: hyper-rectangles of an array as (start, stop) per axis, and the slices that index them
(and the box a numpy basic index reads).

>>> box = ((0, 2), (4, 8))
>>> box_shape(box), box_size(box), to_slices(box)
((2, 4), 8, (slice(0, 2, None), slice(4, 8, None)))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

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


def basic_index(
    index: Any, shape: tuple[int, ...], where: str
) -> tuple[list[tuple[int, int]], tuple[Any, ...]]:
    """The box a numpy basic index reads, and the index that takes its result from that box.

    Ints (negative ones from the end), slices (any step, clipped as numpy clips them),
    ``...`` and ``None``, with numpy's meaning; the box is what storage reads.

    Raises:
        IndexError: an int out of range, too many indices, or an index that is not basic.

    >>> basic_index((slice(2, 5), -1), (8, 8), "x")
    ([(2, 5), (7, 8)], (slice(0, None, 1), 0))
    >>> basic_index(np.s_[::-2], (5,), "x")
    ([(0, 5)], (slice(None, None, -2),))
    """
    items = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in items) > 1:
        raise IndexError(f"{where}: an index can only have a single ellipsis ('...')")
    used = sum(i is not None and i is not Ellipsis for i in items)
    if used > len(shape):
        raise IndexError(
            f"{where}: too many indices: the array has {len(shape)} dimensions, {used} were indexed"
        )
    k = next((j for j, i in enumerate(items) if i is Ellipsis), len(items))
    items = items[:k] + (slice(None),) * (len(shape) - used) + items[k + 1 :]
    box: list[tuple[int, int]] = []
    local: list[Any] = []
    axis = 0
    for i in items:
        if i is None:
            local.append(None)
            continue
        n = shape[axis]
        if isinstance(i, int | np.integer) and not isinstance(i, bool | np.bool_):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise IndexError(
                    f"{where}: index {int(i)} is out of bounds for axis {axis} with size {n}"
                )
            box.append((j, j + 1))
            local.append(0)
        elif isinstance(i, slice):
            r = range(*i.indices(n))
            if not r:
                box.append((0, 0))
                local.append(slice(0, 0))
            elif r.step > 0:
                box.append((r[0], r[-1] + 1))
                local.append(slice(0, None, r.step))
            else:
                box.append((r[-1], r[0] + 1))
                local.append(slice(None, None, r.step))
        else:
            raise IndexError(
                f"{where}: {type(i).__name__} index {i!r:.60}: only basic indices (ints, slices, "
                "..., None) read a region; read the region and index the result for the rest"
            )
        axis += 1
    return box, tuple(local)
