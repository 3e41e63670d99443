"""The snapshot layout described by sharding grids (format 3) equals the one that lists every piece.

On the 8 host devices, with each device's node (process) simulated (`MeshTable` of fake process
indices): leaves of several specs over several meshes (devices in order and reversed), sharded,
replicated, split among replicas, on one device (no grid: listed) and host values. The grid
layout has the same pieces, offsets, sizes, gaps and inline copies as the layout built from
`binding.write_regions`, covers the same pieces of any box, round-trips through its JSON, and
every lost node (replica, xor) or pair of lost nodes (rs2) of a group is rebuilt bit-exact from
blobs filled as the engine fills them. Layouts of format 2 are still read. The engine lists the
regions of the leaves off the grid only. A 4k-device layout of 300 leaves is planned for one
node quickly, and its JSON grows with the devices once, not with devices x leaves.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
import zlib

import jax
import numpy as np
import pytest
from helpers import need_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_memory_layout import _View
from test_memory_rs2 import _seal

from ucp_jax._src.mapping import binding, grid
from ucp_jax._src.mapping.boxes import box_shape, index_to_box, to_slices
from ucp_jax._src.mapping.rules import CompiledRules
from ucp_jax._src.memory.layout import LeafMeta, SnapshotLayout, build_pieces, make_groups
from ucp_jax._src.memory.placement import GridPlacement, MeshTable, explicit, meets, spec_axes
from ucp_jax._src.memory.redundancy import (
    Sources,
    decode_node,
    decode_nodes,
    encode_rolls,
    fill,
    plan_fetches,
    union_rolls,
)


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


MESHES = {  # name -> (mesh shape, axis names, devices reversed?)
    "8": ((8,), ("a",), False),
    "2x4": ((2, 4), ("a", "b"), False),
    "4x2-rev": ((4, 2), ("a", "b"), True),
}
LEAVES = [  # (shape, spec, dtype)
    ((16, 32), P("a"), np.float32),
    ((16, 32), P(None, "b"), np.float16),
    ((64,), P(), np.float32),  # replicated on every device: split among replicas when big
    ((8, 8, 4), P(("a", "b")), np.int32),
    ((12, 3), None, np.float32),  # on one device (not a NamedSharding): the explicit fallback
    ((), P(), np.float32),  # a replicated scalar: one cell
    ((32, 16), P("b", "a"), np.float32),
]


def _mesh(name: str) -> jax.sharding.Mesh:
    shape, names, rev = MESHES[name]
    devs = jax.devices()[:8]
    return jax.sharding.Mesh(np.array(devs[::-1] if rev else devs).reshape(shape), names)


def _bindings(mesh: jax.sharding.Mesh) -> list[binding.LeafBinding]:
    tree = {}
    for i, (shape, spec, dtype) in enumerate(LEAVES):
        value = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape).astype(dtype)
        if spec is None:
            tree[f"w{i}"] = jax.device_put(value, jax.devices()[3])
            continue
        names = [a for e in spec if e for a in (e if isinstance(e, tuple) else (e,))]
        if any(a not in mesh.axis_names for a in names):
            spec = P()
        tree[f"w{i}"] = jax.device_put(value, NamedSharding(mesh, spec))
    tree["host"] = np.arange(5, dtype=np.float32)  # a host value: node 0 keeps it
    pb, _ = binding.bind_state(tree, None, CompiledRules(()))
    return pb


def _layouts(mesh_name: str, per_node: int, redundancy: str | None, group: int):
    """(explicit layout, grid layout, bindings, fake devices, grids) of one mesh."""
    mesh = _mesh(mesh_name)
    nodes = 8 // per_node
    ids = np.vectorize(lambda d: d.id)(np.asarray(mesh.devices)).astype(np.int64)
    table = MeshTable(tuple((str(k), int(v)) for k, v in mesh.shape.items()), ids,
                      ids.reshape(-1) // per_node)  # fmt: skip
    bs = _bindings(mesh)
    metas, regions, placements, grids = [], [], [], {}
    for li, b in enumerate(bs):
        meta = LeafMeta(b.name, tuple(b.shape), b.dtype, b.kind)
        metas.append(meta)
        regs = [
            (box, 0 if dev is None else dev.id // per_node)
            for box, dev, _ in binding.write_regions(b)
        ]
        regions.append(regs)
        sh = getattr(b.value, "sharding", None)
        spec = spec_axes(sh.spec, len(b.shape)) if isinstance(sh, NamedSharding) else None
        if spec is not None and grid.grid_plan(table.info, spec, tuple(b.shape)) is not None:
            grids[li] = GridPlacement(
                table, spec, tuple(b.shape), b.dtype.itemsize, zlib.crc32(b.name.encode())
            )
            placements.append(grids[li])
        else:
            placements.append(
                explicit([(p.box, p.node, p.nbytes) for p in build_pieces([meta], [regs], nodes)])
            )
    assert grids and len(grids) < len(bs)  # both kinds of leaves
    groups = make_groups(nodes, group, 3 if redundancy == "rs2" else 2)
    ref = SnapshotLayout(metas, nodes, groups, redundancy, build_pieces(metas, regions, nodes))
    lay = SnapshotLayout(metas, nodes, groups, redundancy, placements=placements)
    fakes = [FakeDevice(i, i // per_node) for i in range(8)]
    return ref, lay, bs, fakes, grids


CASES = [
    ("8", 2, "replica", 2),
    ("8", 1, "replica", 3),
    ("2x4", 2, "xor", 4),
    ("4x2-rev", 1, "xor", 3),
    ("2x4", 1, "rs2", 4),
    ("4x2-rev", 2, "rs2", 4),
    ("8", 4, None, 2),
]


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize(("mesh", "per_node", "redundancy", "group"), CASES)
def test_grid_layout_equals_listed_layout(mesh, per_node, redundancy, group, split, monkeypatch):
    need_devices(8)
    if split:  # replicated shards split among their replicas, as big ones are
        monkeypatch.setattr(binding, "SPLIT_MIN_BYTES", 64)
        monkeypatch.setattr(grid, "SPLIT_MIN_BYTES", 64)
    ref, lay, bs, _, _ = _layouts(mesh, per_node, redundancy, group)
    assert lay.redundancy == ref.redundancy
    assert lay.pieces == ref.pieces
    assert lay.copies == ref.copies
    for n in range(ref.nodes):
        assert lay.by_node[n] == ref.by_node[n], n
        assert (lay.primary[n], lay.red_bytes[n], lay.size(n)) == (
            ref.primary[n],
            ref.red_bytes[n],
            ref.size(n),
        )
        assert lay.gaps(n) == ref.gaps(n), n
        assert lay.copies_at(n) == ref.copies_at(n), n
        for p in lay.by_node[n]:
            assert lay.locations(p) == ref.locations(p)
    # the pieces covering a box: the whole leaf, its first half, a window across cells
    for li, b in enumerate(bs):
        boxes = [
            tuple((0, d) for d in b.shape),
            tuple((0, max(d // 2, 1)) if j == 0 else (0, d) for j, d in enumerate(b.shape)),
            tuple((d // 3, d // 3 + max(d // 2, 1)) for d in b.shape),
        ]
        for box in boxes:
            want = [p for p in ref.by_leaf[li] if meets(p.box, box)]
            assert lay.covering(li, box) == want, (b.name, box)
    again = SnapshotLayout.from_json(lay.to_json())
    assert again.digest == lay.digest and again.pieces == lay.pieces
    assert [again.gaps(n) for n in range(ref.nodes)] == [ref.gaps(n) for n in range(ref.nodes)]
    assert json.loads(lay.to_json())["format"] == "ucp-mem-layout/3"


def _check(lay, arrays, node, data) -> None:
    for p in lay.by_node[node]:
        meta = lay.leaves[p.leaf]
        got = (
            np.asarray(data[p.offset : p.offset + p.nbytes])
            .view(meta.dtype)
            .reshape(box_shape(p.box))
        )
        assert got.tobytes() == arrays[p.leaf][to_slices(p.box)].tobytes(), (node, meta.name, p.box)


@pytest.mark.parametrize(("mesh", "per_node", "redundancy", "group"), [c for c in CASES if c[2]])
def test_lost_nodes_of_a_grid_layout_are_rebuilt_bit_exact(mesh, per_node, redundancy, group):
    need_devices(8)
    _, lay, bs, fakes, grids = _layouts(mesh, per_node, redundancy, group)
    arrays, blobs = _fill(lay, bs, fakes, grids)
    for k in range(lay.nodes):
        _check(lay, arrays, k, blobs[k])
    if redundancy == "rs2":
        _seal(lay, blobs)
        for g in lay.groups:
            for lost in itertools.combinations(g, 2):
                others = {m: _View(blobs[m]) for m in g if m not in lost}
                got = decode_nodes(lay, list(lost), others)
                for n in lost:
                    _check(lay, arrays, n, np.asarray(getattr(got[n], "array", got[n])))
        return
    for lost in range(lay.nodes):
        others = {m: _View(blobs[m]) for m in lay.group_of[lost] if m != lost}
        _check(lay, arrays, lost, decode_node(lay, lost, others))


def _fill(lay, bs, fakes, grids):
    """Every node's blob, filled from its fetches as the engine fills it (the grid leaves'
    writers from their grids, the others' from jax's shard maps; nodes simulated)."""
    arrays = [np.asarray(b.value) for b in bs]
    shard_maps, writers = [], {}
    fake = {d.id: d for d in fakes}
    for li, b in enumerate(bs):
        if li in grids or not isinstance(b.value, jax.Array):
            shard_maps.append(None)
        else:
            idx = b.value.sharding.devices_indices_map(b.shape)
            shard_maps.append({fake[d.id]: index_to_box(i, b.shape) for d, i in idx.items()})
        for box, dev, sbox in binding.write_regions(b):
            node = 0 if dev is None else fake[dev.id].process_index
            writers[(li, box, node)] = (None if dev is None else fake[dev.id], sbox)
    sources = Sources(shard_maps, writers, grids, fakes)
    blobs = {}
    each = []
    for k in range(lay.nodes):
        fetches, rolls = plan_fetches(lay, sources, fakes, k, roll_nodes=[k])
        each.append(encode_rolls(rolls))
        assert plan_fetches(lay, sources, fakes, k)[0] == fetches
        datas = [np.ascontiguousarray(arrays[f.leaf][to_slices(f.box)]) for f in fetches]
        blob = np.full(lay.size(k), 0xAB, np.uint8)
        fill(blob, lay, k, fetches, lay.gaps(k), datas)
        blobs[k] = blob
    # the union of what each node's process needs is what every process computes for all
    assert union_rolls(each) == plan_fetches(lay, sources, fakes, 0)[1]
    return arrays, blobs


def test_layouts_of_format_2_are_still_read():
    need_devices(8)
    ref, lay, _, _, _ = _layouts("2x4", 2, "xor", 4)
    old = json.loads(ref.to_json())
    pieces = [[p.leaf, [list(ab) for ab in p.box], p.node, p.nbytes] for p in ref.pieces]
    text = json.dumps({"format": "ucp-mem-layout/2", "nodes": old["nodes"], "groups": old["groups"],
                       "redundancy": old["redundancy"], "leaves": old["leaves"], "pieces": pieces},
                      separators=(",", ":"))  # fmt: skip
    two = SnapshotLayout.from_json(text)
    assert two.format == "ucp-mem-layout/2" and two.to_json() == text  # its digest is kept
    assert two.pieces == lay.pieces
    assert [two.size(n) for n in range(4)] == [lay.size(n) for n in range(4)]


def _sim_layout(devices: int, leaves: int, per_node: int = 8) -> SnapshotLayout:
    """`leaves` FSDP matrices over a simulated mesh of `devices` (ids only), xor in groups of 4."""
    ids = np.arange(devices, dtype=np.int64)
    table = MeshTable((("fsdp", devices),), ids, ids // per_node)
    metas, placements = [], []
    for li in range(leaves):
        name = f"layer{li}.w"
        metas.append(LeafMeta(name, (devices * 4, 256), np.dtype(np.float32), "param"))
        placements.append(GridPlacement(table, (("fsdp",), ()), (devices * 4, 256), 4,
                                        zlib.crc32(name.encode())))  # fmt: skip
    nodes = devices // per_node
    return SnapshotLayout(metas, nodes, make_groups(nodes, 4), "xor", placements=placements)


def test_planning_a_4k_device_layout_for_one_node_stays_small():
    t0 = time.perf_counter()
    lay = _sim_layout(4096, 300)
    me = 301
    needs = lay.scheme.needs(lay, me)
    gaps, size = lay.gaps(me), lay.size(me)
    took = time.perf_counter() - t0
    assert len(lay.by_node[me]) == 300 * 8 and needs and size > 0 and gaps is not None
    assert len(lay._placed) <= 4  # only its group's nodes were placed
    assert took < 2.0, took
    few = _sim_layout(4096, 30)
    per_leaf = (len(lay.to_json()) - len(few.to_json())) / 270
    assert per_leaf < 100, per_leaf  # O(1) bytes a leaf, not O(devices)
    assert len(lay.to_json()) < 200_000 + 100 * 300


def test_the_engine_plans_grid_leaves_from_their_grid(tmp_path, monkeypatch):
    """A snapshot lists the regions of the leaves off the grid only, and restores bit-exact."""
    need_devices(8)
    from ucp_jax._src.memory import prepared
    from ucp_jax.memory import SnapshotManager

    listed = []
    real = prepared.write_regions
    monkeypatch.setattr(prepared, "write_regions", lambda b: listed.append(b.name) or real(b))
    mesh = _mesh("2x4")
    params = {
        "grid": jax.device_put(
            np.arange(512, dtype=np.float32).reshape(64, 8), NamedSharding(mesh, P("a", "b"))
        ),
        "one": jax.device_put(np.arange(3, dtype=np.float32), jax.devices()[2]),
        "host": np.arange(4.0),
    }
    mgr = SnapshotManager(None, redundancy=None, shm_dir=tmp_path, namespace="grid-plan")
    try:
        mgr.snapshot(1, params)
        mgr.wait()
        (prep,) = mgr._cache.values()
        d = json.loads(prep.text)
        assert d["format"] == "ucp-mem-layout/3" and len(d["meshes"]) == 1
        assert sorted("pieces" in p for p in d["placements"]) == [False, True, True]
        assert len(listed) == 2 and not any(n.endswith("grid") for n in listed), listed
        want = {k: v for k, v in params.items() if k != "host"}
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                  for k, v in want.items()}  # fmt: skip
        target["host"] = params["host"]
        got, _ = mgr.restore(target)
        for k, v in params.items():
            assert np.asarray(got[k]).tobytes() == np.asarray(v).tobytes(), k
    finally:
        mgr.free(all_nodes=True)


@pytest.mark.parametrize("processes", [2, 64, 2048])
def test_allgather_costs_each_process_the_same_round_trips_at_any_size(monkeypatch, processes):
    """A gather through the coordination service: one write, one barrier and one directory read
    per process, however many processes (it was one blocking read per process: 2k round trips
    each at 2k processes), and every process's value in process order."""
    from ucp_jax._src.memory import exchange

    calls: list[str] = []
    store: dict[str, str] = {}

    class Client:
        def key_value_set(self, key: str, value: str) -> None:
            calls.append("set")
            store[key] = value

        def wait_at_barrier(self, name: str, timeout_in_ms: int) -> None:
            calls.append("barrier")
            for i in range(processes):  # the others have published by now
                if i != 1:
                    store[f"g/{i}"] = exchange.base64.b64encode(
                        zlib.compress(json.dumps({"p": i}).encode())
                    ).decode()

        def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
            calls.append("dir_get")
            return [(k, v) for k, v in store.items() if k.startswith(prefix)]

        def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
            calls.append("get")
            return store[key]

    monkeypatch.setattr(exchange, "coordination_client", lambda: Client())
    monkeypatch.setattr("ucp_jax._src.util.sync.coordination_client", lambda: Client())
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    got = exchange.allgather_json({"p": 1}, "g")
    assert got == [{"p": i} for i in range(processes)]
    assert calls == ["set", "barrier", "dir_get"]
