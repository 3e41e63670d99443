"""Write plans of NamedSharding leaves from the mesh and the spec alone: O(local devices) per leaf.

`binding.write_regions` visits every device of a leaf's sharding (O(global devices) per leaf, then
pieces for every region). For a `NamedSharding` whose axes split evenly, the distinct shards form
a regular grid: shard index along array axis j is the mixed-radix number of the device's mesh
coordinates on the mesh axes that `spec[j]` names. The per-(mesh, spec, shape) part (every
device's grid cell and its rank among the cell's replicas, ordered by device id) is computed once,
vectorised, and cached; a leaf then costs O(its local devices). The result is the same as
`write_regions` restricted to this process (same regions, same writers: tested against it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .boxes import Box, interval_ends

SPLIT_MIN_BYTES = 4 << 20  # as binding.SPLIT_MIN_BYTES


@dataclasses.dataclass(frozen=True)
class GridPlan:
    """Where every device's shard sits in the grid of one (mesh, spec, shape).

    Attributes:
        counts: shards per array axis.
        size: shard extent per array axis.
        cell: per device (in mesh order), its grid cell as a flat row-major index.
        rank: per device, its position among the devices of its cell ordered by id.
        replicas: devices per cell.
    """

    counts: tuple[int, ...]
    size: tuple[int, ...]
    cell: np.ndarray
    rank: np.ndarray
    replicas: int

    def box(self, cell: int) -> Box:
        idx = np.unravel_index(cell, self.counts) if self.counts else ()
        return tuple((int(i) * s, (int(i) + 1) * s) for i, s in zip(idx, self.size))


def spec_axes(spec: Any, ndim: int) -> tuple[tuple[str, ...], ...] | None:
    """A PartitionSpec as per-axis tuples of mesh axis names, or None (unconstrained axes).

    >>> spec_axes(("a", None, ("b", "c")), 4)
    (('a',), (), ('b', 'c'), ())
    """
    out: list[tuple[str, ...]] = []
    entries = list(spec) + [None] * (ndim - len(spec))
    if len(entries) != ndim:
        return None
    for e in entries:
        if e is None:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        elif isinstance(e, tuple) and all(isinstance(a, str) for a in e):
            out.append(tuple(e))
        else:  # UNCONSTRAINED and the like
            return None
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=False)
class MeshInfo:
    """A mesh as the planner needs it: axis sizes, device ids, and this process's devices.

    Attributes:
        axes: (axis name, size) in mesh order.
        ids: device ids, shaped like the mesh (int64).
        local: (flat mesh position, device) of the devices of this process.
    """

    axes: tuple[tuple[str, int], ...]
    ids: np.ndarray
    local: tuple[tuple[int, Any], ...]


@functools.lru_cache(maxsize=64)
def mesh_info(mesh: Any, process: int) -> MeshInfo:
    """The MeshInfo of a concrete `jax.sharding.Mesh` for `process` (cached per mesh)."""
    devs = np.asarray(mesh.devices)
    flat = devs.reshape(-1)
    ids = np.fromiter((d.id for d in flat), dtype=np.int64, count=flat.size).reshape(devs.shape)
    local = tuple((i, d) for i, d in enumerate(flat) if d.process_index == process)
    return MeshInfo(tuple((str(k), int(v)) for k, v in mesh.shape.items()), ids, local)


@functools.lru_cache(maxsize=1024)
def grid_plan(info: MeshInfo, spec: tuple[Any, ...], shape: tuple[int, ...]) -> GridPlan | None:
    """The grid of a named sharding (mesh `info`, `spec`, array `shape`), or None where it is
    not a plain even grid (uneven shards, unconstrained axes): the caller falls back then."""
    mesh_shape, ids, ids_shape = info.axes, info.ids, info.ids.shape
    axes = spec_axes(spec, len(shape))
    names = [n for n, _ in mesh_shape]
    sizes = dict(mesh_shape)
    if axes is None or any(a not in sizes for ax in axes for a in ax):
        return None
    used = [a for ax in axes for a in ax]
    if len(used) != len(set(used)):
        return None
    coords = np.indices(ids_shape).reshape(len(ids_shape), -1)  # mesh coordinates per device
    counts, size, index = [], [], []
    for dim, ax in zip(shape, axes):
        n = math.prod(sizes[a] for a in ax)
        if n == 0 or dim % n or (dim == 0 and n > 1):  # uneven, or empty shards (one box)
            return None
        i = np.zeros(coords.shape[1], dtype=np.int64)
        for a in ax:
            i = i * sizes[a] + coords[names.index(a)]
        counts.append(n)
        size.append(dim // n)
        index.append(i)
    flat_ids = ids.reshape(-1)
    cell = (np.ravel_multi_index(index, counts) if counts else
            np.zeros(flat_ids.size, dtype=np.int64))  # fmt: skip
    order = np.lexsort((flat_ids, cell))
    replicas = flat_ids.size // max(math.prod(counts), 1)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) % replicas
    return GridPlan(tuple(counts), tuple(size), cell, rank, replicas)


def split_axis(box: Box, parts: int) -> tuple[int, int] | None:
    """(axis, slab extent) of `binding._split_box(box, parts)`: its longest evenly divisible axis."""
    extents = [b - a for a, b in box]
    axes = [j for j, e in enumerate(extents) if e % parts == 0 and e >= parts]
    if not axes:
        return None
    ax = max(axes, key=lambda j: extents[j])
    return ax, extents[ax] // parts


def slab(box: Box, ax: int, step: int, i: int) -> Box:
    """Slab `i` of `box` cut along axis `ax` every `step` elements."""
    a0 = box[ax][0] + i * step
    return (*box[:ax], (a0, a0 + step), *box[ax + 1 :])


def local_regions(plan: GridPlan, local: Sequence[tuple[int, Any]], salt: int, itemsize: int
                  ) -> list[tuple[Box, Any, Box]]:  # fmt: skip
    """The regions the devices `local` ((flat mesh position, device)) write, as write_regions
    gives them: (region, device, the region's whole shard box), in grid order."""
    out = []
    r = plan.replicas
    for pos, dev in local:
        k, q = int(plan.cell[pos]), int(plan.rank[pos])
        box = plan.box(k)
        split = None
        if r > 1 and math.prod(plan.size) * itemsize >= SPLIT_MIN_BYTES:
            split = split_axis(box, r)
        if split is None:
            if (salt + k) % r == q:
                out.append((box, dev, box))
        else:  # slab i of its shard is written by the replica of rank (salt + k + i) % r
            out.append((slab(box, *split, (q - salt - k) % r), dev, box))
    out.sort(key=lambda t: (t[2], t[0]))
    return out


def axis_intervals(
    plan: GridPlan, itemsize: int, shape: Sequence[int]
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per array axis, the distinct intervals of the job's writer regions along it.

    Every combination of one interval per axis is one writer region (of some process): the
    grid's cells, or, where replicated shards are split among their replicas, their slabs (the
    same axis and slab size in every cell). Their ends are `cuts`. Cached: leaves of one grid
    share the same tuples (and so `interval_ends`' sets).
    """
    split = None
    if plan.replicas > 1 and math.prod(plan.size) * itemsize >= SPLIT_MIN_BYTES:
        split = split_axis(plan.box(0), plan.replicas)
    return _intervals(plan.counts, plan.size, split, tuple(int(d) for d in shape))


@functools.lru_cache(maxsize=256)
def _intervals(
    counts: tuple[int, ...],
    size: tuple[int, ...],
    split: tuple[int, int] | None,
    shape: tuple[int, ...],
) -> tuple[tuple[tuple[int, int], ...], ...]:
    out = [tuple((k * s, (k + 1) * s) for k in range(n)) if s else ((0, 0),)
           for n, s in zip(counts, size)]  # fmt: skip
    if split is not None:
        ax, step = split
        out[ax] = tuple((k * step, (k + 1) * step) for k in range(shape[ax] // step))
    return tuple(out)


def cuts(plan: GridPlan, itemsize: int, shape: Sequence[int]) -> list[set[int]]:
    """Per axis, the offsets where one writer's region ends and the next begins (shared sets:
    read them, do not change them)."""
    return [interval_ends(a) for a in axis_intervals(plan, itemsize, shape)]
