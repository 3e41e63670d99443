"""The grid planner (mapping/grid.py) gives every process the same regions and writers as the
per-device plan (`binding.write_regions`), and its cost follows the local devices, not the mesh."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from helpers import mesh_of, need_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ucp_jax._src.mapping import binding, grid
from ucp_jax._src.mapping.rules import CompiledRules

SPECS = [P(), P("a"), P(None, "a"), P("a", "b"), P("b", "a"), P(("a", "b")), P(None, ("b", "a")),
         P("b")]  # fmt: skip


def _bindings(mesh_shape: tuple[int, ...], shape: tuple[int, ...]) -> list[binding.LeafBinding]:
    mesh = mesh_of(mesh_shape)
    tree = {}
    for i, spec in enumerate(SPECS):
        if any(
            a not in mesh.axis_names
            for e in spec
            if e
            for a in (e if isinstance(e, tuple) else (e,))
        ):
            continue
        if len(spec) > len(shape):
            continue
        tree[f"w{i}"] = jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))
    pb, _ = binding.bind_state(tree, None, CompiledRules(()))
    return pb


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split-replicas"])
@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4), (4, 2), (2, 2, 2)], ids=str)
def test_grid_plan_equals_per_device_plan(mesh_shape, split, monkeypatch):
    if split:  # replicated shards split among their replicas, as big arrays are
        monkeypatch.setattr(binding, "SPLIT_MIN_BYTES", 64)
        monkeypatch.setattr(grid, "SPLIT_MIN_BYTES", 64)
    for shape in [(16, 32), (64,), (8, 8, 4)]:
        for b in _bindings(mesh_shape, shape):
            fast = binding.plan_on_grid(b)
            assert fast is not None, b.name
            tasks, cuts = fast
            regions = binding.write_regions(b)
            slow = binding.my_write_tasks(b, regions)
            key = lambda t: (t.box, t.device.id, t.shard_box)  # noqa: E731
            assert sorted(map(key, tasks)) == sorted(map(key, slow)), (b.name, shape)
            assert cuts == binding.atom_boundaries(b, regions), (b.name, shape)


def test_host_values_and_uneven_shards_fall_back():
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    mesh = mesh_of((8,))
    x = jax.device_put(np.zeros((12, 3), np.float32), NamedSharding(mesh, P(None)))
    pb, _ = binding.bind_state({"x": x, "h": np.ones(3)}, None, CompiledRules(()))
    by_name = {b.name: b for b in pb}
    assert binding.plan_on_grid(by_name["h"]) is None  # a host value
    assert binding.plan_on_grid(by_name["x"]) is not None  # replicated: one grid cell
    info = grid.mesh_info(mesh, 0)
    assert grid.grid_plan(info, ("a",), (12, 3)) is None  # 12 rows over 8 devices: uneven


def test_planning_cost_follows_local_devices():
    """A 16k-device mesh (128 x 128, abstract: ids only), 8 devices per process: a 300-leaf plan
    for one process stays well under a second, and the grid is computed once per (spec, shape)."""
    ids = np.arange(128 * 128, dtype=np.int64).reshape(128, 128)
    local = tuple((i, i) for i in range(8 * 700, 8 * 701))  # process 700's devices
    info = grid.MeshInfo((("a", 128), ("b", 128)), ids, local)
    grid.grid_plan.cache_clear()
    t0 = time.perf_counter()
    n = 0
    for leaf in range(300):
        spec = [("a", "b"), ("b", "a"), (None, "b"), ("a", None), ()][leaf % 5]
        plan = grid.grid_plan(info, spec, (4096, 4096))
        assert plan is not None
        n += len(grid.local_regions(plan, info.local, leaf * 7919, 2))
        grid.cuts(plan, 2, (4096, 4096))
    took = time.perf_counter() - t0
    assert grid.grid_plan.cache_info().misses == 5
    assert n > 0
    assert took < 1.0, took
