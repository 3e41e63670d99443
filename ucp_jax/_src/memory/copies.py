"""The copies a snapshot makes: device-side copies (accelerators), or views of CPU buffers.

On accelerators a snapshot dispatches one computation per device that copies (or slices) the
regions its node keeps, then the device-to-host DMA; the background thread copies the host
buffers into shared memory. On CPU devices the buffers are host memory already: the regions are
numpy views of them (no copy).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from ..mapping.boxes import relative_slices, to_slices
from ..placement import host_staging
from .redundancy import Fetch


@dataclasses.dataclass
class DeviceCopies:
    """The copies one device makes for a snapshot, as one computation (not one per region).

    Attributes:
        device: the device.
        sources: (kind, leaf, shift) of each source shard it reads.
        plan: per output, (source index, start, limit) of the slice, or (source index, None, None)
            for a copy of the whole shard.
        fetches: the fetch each output belongs to.
        direct: fetches served by a shard as it is (no copy needed).
    """

    device: Any
    sources: list[tuple[str, int, int]]
    plan: tuple[tuple[int, Any, Any], ...]
    fetches: list[int]
    direct: list[tuple[int, int]]  # (fetch, source index)


@functools.partial(jax.jit, static_argnums=1)
def _copies(srcs: tuple[jax.Array, ...], plan: tuple[tuple[int, Any, Any], ...]) -> tuple[Any, ...]:
    """All of one device's snapshot copies in one computation (whole shards, or slices of them).

    One computation per device and snapshot: dispatching one per region would stall the caller
    once a device has more computations in flight than the runtime queues.
    """
    out = []
    for i, start, limit in plan:
        x = srcs[i]
        if start is None:  # a copy of the whole shard (a full dynamic_slice: XLA:CPU copies it
            start, limit = (0,) * x.ndim, x.shape  # several times faster than a copy op)
        sizes = tuple(b - a for a, b in zip(start, limit))
        out.append(jax.lax.dynamic_slice(x, start, sizes))
    return tuple(out)


def group_by_device(fetches: list[Fetch], donation_safe: bool) -> list[DeviceCopies]:
    groups: dict[Any, DeviceCopies] = {}
    plans: dict[Any, list[tuple[int, Any, Any]]] = {}
    for fi, f in enumerate(fetches):
        if f.kind == "host":
            continue
        g = groups.setdefault(f.device, DeviceCopies(f.device, [], (), [], []))
        src = (f.kind, f.leaf, f.shift)
        if src not in g.sources:
            g.sources.append(src)
        si = g.sources.index(src)
        whole = f.box == f.shard_box
        if whole and (f.kind == "roll" or not donation_safe):
            g.direct.append((fi, si))  # a rolled shard is already a private copy
            continue
        if whole:
            plans.setdefault(f.device, []).append((si, None, None))
        else:
            rel = relative_slices(f.box, f.shard_box)
            start, limit = tuple(s.start for s in rel), tuple(s.stop for s in rel)
            plans.setdefault(f.device, []).append((si, start, limit))
        g.fetches.append(fi)
    for dev, g in groups.items():
        g.plan = tuple(plans.get(dev, ()))
    return sorted(groups.values(), key=lambda g: g.device.id)


def dispatch(
    fetches: list[Fetch], groups: list[DeviceCopies], leaves: list[Any], rolled: dict[Any, Any]
) -> list[Any]:
    """Start every copy of a snapshot: one computation per device, host values copied.

    Where a device has pinned host memory and staging is on (`placement.host_staging`), each
    copy then goes to it (one DMA; the background thread reads it as host memory); otherwise the
    caller starts a copy to pageable host memory (`copy_to_host_async`).
    """
    datas: list[Any] = [None] * len(fetches)
    shard = _shard_lookup(leaves, rolled)
    for fi, f in enumerate(fetches):
        if f.kind == "host":
            datas[fi] = np.array(np.asarray(leaves[f.leaf])[to_slices(f.box)])
    for g in groups:
        srcs = tuple(shard(*src, g.device) for src in g.sources)
        pinned = host_staging(g.device)
        outs = [(fi, srcs[si]) for fi, si in g.direct]
        if g.plan:
            outs += list(zip(g.fetches, _copies(srcs, g.plan)))
        if pinned is not None and outs:
            staged = jax.device_put([x for _, x in outs], pinned)
            outs = [(fi, x) for (fi, _), x in zip(outs, staged)]
        for fi, x in outs:
            datas[fi] = x
    return datas


def host_views(fetches: list[Fetch], leaves: list[Any], rolled: dict[Any, Any]) -> list[Any]:
    """Each fetch's region as a numpy view of its CPU shard (no copy; host values copied)."""
    datas: list[Any] = [None] * len(fetches)
    shard = _shard_lookup(leaves, rolled)
    for fi, f in enumerate(fetches):
        if f.kind == "host":
            datas[fi] = np.array(np.asarray(leaves[f.leaf])[to_slices(f.box)])
            continue
        view = np.asarray(shard(f.kind, f.leaf, f.shift, f.device))
        if f.box != f.shard_box:
            view = view[relative_slices(f.box, f.shard_box)]
        datas[fi] = view
    return datas


def _shard_lookup(leaves: list[Any], rolled: dict[Any, Any]) -> Any:
    """(kind, leaf, shift, device) -> that device's shard of a leaf (or of a rolled leaf)."""
    shards: dict[tuple[str, int, int], dict[Any, Any]] = {}

    def shard(kind: str, leaf: int, shift: int, device: Any) -> Any:
        key = (kind, leaf, shift)
        if key not in shards:
            src = rolled[(leaf, shift)] if kind == "roll" else leaves[leaf]
            shards[key] = {s.device: s.data for s in src.addressable_shards}
        return shards[key][device]

    return shard
