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

The layout is described per leaf (`placement`): a sharding grid (mesh, spec, salt) for the
common `NamedSharding` leaves, else the list of the leaf's pieces. A node's offsets depend only
on its own pieces and the copies it keeps, so they are computed when a node is first asked for,
and the pieces covering a box from the grid arithmetic: one process's cost follows the nodes it
reads, and the layout's JSON (format 3) holds each mesh once and O(1) per grid leaf.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any, overload

import numpy as np

from ..mapping import grid
from ..mapping.boxes import Box, box_size
from ..util.dtypes import dtype_name, np_dtype
from .placement import ExplicitPlacement, GridPlacement, MeshTable, Raw, explicit
from .schemes import RedundancyScheme, align, scheme_for

ALIGN = 64
PAGE_ALIGN = 4096  # fixed (not this machine's page size): every process computes the same layout
PAGE_MIN = 64 << 10  # pieces this big start on a page
LAYOUT_FORMAT = "ucp-mem-layout/3"
_FORMATS = {"ucp-mem-layout/1": ALIGN, "ucp-mem-layout/2": PAGE_ALIGN, LAYOUT_FORMAT: PAGE_ALIGN}
Placement = ExplicitPlacement | GridPlacement


def _continues(prev: tuple[int, Box] | None, leaf: int, box: Box) -> bool:
    """Whether `box` of `leaf` is the slab of a shard that comes right after slab `prev`."""
    return (
        prev is not None
        and prev[0] == leaf
        and len(box) > 0
        and prev[1][0][1] == box[0][0]
        and prev[1][1:] == box[1:]
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


class _PerNode(Sequence[Any]):
    """A read-only sequence with one item per node (or leaf), each computed when first read."""

    def __init__(self, n: int, get: Callable[[int], Any]) -> None:
        self._n, self._get = n, get

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self._get(j) for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(f"index {i} of a sequence of {self._n}")
        return self._get(i % self._n)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


@dataclasses.dataclass
class _Placed:
    """One node's blob plan: its own pieces and the inline copies it keeps, with offsets."""

    own: list[BlobPiece]
    offset: dict[tuple[int, Box], int]  # (leaf, box) of an own piece -> its offset
    copies: list[tuple[int, Box, int, int, int]]  # (leaf, box, owner, nbytes, offset)
    copy_at: dict[tuple[int, Box, int], int]  # (leaf, box, owner) -> offset of its copy here
    primary: int


class SnapshotLayout:
    """Where every piece of a snapshot lives, for the whole job (each node's part on demand).

    Args:
        leaves: the leaves, params first then opt_state, in jax's leaf order.
        nodes: number of nodes (processes) of the job.
        groups: the redundancy groups (lists of nodes).
        redundancy: the scheme's name, or None.
        pieces: every piece (offsets ignored), leaf by leaf in `write_regions` order; or None
            with `placements`.
        page_align: where big pieces start (4096; 64 in format 1).
        placements: per leaf, where its pieces are (`placement`); instead of `pieces`.
        fmt: the JSON format written (default: 3, or 1 for a 64-byte page alignment).

    Attributes:
        leaves, nodes, groups, group_of, redundancy (None also when no group has two nodes),
        scheme (the RedundancyScheme of that name, or None), placements.
        by_node: per node, its pieces with their offsets (computed when first read).
        by_leaf: per leaf, all its pieces (every node's: O(its pieces); prefer `covering`).
        primary: per node, the size of its pieces part (aligned; its own pieces and the copies
            it keeps).
        red_bytes: per node, the size of its redundancy area.
        digest: a hash of the layout's JSON (names it in plans/<digest>.json).

    Raises:
        ValueError: an unknown scheme, or neither/both of `pieces` and `placements`.
    """

    def __init__(
        self,
        leaves: Sequence[LeafMeta],
        nodes: int,
        groups: Sequence[Sequence[int]],
        redundancy: str | None,
        pieces: Sequence[BlobPiece] | None = None,
        page_align: int = PAGE_ALIGN,
        *,
        placements: Sequence[Placement] | None = None,
        fmt: str | None = None,
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
        self.page_align = int(page_align)
        if (pieces is None) == (placements is None):
            raise ValueError("SnapshotLayout takes either `pieces` or `placements`, not both")
        if placements is None:
            per_leaf: list[list[Raw]] = [[] for _ in self.leaves]
            for i, p in enumerate(pieces or []):  # ranked in the order given
                per_leaf[p.leaf].append((i, p.box, p.node, p.nbytes))
            placements = [ExplicitPlacement(ps) for ps in per_leaf]
        self.placements: list[Placement] = list(placements)
        if len(self.placements) != len(self.leaves):
            raise ValueError(
                f"SnapshotLayout: {len(self.placements)} placements for {len(self.leaves)} leaves"
            )
        self.format = fmt or (
            LAYOUT_FORMAT if self.page_align == PAGE_ALIGN else "ucp-mem-layout/1"
        )
        if self.format not in _FORMATS or _FORMATS[self.format] != self.page_align:
            raise ValueError(f"snapshot layout format {self.format!r} with page {page_align}")
        self._placed: dict[int, _Placed] = {}
        self._red: dict[int, int] = {}
        self.by_node = _PerNode(self.nodes, lambda n: self._place(n).own)
        self.by_leaf = _PerNode(len(self.leaves), self._leaf_pieces)
        self.primary = _PerNode(self.nodes, lambda n: self._place(n).primary)
        self.red_bytes = _PerNode(self.nodes, self._red_bytes)
        self.digest = hashlib.sha1(self.to_json().encode()).hexdigest()[:16]

    # ------------------------------------------------------------------------------ geometry

    def _place(self, n: int) -> _Placed:
        """Node n's offsets: its own pieces (and the copies its scheme keeps inline, e.g.
        replica's of the previous node) in (leaf, rank) order, 64-byte aligned, big ones page
        aligned (not the next slab of the same shard: that stays right after it)."""
        got = self._placed.get(n)
        if got is not None:
            return got
        if not 0 <= n < self.nodes:
            raise IndexError(f"node {n} of a layout of {self.nodes} nodes")
        kept = self.scheme.inline_copies(self, n) if self.scheme is not None else []
        slots = [(li, *r) for li, pl in enumerate(self.placements) for r in pl.node_pieces(n)]
        if kept:
            for m in kept:
                slots += [(li, *r) for li, pl in enumerate(self.placements)
                          for r in pl.node_pieces(m)]  # fmt: skip
            slots.sort(key=lambda s: (s[0], s[1]))
        placed = _Placed([], {}, [], {}, 0)
        end, prev = 0, None
        for li, _, box, node, nb in slots:
            page = nb >= PAGE_MIN and not _continues(prev, li, box)
            off = align(end, self.page_align if page else ALIGN)
            end, prev = off + nb, (li, box)
            if node == n:
                placed.own.append(BlobPiece(li, box, n, off, nb))
                placed.offset[(li, box)] = off
            else:
                placed.copies.append((li, box, node, nb, off))
                placed.copy_at[(li, box, node)] = off
        placed.primary = align(end)
        self._placed[n] = placed
        return placed

    def _red_bytes(self, n: int) -> int:
        if n not in self._red:
            self._red[n] = self.scheme.extra_bytes(self, n) if self.scheme is not None else 0
        return self._red[n]

    def _piece(self, li: int, raw: Raw) -> BlobPiece:
        _, box, node, nb = raw
        return BlobPiece(li, box, node, self._place(node).offset[(li, box)], nb)

    def _leaf_pieces(self, li: int) -> list[BlobPiece]:
        return [self._piece(li, r) for r in self.placements[li].leaf_pieces()]

    def covering(self, li: int, box: Box) -> list[BlobPiece]:
        """The pieces of leaf `li` that share an element with `box` (from the grid: O(them))."""
        return [self._piece(li, r) for r in self.placements[li].covering(box)]

    @property
    def pieces(self) -> list[BlobPiece]:
        """Every piece of the job, leaf by leaf (O(all of them): tests and small jobs)."""
        return [p for li in range(len(self.leaves)) for p in self.by_leaf[li]]

    @property
    def copies(self) -> dict[BlobPiece, list[tuple[int, int]]]:
        """piece -> (node, offset) of each inline copy, for the whole job (O(all of them))."""
        out: dict[BlobPiece, list[tuple[int, int]]] = {}
        for n in range(self.nodes):
            for p, off in self.copies_at(n):
                out.setdefault(p, []).append((n, off))
        return out

    def copies_at(self, holder: int) -> list[tuple[BlobPiece, int]]:
        """(piece, offset) of each copy of another node's piece that `holder` keeps inline."""
        return [(self._piece(li, (0, box, owner, nb)), off)
                for li, box, owner, nb, off in self._place(holder).copies]  # fmt: skip

    def size(self, n: int) -> int:
        """Bytes of node n's blob."""
        return self.primary[n] + self.red_bytes[n]

    def copy_offset(self, p: BlobPiece, holder: int) -> int:
        """The offset of the copy of piece `p` that node `holder` keeps inline."""
        return self._place(holder).copy_at[(p.leaf, p.box, p.node)]

    def holders(self, node: int) -> list[int]:
        """The nodes that keep inline copies of node `node`'s pieces, in node order."""
        if self.scheme is None:
            return []
        g = sorted(self.group_of.get(node, []))
        return [h for h in g if h != node and node in self.scheme.inline_copies(self, h)]

    def locations(self, p: BlobPiece) -> list[tuple[int, int]]:
        """(node, offset) of every copy of a piece: its own node's, then the inline copies'."""
        return [(p.node, p.offset), *((h, self.copy_offset(p, h)) for h in self.holders(p.node))]

    def shift(self, i: int, k: int) -> int:
        """Ring distance from node i to node k in their group (k = i + shift)."""
        g = self.group_of[i]
        return (g.index(k) - g.index(i)) % len(g)

    def gaps(self, n: int) -> list[tuple[int, int]]:
        """Byte ranges of node n's pieces part that no piece covers (alignment padding).

        They are zero-filled (the redundancy area after the pieces part is zeroed as a whole).
        """
        placed = self._place(n)
        out = []
        pos = 0
        spans = [(p.offset, p.nbytes) for p in placed.own]
        spans += [(off, nb) for _, _, _, nb, off in placed.copies]
        for off, nb in sorted(spans):
            if off > pos:
                out.append((pos, off - pos))
            pos = max(pos, off + nb)
        if placed.primary > pos:
            out.append((pos, placed.primary - pos))
        return out

    # ---------------------------------------------------------------------------- (de)serialise

    def to_json(self) -> str:
        """The layout as JSON: each mesh once, O(1) per grid leaf (formats 1 and 2: every
        piece, for layouts read in those formats)."""
        d: dict[str, Any] = {
            "format": self.format,
            "nodes": self.nodes,
            "groups": self.groups,
            "redundancy": self.redundancy,
            "leaves": [[m.name, list(m.shape), dtype_name(m.dtype), m.kind] for m in self.leaves],
        }
        if self.format != LAYOUT_FORMAT:
            # every piece; offsets follow from the order
            d["pieces"] = [[p.leaf, [list(ab) for ab in p.box], p.node, p.nbytes]
                           for p in self.pieces]  # fmt: skip
            return json.dumps(d, separators=(",", ":"))
        meshes: dict[int, int] = {}
        tables: list[dict[str, Any]] = []
        out: list[dict[str, Any]] = []
        split_min = grid.SPLIT_MIN_BYTES
        for pl in self.placements:
            if isinstance(pl, GridPlacement):
                i = meshes.setdefault(id(pl.table), len(meshes))
                if i == len(tables):
                    tables.append(pl.table.to_json())
                out.append(pl.to_json(i))
                split_min = pl.split_min
            else:
                out.append({"pieces": [[[list(ab) for ab in box], node, nb]
                                       for _, box, node, nb in pl.pieces]})  # fmt: skip
        d.update(meshes=tables, split_min=split_min, placements=out)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> SnapshotLayout:
        """A layout from its JSON (formats 1, 2 and 3).

        Raises:
            ValueError: not a layout format this version reads, or a damaged one.
        """
        d: dict[str, Any] = json.loads(text)
        fmt = d.get("format")
        if fmt not in _FORMATS:
            raise ValueError(f"not a snapshot layout this version reads ({fmt!r})")
        leaves = [LeafMeta(n, tuple(s), np_dtype(t), k) for n, s, t, k in d["leaves"]]
        args = (leaves, d["nodes"], d["groups"], d["redundancy"])
        if fmt != LAYOUT_FORMAT:
            pieces = [
                BlobPiece(leaf, tuple((a, b) for a, b in box), node, 0, nb)
                for leaf, box, node, nb in d["pieces"]
            ]
            return cls(*args, pieces, _FORMATS[fmt], fmt=fmt)
        tables = [MeshTable.from_json(m) for m in d["meshes"]]
        placements: list[Placement] = []
        for meta, pl in zip(leaves, d["placements"]):
            if "pieces" in pl:
                placements.append(explicit([(tuple((a, b) for a, b in box), node, nb)
                                            for box, node, nb in pl["pieces"]]))  # fmt: skip
            else:
                spec = tuple(tuple(str(a) for a in ax) for ax in pl["spec"])
                placements.append(GridPlacement(tables[pl["mesh"]], spec, meta.shape,
                                                meta.dtype.itemsize, pl["salt"], d["split_min"]))  # fmt: skip
        return cls(*args, placements=placements, fmt=fmt)


def build_pieces(
    leaves: Sequence[LeafMeta], regions: Sequence[Sequence[tuple[Box, int]]], nodes: int
) -> list[BlobPiece]:
    """The pieces of every node (their offsets are assigned by `SnapshotLayout`).

    Args:
        leaves: the leaves.
        regions: per leaf, (box, node) of each region (from `binding.write_regions`).
        nodes: number of nodes.

    Raises:
        ValueError: a region on a node outside [0, nodes).
    """
    out = []
    for li, (meta, regs) in enumerate(zip(leaves, regions)):
        for box, node in regs:
            if not 0 <= node < nodes:
                raise ValueError(f"region {box} of {meta.name!r} on node {node} of {nodes}")
            out.append(BlobPiece(li, box, node, 0, box_size(box) * meta.dtype.itemsize))
    return out
