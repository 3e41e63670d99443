"""A leaf's small local regions written as one box: filled region by region, written when full.

Many small shards of one leaf (many local devices, small arrays) then cost one TensorStore write of
their bounding box instead of one write (and its Python overhead) each. A version-3 save that
encodes whole stored shards itself writes one value per stored shard either way, so it merges no
leaf whose regions are all whole stored shards (`SavePlan(whole_shards_apart=...)`).
"""

from __future__ import annotations

import numpy as np

from .binding import LeafBinding, WriteTask
from .boxes import Box, box_shape, box_size, relative_slices

MERGE_BYTES = 64 << 20  # a leaf's local regions are written as one box up to this size
SMALL_REGION = 1 << 20  # ... when they are smaller than this on average (larger: one write each)


def merge_plan(b: LeafBinding, tasks: list[WriteTask], limit: int) -> MergedWrite | None:
    """One MergedWrite for this leaf's device regions when they are small, tile their bounding box
    exactly and it holds at most `limit` bytes; else None (each region is written on its own).

    Merging saves the per-write overhead of many small regions; a large region is written as it
    is (a merge would copy it once more, into fresh memory, for nothing).
    """
    if len(tasks) < 2 or any(t.device is None for t in tasks):
        return None
    if sum(t.nbytes for t in tasks) >= SMALL_REGION * len(tasks):
        return None
    lo = [min(t.box[j][0] for t in tasks) for j in range(len(b.shape))]
    hi = [max(t.box[j][1] for t in tasks) for j in range(len(b.shape))]
    bbox = tuple(zip(lo, hi))
    if box_size(bbox) * b.dtype.itemsize > limit:
        return None
    if box_size(bbox) != sum(box_size(t.box) for t in tasks):
        return None
    return MergedWrite(b, bbox, len(tasks))


class MergedWrite:
    """The regions of one leaf written as one box: filled region by region, written when full."""

    def __init__(self, binding: LeafBinding, box: Box, count: int) -> None:
        self.binding, self.box, self.count = binding, box, count
        self.buf: np.ndarray | None = None
        self.seen = 0

    def add(self, t: WriteTask, data: np.ndarray) -> bool:
        """Copy one region in; True while regions are still missing."""
        if self.buf is None:
            self.buf = np.empty(box_shape(self.box), dtype=np.asarray(data).dtype)
        self.buf[relative_slices(t.box, self.box)] = data
        self.seen += 1
        return self.seen < self.count

    def take(self) -> np.ndarray:
        buf, self.buf, self.seen = self.buf, None, 0
        assert buf is not None
        return buf
