"""Where a leaf's snapshot pieces are: an explicit list, or a sharding grid expanded on demand.

A piece here is a `Raw` tuple `(rank, box, node, nbytes)`: `rank` orders the leaf's pieces as
`binding.write_regions` lists them (shard by shard in box order, a shard's slabs in order), which
is the order a node's blob keeps them in (`layout`).

- `ExplicitPlacement`: every piece listed (any sharding; host values; layouts of format 2).
- `GridPlacement`: a `NamedSharding` whose shards form an even grid (`mapping.grid`). The pieces
  of one node, or those covering a box, are computed from the mesh (device ids and their
  processes, once per mesh: `MeshTable`), the spec, the shape and the leaf's salt, without
  listing the leaf's other pieces. The same pieces as `write_regions` gives (tested).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..mapping import grid
from ..mapping.boxes import Box
from ..mapping.grid import spec_axes

Raw = tuple[int, Box, int, int]  # (rank in the leaf, box, node, nbytes)
Spec = tuple[tuple[str, ...], ...]  # per array axis, the mesh axes it is split over


def meets(a: Box, b: Box) -> bool:
    """Whether boxes `a` and `b` share an element (scalars: always)."""
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


class ExplicitPlacement:
    """A leaf's pieces, listed.

    Args:
        pieces: (rank, box, node, nbytes) of every piece, in rank order.
    """

    kind = "pieces"

    def __init__(self, pieces: Sequence[Raw]) -> None:
        self.pieces = list(pieces)
        self._by_node: dict[int, list[Raw]] = {}
        for p in self.pieces:
            self._by_node.setdefault(p[2], []).append(p)

    def node_pieces(self, node: int) -> list[Raw]:
        """The pieces node `node` keeps, in rank order."""
        return self._by_node.get(node, [])

    def leaf_pieces(self) -> list[Raw]:
        """All the leaf's pieces, in rank order."""
        return self.pieces

    def covering(self, box: Box) -> list[Raw]:
        """The pieces that share an element with `box`, in rank order."""
        return [p for p in self.pieces if meets(p[1], box)]


@dataclasses.dataclass(frozen=True, eq=False)
class MeshTable:
    """A mesh as the snapshot layout needs it: axis sizes, device ids and each device's process.

    Attributes:
        axes: (axis name, size) in mesh order.
        ids: device ids, shaped like the mesh (int64).
        procs: per flat mesh position, the process (node) of its device (int64).
    """

    axes: tuple[tuple[str, int], ...]
    ids: np.ndarray
    procs: np.ndarray

    @functools.cached_property
    def info(self) -> grid.MeshInfo:
        """The `grid.MeshInfo` of this mesh (no local devices: the layout covers every node)."""
        return grid.MeshInfo(self.axes, self.ids, ())

    @functools.cached_property
    def by_proc(self) -> dict[int, np.ndarray]:
        """Per process, the flat mesh positions of its devices."""
        order = np.argsort(self.procs, kind="stable")
        cuts = np.flatnonzero(np.diff(self.procs[order])) + 1
        return {int(self.procs[c[0]]): c for c in np.split(order, cuts) if c.size}

    def to_json(self) -> dict[str, Any]:
        return {"axes": [list(a) for a in self.axes], "ids": self.ids.reshape(-1).tolist(),
                "procs": self.procs.tolist()}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MeshTable:
        axes = tuple((str(n), int(s)) for n, s in d["axes"])
        shape = tuple(s for _, s in axes)
        ids = np.asarray(d["ids"], dtype=np.int64).reshape(shape)
        procs = np.asarray(d["procs"], dtype=np.int64)
        if procs.size != ids.size:
            raise ValueError(
                f"snapshot layout: a mesh of {ids.size} devices lists {procs.size} processes; "
                "the layout is damaged"
            )
        return cls(axes, ids, procs)


@functools.lru_cache(maxsize=16)
def mesh_table(mesh: Any) -> MeshTable:
    """The MeshTable of a concrete `jax.sharding.Mesh` (cached per mesh)."""
    flat = np.asarray(mesh.devices).reshape(-1)
    ids = np.fromiter((d.id for d in flat), dtype=np.int64, count=flat.size)
    procs = np.fromiter((d.process_index for d in flat), dtype=np.int64, count=flat.size)
    axes = tuple((str(k), int(v)) for k, v in mesh.shape.items())
    return MeshTable(axes, ids.reshape(np.asarray(mesh.devices).shape), procs)


@functools.lru_cache(maxsize=256)
def _writers(table: MeshTable, spec: Spec, shape: tuple[int, ...]) -> np.ndarray:
    """Per grid cell, the flat mesh positions of its devices ordered by id: (cells, replicas)."""
    plan = grid.grid_plan(table.info, spec, shape)
    assert plan is not None  # checked by GridPlacement
    order = np.lexsort((table.ids.reshape(-1), plan.cell))
    return order.reshape(-1, plan.replicas)


class GridPlacement:
    """A leaf's pieces from its sharding grid: the pieces of a node or of a box, on demand.

    Args:
        table: the mesh.
        spec: the leaf's spec (`spec_axes`).
        shape: the leaf's shape.
        itemsize: bytes per element.
        salt: the leaf's writer salt (`binding.write_regions`: a CRC of its name).
        split_min: replicated shards at least this big are split among their replicas
            (default: `grid.SPLIT_MIN_BYTES`, as `write_regions`).

    Raises:
        ValueError: the spec does not form an even grid over the mesh (use ExplicitPlacement).
    """

    kind = "grid"

    def __init__(self, table: MeshTable, spec: Spec, shape: tuple[int, ...], itemsize: int,
                 salt: int, split_min: int | None = None) -> None:  # fmt: skip
        plan = grid.grid_plan(table.info, spec, tuple(shape))
        if plan is None:
            raise ValueError(
                f"snapshot layout: spec {spec} over mesh {table.axes} does not split shape "
                f"{shape} into an even grid; list its pieces instead (ExplicitPlacement)"
            )
        self.table, self.spec, self.shape, self.plan = table, spec, tuple(shape), plan
        self.salt = int(salt)
        self.split_min = grid.SPLIT_MIN_BYTES if split_min is None else int(split_min)
        self.cell_bytes = math.prod(plan.size) * int(itemsize)
        r = plan.replicas
        self.split = None
        if r > 1 and self.cell_bytes >= self.split_min:
            self.split = grid.split_axis(plan.box(0), r)
        self.parts = 1 if self.split is None else r  # pieces per cell

    @property
    def writers(self) -> np.ndarray:
        return _writers(self.table, self.spec, self.shape)

    def _piece(self, k: int, i: int, node: int) -> Raw:
        box = self.plan.box(k)
        if self.split is None:
            return (k, box, node, self.cell_bytes)
        return (k * self.parts + i, grid.slab(box, *self.split, i), node,
                self.cell_bytes // self.parts)  # fmt: skip

    def _writer(self, k: int, i: int) -> int:
        """The flat mesh position of the device writing piece `i` of cell `k`."""
        r = self.plan.replicas
        return int(self.writers[k, (self.salt + k + i) % r])

    def node_pieces(self, node: int) -> list[Raw]:
        """The pieces node `node` keeps, in rank order (O(its devices))."""
        pos = self.table.by_proc.get(node)
        if pos is None:
            return []
        r = self.plan.replicas
        out = []
        for k, q in zip(self.plan.cell[pos].tolist(), self.plan.rank[pos].tolist()):
            if self.split is None:
                if (self.salt + k) % r == q:
                    out.append(self._piece(k, 0, node))
            else:  # slab i of its cell is written by the replica of rank (salt + k + i) % r
                out.append(self._piece(k, (q - self.salt - k) % r, node))
        out.sort(key=lambda p: p[0])
        return out

    def _cells(self, box: Box) -> list[tuple[int, int]]:
        """(cell, piece in cell) of every piece whose box may share an element with `box`."""
        counts, size = self.plan.counts, self.plan.size
        ranges = []
        for j, (a, b) in enumerate(box):
            unit = size[j] if self.split is None or self.split[0] != j else self.split[1]
            if unit == 0:
                ranges.append(range(1))
                continue
            n = counts[j] * (size[j] // unit)
            ranges.append(range(max(a // unit, 0), min(-(-b // unit), n)))
        out = []
        for idx in itertools.product(*ranges):
            if self.split is None:
                out.append((int(np.ravel_multi_index(idx, counts)) if counts else 0, 0))
                continue
            ax, step = self.split
            per = size[ax] // step
            cidx = tuple(v // per if j == ax else v for j, v in enumerate(idx))
            out.append((int(np.ravel_multi_index(cidx, counts)), idx[ax] % per))
        return out

    def covering(self, box: Box) -> list[Raw]:
        """The pieces that share an element with `box`, in rank order (O(those pieces))."""
        procs = self.table.procs
        out = []
        for k, i in self._cells(box):
            p = self._piece(k, i, int(procs[self._writer(k, i)]))
            if meets(p[1], box):
                out.append(p)
        out.sort(key=lambda p: p[0])
        return out

    def leaf_pieces(self) -> list[Raw]:
        """All the leaf's pieces, in rank order (O(cells x parts))."""
        procs = self.table.procs
        cells = math.prod(self.plan.counts)
        return [self._piece(k, i, int(procs[self._writer(k, i)]))
                for k in range(cells) for i in range(self.parts)]  # fmt: skip

    def locate(self, box: Box) -> tuple[int, int]:
        """(cell, piece in cell) of the piece with box `box`."""
        idx = [a // s if s else 0 for (a, _), s in zip(box, self.plan.size)]
        k = int(np.ravel_multi_index(idx, self.plan.counts)) if idx else 0
        if self.split is None:
            return k, 0
        ax, step = self.split
        return k, (box[ax][0] - self.plan.box(k)[ax][0]) // step

    def writer(self, box: Box) -> tuple[int, Box]:
        """(flat mesh position of its writing device, its shard box) of the piece `box`."""
        k, i = self.locate(box)
        return self._writer(k, i), self.plan.box(k)

    def holders(self, box: Box, node: int) -> tuple[list[int], Box]:
        """The flat mesh positions of node `node`'s devices whose shard holds the piece `box`
        (ordered by device id), and that shard's box."""
        k, _ = self.locate(box)
        pos = self.writers[k]
        return [int(p) for p in pos[self.table.procs[pos] == node]], self.plan.box(k)

    def to_json(self, mesh_index: int) -> dict[str, Any]:
        return {"mesh": mesh_index, "spec": [list(a) for a in self.spec], "salt": self.salt}


def grid_placement(mesh: Any, spec: Any, shape: tuple[int, ...], itemsize: int, name: str
                   ) -> GridPlacement | None:  # fmt: skip
    """The GridPlacement of a leaf named `name` sharded by `NamedSharding(mesh, spec)`, with
    `binding.write_regions`' writer salt; None where the grid does not apply (uneven shards,
    unconstrained axes)."""
    axes = spec_axes(spec, len(shape))
    if axes is None:
        return None
    table = mesh_table(mesh)
    if grid.grid_plan(table.info, axes, tuple(shape)) is None:
        return None
    return GridPlacement(table, axes, tuple(shape), itemsize, zlib.crc32(name.encode()))


def of_binding(b: Any) -> GridPlacement | None:
    """The GridPlacement of a leaf bound by `binding.bind_state`, or None where no grid applies
    (a host value, another sharding, an abstract mesh, uneven shards)."""
    if not isinstance(b.value, jax.Array):
        return None
    sh = b.value.sharding
    if not isinstance(sh, jax.sharding.NamedSharding) or not isinstance(sh.mesh, jax.sharding.Mesh):
        return None
    return grid_placement(sh.mesh, sh.spec, tuple(b.shape), b.dtype.itemsize, b.name)


def explicit(leaf_pieces: Sequence[tuple[Box, int, int]]) -> ExplicitPlacement:
    """An ExplicitPlacement of (box, node, nbytes) pieces, ranked in the order given."""
    return ExplicitPlacement([(i, box, node, nb) for i, (box, node, nb) in enumerate(leaf_pieces)])
