"""A patterned leaf's chunk boundaries mapped per axis (`mapping/chain_cuts.py`) equal the slow
path's (`binding.atom_boundaries` over every writer region of the job), for every pattern type and
combinations, on many meshes, specs and grids; and save planning does no per-device work for them."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, ClassVar

import jax
import numpy as np
import optax
import pytest
from helpers import mesh_of, need_devices
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ucp_jax._src import save_plan
from ucp_jax._src.mapping import binding, grid, patterns
from ucp_jax._src.mapping.chain_cuts import chain_cuts
from ucp_jax._src.mapping.patterns import (
    Averaged,
    Fused,
    LeafContext,
    Partitioned,
    Replicated,
    Stacked,
    Transposed,
    VocabPadded,
)
from ucp_jax._src.mapping.rename import Renamed
from ucp_jax._src.mapping.rules import CompiledRules

# name -> (leaf shape, pattern chain, atom outward); 'b' is the tensor-parallel mesh axis
# name -> (leaf shape, pattern chain, atom outward); 'b' is the tensor-parallel mesh axis
EXPERTS = (Stacked("blocks.{i}.experts.{e}.w", axes=0, index="e"), Stacked("blocks.{i}", axes=0))
STACKED_QKV = (Fused((32, 16, 16), axis=1, shard_axis="b"), Stacked("layers.{i}.qkv", axes=0))
MLP = Fused((16, 16), axis=0, shard_axis="b", atoms=("layers.{i}.gate", "layers.{i}.up"))
STACKED_MLP_T = (MLP, Transposed((1, 0)), Stacked("layers.{i}.mlp", axes=0))
LEAVES: dict[str, tuple[tuple[int, ...], Any]] = {
    "plain": ((16, 32), ()),
    "qkv": ((16, 96), Fused((32, 32, 32), axis=1, shard_axis="b")),
    "gqa": ((16, 96), Fused((64, 16, 16), axis=1, shard_axis="b")),
    "gqa_rows": ((96, 8), Fused((64, 16, 16), axis=0, shard_axis="a")),
    "swiglu": ((96, 16), Fused((48, 48), axis=0, shard_axis="a", atoms=("mlp.gate", "mlp.up"))),
    "vocab": ((128, 16), VocabPadded(101, axis=0)),
    "vocab_t": ((16, 128), (VocabPadded(101, axis=0), Transposed((1, 0)))),
    "fused_vocab": ((128, 8), (Fused((64, 32), axis=0, shard_axis="a"), VocabPadded(96, axis=0))),
    "stacked": ((8, 16, 32), Stacked("layers.{i}.w", axes=0)),
    "stacked2": ((2, 4, 16, 8), Stacked("blk.{i}.w", axes=(0, 1))),
    "stacked_mid": ((16, 4, 8), Stacked("mid.{i}.w", axes=1)),
    "experts": ((4, 2, 16, 8), EXPERTS),
    "stacked_qkv": ((4, 16, 64), STACKED_QKV),
    "stacked_mlp_t": ((4, 16, 32), STACKED_MLP_T),
    "transposed3": ((8, 16, 32), Transposed((2, 0, 1))),
    "identities": ((16, 32), (Replicated(), Partitioned(1), Averaged(), Renamed("moved.w"))),
    "empty": ((0, 16), Transposed((1, 0))),
    "scalar": ((), Renamed("step_count")),
}
SPECS = [P(), P("a"), P(None, "a"), P("a", "b"), P("b", "a"), P(("a", "b")), P(None, ("b", "a")),
         P("b"), P(None, "b"), P(None, None, "a"), P("c", None, "b"), P(None, "a", "b")]  # fmt: skip
MESHES = {
    "8": lambda: mesh_of((8,)),
    "2x4": lambda: mesh_of((2, 4)),
    "4x2": lambda: mesh_of((4, 2)),
    "2x2x2": lambda: mesh_of((2, 2, 2)),
    "1x8": lambda: mesh_of((1, 8)),
    "8x1": lambda: mesh_of((8, 1)),
    "2x4-reversed": lambda: jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("a", "b")),
    "4x2-shuffled": lambda: jax.sharding.Mesh(
        np.array(jax.devices())[[3, 6, 0, 5, 7, 1, 2, 4]].reshape(4, 2), ("a", "b")),
}  # fmt: skip


def _fits(spec: Any, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> bool:
    if len(spec) > len(shape):
        return False
    for entry, dim in zip(spec, shape):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        if any(a not in mesh.shape for a in names):
            return False
        if dim % int(np.prod([mesh.shape[a] for a in names], dtype=int)):
            return False
    return True


def _state(mesh: jax.sharding.Mesh) -> tuple[dict[str, Any], CompiledRules]:
    tree, rules = {}, []
    for name, (shape, chain) in LEAVES.items():
        for i, spec in enumerate(SPECS):
            if _fits(spec, shape, mesh):
                key = f"{name}_s{i}"
                tree[key] = jax.device_put(np.zeros(shape, np.float32), NamedSharding(mesh, spec))
                if chain:  # a Renamed/Stacked atom name must differ per spec: prefix it
                    rules.append((key, _prefixed(chain, key)))
    return tree, CompiledRules(rules)


def _prefixed(chain: Any, key: str) -> Any:
    """`chain` with every atom name template prefixed by `key` (one atom set per leaf)."""
    chain = chain if isinstance(chain, tuple) else (chain,)
    out = []
    for p in chain:
        if isinstance(p, Stacked | Renamed):
            field = "atoms" if isinstance(p, Stacked) else "atom"
            p = dataclasses.replace(p, **{field: f"{key}.{getattr(p, field)}"})
        elif isinstance(p, Fused) and p.atoms:
            p = dataclasses.replace(p, atoms=tuple(f"{key}.{a}" for a in p.atoms))
        out.append(p)
    return tuple(out)


def _slow(b: binding.LeafBinding) -> tuple[list[Any], dict[str, list[set[int]]]]:
    regions = binding.write_regions(b)
    return binding.my_write_tasks(b, regions), binding.atom_boundaries(b, regions)


def _task_keys(tasks: list[Any]) -> list[Any]:
    return sorted((t.box, -1 if t.device is None else t.device.id, t.shard_box) for t in tasks)


class _Counter:
    """Wraps a function and counts its calls."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split-replicas"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_plan_writes_equals_per_device_plan(mesh_name, split, monkeypatch):
    """Every pattern and combination, every spec that fits: same tasks, same boundaries, and no
    atom piece of any region computed (the slow path's per-region mapping is never called)."""
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    if split:  # replicated shards split among their replicas, as big arrays are
        monkeypatch.setattr(binding, "SPLIT_MIN_BYTES", 64)
        monkeypatch.setattr(grid, "SPLIT_MIN_BYTES", 64)
    mesh = MESHES[mesh_name]()
    tree, rules = _state(mesh)
    pb, _ = binding.bind_state(tree, None, rules)
    checked = patterned = 0
    for b in pb:
        tasks_slow, cuts_slow = _slow(b)
        pieces = _Counter(patterns.chain_pieces)
        monkeypatch.setattr(binding, "chain_pieces", pieces)
        tasks, cuts = binding.plan_writes(b)
        monkeypatch.setattr(binding, "chain_pieces", patterns.chain_pieces)
        assert pieces.calls == 0, b.name  # no region of the job mapped through the chain
        assert cuts == cuts_slow, b.name
        assert _task_keys(tasks) == _task_keys(tasks_slow), b.name
        assert set(cuts) == set(b.atoms()), b.name
        checked += 1
        patterned += bool(b.chain)
    assert checked >= 50 and patterned >= 45, (checked, patterned)


def test_optimizer_moments_map_like_their_parameter(monkeypatch):
    """Adam's moments of patterned parameters (their chain, their base name) on a 2x4 mesh."""
    monkeypatch.setattr(binding, "SPLIT_MIN_BYTES", 64)
    monkeypatch.setattr(grid, "SPLIT_MIN_BYTES", 64)
    tree, rules = _state(mesh_of((2, 4)))
    pb, ob = binding.bind_state(tree, optax.adam(1e-3).init(tree), rules)
    moments = [b for b in ob if b.chain]
    assert len(moments) == 2 * len([b for b in pb if b.chain])
    for b in moments:
        tasks, cuts = binding.plan_writes(b)
        tasks_slow, cuts_slow = _slow(b)
        assert cuts == cuts_slow, b.name
        assert _task_keys(tasks) == _task_keys(tasks_slow), b.name


def _partition(rng: np.random.Generator, dim: int, parts: int) -> list[tuple[int, int]]:
    """`dim` cut into `parts` intervals of random, uneven lengths (at least 1 each)."""
    parts = max(1, min(parts, dim))
    cuts = sorted(rng.choice(np.arange(1, dim), size=parts - 1, replace=False)) if parts > 1 else []
    ends = [0, *map(int, cuts), dim]
    return list(itertools.pairwise(ends))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", [n for n, (s, c) in LEAVES.items() if c and s and 0 not in s])
def test_uneven_product_grids(name, tp):
    """Random uneven product grids of regions (cuts anywhere, through sub-params and padding),
    and every tensor-parallel degree the sub-params allow: equal to the per-region mapping."""
    shape, chain = LEAVES[name]
    chain = chain if isinstance(chain, tuple) else (chain,)
    if any(isinstance(p, Fused) and any(s % tp for s in p.sizes) for p in chain):
        pytest.skip(f"{name}: its sub-params do not divide by tensor degree {tp}")
    ctx = LeafContext(name, None, {"a": tp, "b": tp})
    b = binding.LeafBinding(name, "param", name, "fp32", None, 0, chain, ctx, shape,
                            np.dtype(np.float32), None, None)  # fmt: skip
    rng = np.random.default_rng(len(name) * 31 + tp)
    for trial in range(12):
        axes = [_partition(rng, d, int(rng.integers(1, d + 1))) for d in shape]
        if trial == 0:
            axes = [[(0, d)] for d in shape]  # one region: the whole leaf
        regions = [(box, None, box) for box in itertools.product(*axes)]
        assert binding.product_axes(regions, len(shape)) == [sorted(a) for a in axes]
        got = chain_cuts(b.chain, b.ctx, b.shape, axes)
        assert got == binding.atom_boundaries(b, regions), (name, tp, axes)


@dataclasses.dataclass(frozen=True)
class _Shifted(patterns.Pattern):
    """A pattern chain_cuts does not know (a user's own): planning falls back to every region."""

    kind: ClassVar[str] = "TestShifted"

    def split(self, node: Any, ctx: LeafContext) -> list[Any]:
        return [node]


def test_unknown_pattern_and_non_product_regions_fall_back():
    mesh = mesh_of((2, 4))
    x = jax.device_put(np.zeros((16, 96), np.float32), NamedSharding(mesh, P("a", "b")))
    rules = CompiledRules([("x", (Fused((32, 32, 32), axis=1, shard_axis="b"), _Shifted()))])
    (b,), _ = binding.bind_state({"x": x}, None, rules)
    assert chain_cuts(b.chain, b.ctx, b.shape, [[(0, 16)], [(0, 96)]]) is None
    tasks, cuts = binding.plan_writes(b)
    tasks_slow, cuts_slow = _slow(b)
    assert cuts == cuts_slow and _task_keys(tasks) == _task_keys(tasks_slow)
    # regions that are not every combination of their intervals: no per-axis answer
    ragged = [(((0, 8), (0, 48)), None, None), (((8, 16), (0, 96)), None, None)]
    assert binding.product_axes(ragged, 2) is None


def test_host_values_plan_on_the_per_device_path():
    (b,), _ = binding.bind_state({"h": np.ones((6, 4), np.float32)}, None,
                                 CompiledRules([("h", VocabPadded(5, axis=0))]))  # fmt: skip
    assert binding.plan_on_grid(b) is None
    tasks, cuts = binding.plan_writes(b)
    assert cuts == _slow(b)[1] == {"h": [{0, 5}, {0, 4}]}
    assert [t.box for t in tasks] == [((0, 6), (0, 4))]


def test_empty_shards_are_one_region():
    """A 0-row leaf split over 8 devices: every device holds the same empty box, written once (the
    grid planner gave each device its own cell, 8 writers of one box, before)."""
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    x = jax.device_put(np.zeros((0, 16), np.float32), NamedSharding(mesh_of((8,)), P("a")))
    (b,), _ = binding.bind_state({"x": x}, None, CompiledRules(()))
    assert grid.grid_plan(grid.mesh_info(x.sharding.mesh, 0), ("a",), (0, 16)) is None
    tasks, cuts = binding.plan_writes(b)
    tasks_slow, cuts_slow = _slow(b)
    assert len(tasks) == len(tasks_slow) == 1
    assert cuts == cuts_slow


# ------------------------------------------------------------------- cost at 1k and 16k devices


def _simulated_plan(devices: int, leaves: int) -> tuple[float, int, int, int]:
    """SavePlan of one process (8 devices) in an abstract (devices/8, 8) mesh: (seconds, pattern
    split calls, per-region mappings, tasks)."""
    a, tp = devices // 8, 8
    mesh = AbstractMesh((a, tp), ("data", "model"))
    side = 4096
    tree: dict[str, Any] = {}
    rules = []
    for i in range(leaves):
        kind = i % 4
        if kind == 0:
            shape, spec, chain = (side, 3 * side), P("data", "model"), Fused(
                (side, side, side), axis=1, shard_axis="model")  # fmt: skip
        elif kind == 1:
            shape, spec, chain = (side, side), P("model", "data"), VocabPadded(side - 123)
        elif kind == 2:
            shape, spec = (32, side, side), P(None, "data", "model")
            chain = Stacked(f"blocks.{{i}}.w{i}", axes=0)
        else:
            shape, spec, chain = (side, side), P("data", None), ()
        tree[f"w{i}"] = jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))
        if chain:
            rules.append((f"w{i}", chain))
    pb, _ = binding.bind_state(tree, None, CompiledRules(rules))
    me = a // 2  # a process in the middle of the job
    local = tuple((p, p) for p in range(me * 8, me * 8 + 8))
    info = grid.MeshInfo((("data", a), ("model", tp)),
                         np.arange(devices, dtype=np.int64).reshape(a, tp), local)  # fmt: skip
    splits = [_Counter(cls.split) for cls in (Fused, VocabPadded, Stacked)]
    per_region = _Counter(binding.atom_boundaries)
    with pytest.MonkeyPatch.context() as mp:
        for cls, counter in zip((Fused, VocabPadded, Stacked), splits):
            mp.setattr(cls, "split", lambda self, node, ctx, c=counter: c(self, node, ctx))
        mp.setattr(binding, "atom_boundaries", per_region)
        grid.grid_plan.cache_clear()
        t0 = time.perf_counter()
        plan = save_plan.SavePlan(1 << 30, mesh_info=lambda m: info)
        for b in pb:
            plan.add(b)
        took = time.perf_counter() - t0
    return took, sum(c.calls for c in splits), per_region.calls, len(plan.tasks)


def test_save_planning_grows_with_own_shards_not_devices():
    """Fused, padded, stacked and plain leaves: the same pattern work at 1k and 16k devices (the
    shards per TP axis and the layers, not the devices), none of it per region, under a second."""
    small = _simulated_plan(1024, 40)
    big = _simulated_plan(16384, 40)
    assert small[1] == big[1] > 0  # pattern splits: independent of the device count
    assert small[2] == big[2] == 0  # no leaf planned region by region
    assert small[3] == big[3] > 0  # this process's own write tasks
    assert big[0] < 1.0, big
