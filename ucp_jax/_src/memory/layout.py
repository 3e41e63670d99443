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
- `redundancy="replica"`: also every piece of the previous node of its group (nodes are grouped
  consecutively; in a group of 2 the two nodes mirror each other), merged with its own pieces in
  (leaf, box) order, so that the slabs of a shard split between the two are adjacent: the node's
  blob holds whole shards a restore can hand over without assembling them;
- `redundancy="xor"`: one parity lane. Node i's pieces part is cut into G-1 lanes of C bytes, one
  per other member k of its group; node k keeps the XOR of the lanes the others cut for it. Losing
  one node of a group loses its data and its parity lane, and its data is the XOR of the others'
  lanes with the parity lanes they keep (SCR-style, 1/(G-1) extra memory).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..format.dtypes import dtype_name, np_dtype
from ..mapping.patterns import Box, box_size

ALIGN = 64
PAGE_ALIGN = 4096  # fixed (not this machine's page size): every process computes the same layout
PAGE_MIN = 64 << 10  # pieces this big start on a page
LAYOUT_FORMAT = "ucp-mem-layout/2"
_FORMATS = {"ucp-mem-layout/1": ALIGN, LAYOUT_FORMAT: PAGE_ALIGN}  # format -> page alignment
REDUNDANCY = (None, "replica", "xor")


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _continues(prev: PieceRec | None, p: PieceRec) -> bool:
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
class PieceRec:
    """One piece: region `box` of leaf `leaf`, kept by `node` at `offset` of its blob."""

    leaf: int
    box: Box
    node: int
    offset: int
    nbytes: int


def make_groups(nodes: int, size: int) -> list[list[int]]:
    """Consecutive groups of `size` nodes; a trailing group of one joins the previous group."""
    size = max(1, int(size))
    groups = [list(range(i, min(i + size, nodes))) for i in range(0, nodes, size)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        groups[-2].extend(groups.pop())
    return groups


class Layout:
    """Where every piece of a snapshot lives, for the whole job.

    Attributes:
        leaves: the leaves, params first then opt_state, in jax's leaf order.
        nodes: number of nodes (processes) of the job that wrote it.
        groups: the redundancy groups (lists of nodes).
        redundancy: None, 'replica' or 'xor' (None when no group has two nodes).
        pieces: every piece with its offset in its node's blob, in the order given.
        backup_offset: replica: piece -> its offset in the blob of the node keeping a copy.
        primary: per node, the size of its pieces part (aligned; with replica, its own pieces
            and the copies it keeps).
        red_bytes: per node, the size of its parity lane (xor; 0 otherwise).
        digest: a hash of all of it (names the layout in plans/<digest>.json).
    """

    def __init__(
        self,
        leaves: Sequence[LeafMeta],
        nodes: int,
        groups: Sequence[Sequence[int]],
        redundancy: str | None,
        pieces: Sequence[PieceRec],
        page_align: int = PAGE_ALIGN,
    ) -> None:
        if redundancy not in REDUNDANCY:
            raise ValueError(f"redundancy must be one of {REDUNDANCY}, not {redundancy!r}")
        self.leaves = list(leaves)
        self.nodes = int(nodes)
        self.groups = [list(g) for g in groups]
        if all(len(g) < 2 for g in self.groups):
            redundancy = None
        self.redundancy = redundancy
        self.group_of = {n: g for g in self.groups for n in g}
        # Offsets are assigned here, deterministically: a node's own pieces (and, for replica,
        # the pieces it keeps for the previous node) in the order given (leaf by leaf, shard by
        # shard, a shard's slabs in order: `binding.write_regions`'s order), 64-byte aligned, big
        # ones page aligned (not the next slab of the same shard: that stays right after it).
        self.page_align = int(page_align)
        ranked = list(pieces)
        rank = {(p.leaf, p.box, p.node): i for i, p in enumerate(ranked)}
        own: list[list[PieceRec]] = [[] for _ in range(self.nodes)]
        for p in ranked:
            own[p.node].append(p)
        self.backup_offset: dict[PieceRec, int] = {}
        self.primary = []
        placed: dict[tuple[int, Box, int, bool], int] = {}
        for n in range(self.nodes):
            slots = [(p, False) for p in own[n]]
            if self.redundancy == "replica" and len(self.group_of[n]) > 1:
                slots += [(p, True) for p in own[self.backup_of(n)]]
                slots.sort(key=lambda s: rank[(s[0].leaf, s[0].box, s[0].node)])
            end, prev = 0, None
            for p, backup in slots:
                page = p.nbytes >= PAGE_MIN and not _continues(prev, p)
                off = align(end, self.page_align if page else ALIGN)
                end, prev = off + p.nbytes, p
                placed[(p.leaf, p.box, p.node, backup)] = off
            self.primary.append(align(end))
        self.pieces: list[PieceRec] = [
            dataclasses.replace(p, offset=placed[(p.leaf, p.box, p.node, False)]) for p in ranked
        ]
        if self.redundancy == "replica":
            for p in self.pieces:
                if self.holder_of(p.node) != p.node:
                    self.backup_offset[p] = placed[(p.leaf, p.box, p.node, True)]
        self.by_node: list[list[PieceRec]] = [[] for _ in range(self.nodes)]
        self.by_leaf: list[list[PieceRec]] = [[] for _ in self.leaves]
        for p in self.pieces:
            self.by_node[p.node].append(p)
            self.by_leaf[p.leaf].append(p)
        self.chunk = {}
        for g in self.groups:
            if len(g) > 1:
                self.chunk[g[0]] = align(-(-max(self.primary[n] for n in g) // (len(g) - 1)))
        self.red_bytes = [self._red_bytes(n) for n in range(self.nodes)]
        self.digest = hashlib.sha1(self.to_json().encode()).hexdigest()[:16]

    # ------------------------------------------------------------------------------ geometry

    def _red_bytes(self, n: int) -> int:
        g = self.group_of[n]
        if self.redundancy != "xor" or len(g) < 2:
            return 0
        return self.chunk[g[0]]

    def size(self, n: int) -> int:
        """Bytes of node n's blob."""
        return self.primary[n] + self.red_bytes[n]

    def backup_of(self, n: int) -> int:
        """replica: the node whose pieces node n keeps (the previous one in its group)."""
        g = self.group_of[n]
        return g[(g.index(n) - 1) % len(g)]

    def holder_of(self, n: int) -> int:
        """replica: the node keeping node n's pieces (the next one in its group)."""
        g = self.group_of[n]
        return g[(g.index(n) + 1) % len(g)]

    def lane(self, i: int, k: int) -> tuple[int, int]:
        """xor: the bytes [start, stop) of node i's pieces part that go into node k's parity."""
        g = self.group_of[i]
        others = [m for m in g if m != i]
        c = self.chunk[g[0]]
        start = others.index(k) * c
        return start, max(start, min(start + c, self.primary[i]))

    def locations(self, p: PieceRec) -> list[tuple[int, int]]:
        """(node, offset) of every copy of a piece: its own node's, then a replica's."""
        out = [(p.node, p.offset)]
        if p in self.backup_offset:
            out.append((self.holder_of(p.node), self.backup_offset[p]))
        return out

    def shift(self, i: int, k: int) -> int:
        """Ring distance from node i to node k in their group (k = i + shift)."""
        g = self.group_of[i]
        return (g.index(k) - g.index(i)) % len(g)

    def gaps(self, n: int) -> list[tuple[int, int]]:
        """Byte ranges of node n's pieces part that no piece covers (alignment padding).

        They are zero-filled (the parity lane of xor is zeroed as a whole).
        """
        out = []
        pos = 0
        spans = [(p.offset, p.nbytes) for p in self.by_node[n]]
        if self.redundancy == "replica":
            spans += [(off, p.nbytes) for p, off in self.backup_offset.items()
                      if self.holder_of(p.node) == n]  # fmt: skip
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
    def from_json(cls, text: str) -> Layout:
        d: dict[str, Any] = json.loads(text)
        if d.get("format") not in _FORMATS:
            raise ValueError(f"not a snapshot layout this version reads ({d.get('format')!r})")
        leaves = [LeafMeta(n, tuple(s), np_dtype(t), k) for n, s, t, k in d["leaves"]]
        pieces = [
            PieceRec(leaf, tuple((a, b) for a, b in box), node, 0, nb)
            for leaf, box, node, nb in d["pieces"]
        ]
        return cls(leaves, d["nodes"], d["groups"], d["redundancy"], pieces, _FORMATS[d["format"]])


def build_pieces(
    leaves: Sequence[LeafMeta], regions: Sequence[Sequence[tuple[Box, int]]], nodes: int
) -> list[PieceRec]:
    """The pieces of every node (their offsets are assigned by `Layout`).

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
            out.append(PieceRec(li, box, node, 0, box_size(box) * meta.dtype.itemsize))
    return out
