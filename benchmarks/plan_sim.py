"""One process's save planning (`SaveJob`'s per-leaf plan) on simulated meshes of up to 16k devices.

The leaves are `jax.ShapeDtypeStruct`s sharded over an `AbstractMesh` (no devices, no data), bound
by `bind_state` with the rules a model has; the planner gets this process's devices of the mesh
(ids only: `grid.MeshInfo`) through `SavePlan`'s `mesh_info` hook and plans every leaf as a save
does: this process's write tasks, every atom's writer boundaries (patterned leaves included), the
chunk grids (`store.choose_chunks`), the merged writes. Timed for one process in the middle of the
job, after a warm-up (imports, first calls) on a 64-device mesh.

Against code from before issue 24 (no `ucp_jax._src.save_plan`; run with `PYTHONPATH` at such a
checkout), `SaveJob._plan_leaf` itself is timed on a bare job, with the only thing a simulated mesh
cannot give replaced: `write_regions`, every region of the job with its writer, computed from the
grid for all devices (what jax's `devices_indices_map` gives it). A digest of the plan (every slot's
chunk grid and every task) shows both plan the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import zlib
from typing import Any

WIDTH = 16384  # 16384 x 16384 bf16: 512 MiB leaves


@dataclasses.dataclass(frozen=True)
class SimDevice:
    """A device of a simulated mesh: what the planner reads of one."""

    id: int
    process_index: int
    platform: str = "sim"


def tree(mesh: Any, leaves: int, patterned: bool) -> tuple[dict[str, Any], list[Any]]:
    """The simulated parameter tree and its rules.

    Patterned: leaves cycle through fused QKV (columns split per TP rank: the mesh's 'model'
    axis), a vocabulary-padded embedding, 32 layers stacked on axis 0, and a plain matrix; plain:
    every leaf a plain matrix over one of 5 specs.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ucp_jax._src.mapping.patterns import Fused, Stacked, VocabPadded

    specs = [P("data", "model"), P("model", "data"), P(None, "model"), P("model", None), P()]
    side = WIDTH
    out: dict[str, Any] = {}
    rules: list[Any] = []
    for i in range(leaves):
        name, kind = f"w{i:03d}", i % 4 if patterned else 3
        shape: tuple[int, ...] = (side, side)
        spec = specs[i % len(specs)]
        if kind == 0:  # fused QKV (GQA sizes), columns over 'model'
            spec = P(None, "model")
            rules.append(
                (name, Fused((side // 2, side // 4, side // 4), axis=1, shard_axis="model"))
            )
        elif kind == 1:  # embedding padded to a multiple of the vocabulary split
            spec = P("model", None)
            rules.append((name, VocabPadded(side - 123, axis=0)))
        elif kind == 2:  # 32 layers stacked on axis 0
            shape, spec = (32, side // 8, side // 8), P(None, "data", "model")
            rules.append((name, Stacked(f"blocks.{{i}}.{name}", axes=0)))
        sh = NamedSharding(mesh, spec)
        out[name] = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh)
    return out, rules


def mesh_for(n: int, patterned: bool) -> tuple[int, int]:
    """(data, model) sizes: tensor parallel 8 for the patterned tree, near-square for plain."""
    if patterned:
        return n // 8, 8
    a = 1
    while a * a * 4 <= n:
        a *= 2
    return a, n // a


def digest(slots: dict[Any, Any], tasks: list[Any]) -> str:
    """A short hash of a plan: every slot's chunk grid and every task's region and writer."""
    h = hashlib.sha256()
    for key in sorted(slots):
        shape, info = slots[key]
        h.update(repr((key, shape, info.chunks, info.inner_chunks)).encode())
    for t in sorted(tasks, key=lambda t: (t.binding.name, t.box)):
        h.update(repr((t.binding.name, t.box, t.device.id, t.shard_box)).encode())
    return h.hexdigest()[:12]


def plan_once(n: int, leaves: int, per_process: int, patterned: bool) -> dict[str, Any]:
    """Plan the simulated tree for the last-but-half process of an n-device job; its figures."""
    import numpy as np
    from jax.sharding import AbstractMesh

    from ucp_jax._src.mapping import binding, grid
    from ucp_jax._src.mapping.rules import CompiledRules

    a, b = mesh_for(n, patterned)
    mesh = AbstractMesh((a, b), ("data", "model"))
    params, rules = tree(mesh, leaves, patterned)
    bindings, _ = binding.bind_state(params, None, CompiledRules(rules))
    me = n // per_process // 2
    devs = [SimDevice(i, i // per_process) for i in range(n)]
    ids = np.arange(n, dtype=np.int64).reshape(a, b)
    local = tuple((i, devs[i]) for i in range(me * per_process, (me + 1) * per_process))
    info = grid.MeshInfo((("data", a), ("model", b)), ids, local)
    everyone = grid.MeshInfo(info.axes, ids, tuple(enumerate(devs)))  # for the code before
    grid.grid_plan.cache_clear()
    t0 = time.perf_counter()
    try:
        from ucp_jax._src.save_plan import SavePlan
    except ImportError:  # the code before issue 24
        slots, tasks = _plan_before(bindings, info, everyone, me)
        planner = "SaveJob._plan_leaf (per-device boundaries)"
    else:
        plan = SavePlan(1 << 30, mesh_info=lambda m: info)
        for lb in bindings:
            plan.add(lb)
        slots, tasks = plan.slots, plan.tasks
        planner = "SavePlan (per-axis boundaries)"
    secs = time.perf_counter() - t0
    return {"devices": n, "processes": n // per_process, "leaves": leaves, "patterned": patterned,
            "mesh": [a, b], "plan_s": secs, "tasks": len(tasks), "slots": len(slots),
            "planner": planner, "digest": digest(slots, tasks)}  # fmt: skip


def _plan_before(bindings: list[Any], info: Any, everyone: Any, me: int) -> tuple[Any, Any]:
    """`SaveJob._plan_leaf` of the code before issue 24 on a bare job, over a simulated mesh."""
    import jax

    from ucp_jax._src import save as save_mod
    from ucp_jax._src.mapping import grid
    from ucp_jax._src.mapping.binding import WriteTask

    def plan_on_grid(b: Any) -> Any:  # its body, with the simulated mesh's info
        if b.chain or not isinstance(b.sharding, jax.sharding.NamedSharding):
            return None
        plan = grid.grid_plan(info, tuple(b.sharding.spec), tuple(b.shape))
        salt = zlib.crc32(b.name.encode())
        regions = grid.local_regions(plan, info.local, salt, b.dtype.itemsize)
        tasks = [WriteTask(b, box, dev, shard_box) for box, dev, shard_box in regions]
        cuts = grid.cuts(plan, b.dtype.itemsize, b.shape)
        return tasks, {atom: [set(c) for c in cuts] for atom in b.atoms()}

    def write_regions(b: Any) -> Any:  # every region of the job and its writer
        plan = grid.grid_plan(everyone, tuple(b.sharding.spec), tuple(b.shape))
        return grid.local_regions(plan, everyone.local, zlib.crc32(b.name.encode()),
                                  b.dtype.itemsize)  # fmt: skip

    def my_write_tasks(b: Any, regions: Any) -> Any:
        return [WriteTask(b, box, d, sb) for box, d, sb in regions if d.process_index == me]

    job = object.__new__(save_mod.SaveJob)
    job.atoms, job.tasks, job.merged, job.slots, job.budget = {}, [], {}, {}, 1 << 30
    saved = {k: getattr(save_mod, k) for k in ("plan_on_grid", "write_regions", "my_write_tasks")}
    save_mod.plan_on_grid, save_mod.write_regions = plan_on_grid, write_regions
    save_mod.my_write_tasks = my_write_tasks
    try:
        for b in bindings:
            job._plan_leaf(b)
    finally:
        for k, v in saved.items():
            setattr(save_mod, k, v)
    return job.slots, job.tasks


def plan_sim(devices: list[int], leaves: int, per_process: int, *, patterned: bool = False
             ) -> list[dict[str, Any]]:  # fmt: skip
    """`plan_once` at each device count, after a warm-up (the same tree on 64 devices)."""
    plan_once(max(64, 8 * per_process), leaves, per_process, patterned)
    return [plan_once(n, leaves, per_process, patterned) for n in devices]
