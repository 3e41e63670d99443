"""The snapshot layout: which node keeps which piece of which leaf where, and its redundancy bytes.

Every process of a job computes the same layout without communication (from the leaves' global
shapes and shardings), and every node stores it next to its snapshots, so that recovery can
rebuild any node's bytes from the others'.

A node's blob is `[its pieces | its redundancy bytes]`:

- its pieces: the regions `binding.write_regions` gives its devices (each distinct shard once; a
  shard held by R data-parallel replicas split into R slabs copied by different replicas), each
  piece C-contiguous in the leaf's layout, with its global box, at a 64-byte aligned offset;
  pieces of 64 KiB or more start on a 4 KiB page, unless they continue the previous piece's
  shard (the next slab, right after it), so that slabs of a shard in different blobs can be
  mapped back to back into one array (`stitch`);
- its redundancy, as its group's scheme (`schemes`) says: copies of other nodes' pieces merged
  with its own in (leaf, box) order (`replica`: the previous node of its group, so that the slabs
  of a shard split between the two are adjacent and the blob holds whole shards), and/or a
  redundancy area after its pieces part (`xor`: one parity lane; `rs2`: two, and a digest table).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..mapping.boxes import Box, box_size
from ..util.dtypes import dtype_name, np_dtype
from .schemes import RedundancyScheme, align, scheme_for

ALIGN = 64
PAGE_ALIGN = 4096  # fixed (not this machine's page size): every process computes the same layout
PAGE_MIN = 64 << 10  # pieces this big start on a page
LAYOUT_FORMAT = "ucp-mem-layout/2"
_FORMATS = {"ucp-mem-layout/1": ALIGN, LAYOUT_FORMAT: PAGE_ALIGN}  # format -> page alignment


def _continues(prev: BlobPiece | None, p: BlobPiece) -> bool:
    """Whether `p` is the slab of a shard that comes right after slab `prev`."""
    return (
        prev is not None
        and prev.leaf == p.leaf
        and len(p.box) > 0
        and prev.box[0][1] == p.box[0][0]
        and prev.box[1:] == p.box[1:]
    )


@dataclasses.dataclass(frozen=True)
class LeafMeta:
    """A leaf of the snapshotted state: its name ('params' and 'opt_state.…' names), shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str  # 'param' or 'opt'

    @property
    def nbytes(self) -> int:
        return box_size(tuple((0, d) for d in self.shape)) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class BlobPiece:
    """One piece: region `box` of leaf `leaf`, kept by `node` at `offset` of its blob."""

    leaf: int
    box: Box
    node: int
    offset: int
    nbytes: int


def make_groups(nodes: int, size: int, min_size: int = 2) -> list[list[int]]:
    """Consecutive groups of `size` nodes; a trailing group of fewer than `min_size` (the
    scheme's smallest useful group: 2, or 3 for rs2) joins the previous group.

    >>> make_groups(8, 6, min_size=3), make_groups(9, 6, min_size=3)
    ([[0, 1, 2, 3, 4, 5, 6, 7]], [[0, 1, 2, 3, 4, 5], [6, 7, 8]])
    """
    size = max(1, int(size))
    groups = [list(range(i, min(i + size, nodes))) for i in range(0, nodes, size)]
    if len(groups) > 1 and len(groups[-1]) < max(2, min_size):
        groups[-2].extend(groups.pop())
    return groups


class SnapshotLayout:
    """Where every piece of a snapshot lives, for the whole job.

    Attributes:
        leaves: the leaves, params first then opt_state, in jax's leaf order.
        nodes: number of nodes (processes) of the job that wrote it.
        groups: the redundancy groups (lists of nodes).
        redundancy: the scheme's name, or None (None also when no group has two nodes).
        scheme: the RedundancyScheme of that name, or None.
        pieces: every piece with its offset in its node's blob, in the order given.
        copies: piece -> (node, offset) of each copy other nodes keep inline (replica).
        primary: per node, the size of its pieces part (aligned; its own pieces and the copies
            it keeps).
        red_bytes: per node, the size of its redundancy area (xor's parity lane; else 0).
        digest: a hash of all of it (names the layout in plans/<digest>.json).
    """

    def __init__(
        self,
        leaves: Sequence[LeafMeta],
        nodes: int,
        groups: Sequence[Sequence[int]],
        redundancy: str | None,
        pieces: Sequence[BlobPiece],
        page_align: int = PAGE_ALIGN,
    ) -> None:
        scheme_for(redundancy)  # raises for an unknown name
        self.leaves = list(leaves)
        self.nodes = int(nodes)
        self.groups = [list(g) for g in groups]
        if all(len(g) < 2 for g in self.groups):
            redundancy = None
        self.redundancy = redundancy
        self.scheme: RedundancyScheme | None = scheme_for(redundancy)
        self.group_of = {n: g for g in self.groups for n in g}
        # Offsets are assigned here, deterministically: a node's own pieces (and the copies its
        # scheme keeps inline, e.g. replica's of the previous node) in the order given (leaf by leaf, shard by
        # shard, a shard's slabs in order: `binding.write_regions`'s order), 64-byte aligned, big
        # ones page aligned (not the next slab of the same shard: that stays right after it).
        self.page_align = int(page_align)
        ranked = list(pieces)
        rank = {(p.leaf, p.box, p.node): i for i, p in enumerate(ranked)}
        own: list[list[BlobPiece]] = [[] for _ in range(self.nodes)]
        for p in ranked:
            own[p.node].append(p)
        self.primary: list[int] = []
        placed: dict[tuple[int, Box, int], list[tuple[int, int]]] = {}  # -> [(holder, offset)]
        for n in range(self.nodes):
            slots = list(own[n])
            kept = self.scheme.inline_copies(self, n) if self.scheme is not None else []
            if kept:
                slots += [p for m in kept for p in own[m]]
                slots.sort(key=lambda p: rank[(p.leaf, p.box, p.node)])
            end, prev = 0, None
            for p in slots:
                page = p.nbytes >= PAGE_MIN and not _continues(prev, p)
                off = align(end, self.page_align if page else ALIGN)
                end, prev = off + p.nbytes, p
                placed.setdefault((p.leaf, p.box, p.node), []).append((n, off))
            self.primary.append(align(end))
        self.pieces: list[BlobPiece] = []
        self.copies: dict[BlobPiece, list[tuple[int, int]]] = {}
        for p in ranked:
            locs = placed[(p.leaf, p.box, p.node)]
            piece = dataclasses.replace(p, offset=dict(locs)[p.node])
            self.pieces.append(piece)
            others = [(h, off) for h, off in locs if h != p.node]
            if others:
                self.copies[piece] = others
        self.by_node: list[list[BlobPiece]] = [[] for _ in range(self.nodes)]
        self.by_leaf: list[list[BlobPiece]] = [[] for _ in self.leaves]
        for p in self.pieces:
            self.by_node[p.node].append(p)
            self.by_leaf[p.leaf].append(p)
        self.red_bytes = [
            self.scheme.extra_bytes(self, n) if self.scheme is not None else 0
            for n in range(self.nodes)
        ]
        self.digest = hashlib.sha1(self.to_json().encode()).hexdigest()[:16]

    # ------------------------------------------------------------------------------ geometry

    def size(self, n: int) -> int:
        """Bytes of node n's blob."""
        return self.primary[n] + self.red_bytes[n]

    def copy_offset(self, p: BlobPiece, holder: int) -> int:
        """The offset of the copy of piece `p` that node `holder` keeps inline."""
        return dict(self.copies[p])[holder]

    def locations(self, p: BlobPiece) -> list[tuple[int, int]]:
        """(node, offset) of every copy of a piece: its own node's, then the inline copies'."""
        return [(p.node, p.offset), *self.copies.get(p, [])]

    def shift(self, i: int, k: int) -> int:
        """Ring distance from node i to node k in their group (k = i + shift)."""
        g = self.group_of[i]
        return (g.index(k) - g.index(i)) % len(g)

    def gaps(self, n: int) -> list[tuple[int, int]]:
        """Byte ranges of node n's pieces part that no piece covers (alignment padding).

        They are zero-filled (the redundancy area after the pieces part is zeroed as a whole).
        """
        out = []
        pos = 0
        spans = [(p.offset, p.nbytes) for p in self.by_node[n]]
        spans += [(off, p.nbytes) for p, locs in self.copies.items() for h, off in locs if h == n]
        for off, nb in sorted(spans):
            if off > pos:
                out.append((pos, off - pos))
            pos = max(pos, off + nb)
        if self.primary[n] > pos:
            out.append((pos, self.primary[n] - pos))
        return out

    # ---------------------------------------------------------------------------- (de)serialise

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": next(f for f, a in _FORMATS.items() if a == self.page_align),
                "nodes": self.nodes,
                "groups": self.groups,
                "redundancy": self.redundancy,
                "leaves": [
                    [m.name, list(m.shape), dtype_name(m.dtype), m.kind] for m in self.leaves
                ],
                "pieces": [
                    [p.leaf, [list(ab) for ab in p.box], p.node, p.nbytes] for p in self.pieces
                ],  # offsets follow from the order (see __init__)
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> SnapshotLayout:
        d: dict[str, Any] = json.loads(text)
        if d.get("format") not in _FORMATS:
            raise ValueError(f"not a snapshot layout this version reads ({d.get('format')!r})")
        leaves = [LeafMeta(n, tuple(s), np_dtype(t), k) for n, s, t, k in d["leaves"]]
        pieces = [
            BlobPiece(leaf, tuple((a, b) for a, b in box), node, 0, nb)
            for leaf, box, node, nb in d["pieces"]
        ]
        return cls(leaves, d["nodes"], d["groups"], d["redundancy"], pieces, _FORMATS[d["format"]])


def build_pieces(
    leaves: Sequence[LeafMeta], regions: Sequence[Sequence[tuple[Box, int]]], nodes: int
) -> list[BlobPiece]:
    """The pieces of every node (their offsets are assigned by `SnapshotLayout`).

    Args:
        leaves: the leaves.
        regions: per leaf, (box, node) of each region (from `binding.write_regions`).
        nodes: number of nodes.
    """
    out = []
    for li, (meta, regs) in enumerate(zip(leaves, regions)):
        for box, node in regs:
            if not 0 <= node < nodes:
                raise ValueError(f"region {box} of {meta.name!r} on node {node} of {nodes}")
            out.append(BlobPiece(li, box, node, 0, box_size(box) * meta.dtype.itemsize))
    return out
