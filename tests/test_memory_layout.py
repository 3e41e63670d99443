"""The snapshot layout and its redundancy, simulated for many nodes in one process (no jax job).

Fake devices (an id and a process index) stand for a job of N nodes with 2 devices each. Every
node's blob is filled exactly as the engine fills it (its fetches, XOR into the parity lane), from
the global numpy leaves; then any single lost node of a group decodes bit-exact from the others
(replica and xor, groups of 2, 3, 4 and a merged trailing group), and two lost nodes of one group
do not.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from ucp_jax._src.mapping.boxes import box_shape, to_slices
from ucp_jax._src.memory import recovery
from ucp_jax._src.memory.layout import LeafMeta, SnapshotLayout, build_pieces, make_groups
from ucp_jax._src.memory.redundancy import Sources, decode_node, fill, plan_fetches
from ucp_jax._src.memory.schemes import Replica


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def _job(nodes: int, redundancy: str | None, group_size: int, rows: int = 4, seed: int = 0):
    """A layout over fake devices, the global leaves, and each node's filled blob.

    `rows`: rows per device of the sharded leaves (bigger blobs); `seed`: other values, same
    layout.
    """
    devices = [FakeDevice(i, i // 2) for i in range(2 * nodes)]
    rng = np.random.default_rng(nodes * 10 + group_size + 1000 * seed)
    r = rows
    n_dev = len(devices)
    leaves = {
        # sharded over every device: no node holds another node's rows (exchanged by rolls)
        "rows": rng.standard_normal((r * n_dev, 6)).astype(np.float32),
        # replicated everywhere: one device writes it, every node holds it (free copies)
        "repl": rng.integers(0, 1 << 30, (5, 3), dtype=np.int32),
        # replicated within each node only: a node holds its own half of the columns
        "cols": rng.standard_normal((3, 2 * nodes)).astype(np.float16),
        "scalar": np.array(7.5, np.float32),
        # data-parallel: every device holds it, split into one row slab per node
        "dp": rng.standard_normal((r * nodes, 5)).astype(np.float32),
    }
    metas, regions, shard_maps, writers = [], [], [], {}
    for li, (name, arr) in enumerate(leaves.items()):
        metas.append(LeafMeta(name, arr.shape, arr.dtype, "param"))
        smap = {}
        for d in devices:
            if name == "rows":
                box = ((r * d.id, r * d.id + r), (0, 6))
            elif name == "cols":
                box = ((0, 3), (2 * d.process_index, 2 * d.process_index + 2))
            else:
                box = tuple((0, s) for s in arr.shape)
            smap[d] = box
        shard_maps.append(smap)
        regs = []
        if name == "dp":
            for n in range(nodes):
                box = ((r * n, r * n + r), (0, 5))
                dev = devices[2 * n]
                writers[(li, box, n)] = (dev, smap[dev])
                regs.append((box, n))
            regions.append(regs)
            continue
        for box in sorted(set(smap.values())):
            holders = [d for d in devices if smap[d] == box]
            dev = holders[(li + len(regs)) % len(holders)]  # spread the writers
            writers[(li, box, dev.process_index)] = (dev, box)
            regs.append((box, dev.process_index))
        regions.append(regs)
    pieces = build_pieces(metas, regions, nodes)
    layout = SnapshotLayout(metas, nodes, make_groups(nodes, group_size), redundancy, pieces)
    sources = Sources(shard_maps, writers)
    arrays = list(leaves.values())
    blobs = {}
    merged = []
    for k in range(nodes):
        fetches, _ = plan_fetches(layout, sources, devices, k)
        merged += [f for f in fetches if f.leaf == 4 and f.box == f.shard_box]
        datas = [np.ascontiguousarray(arrays[f.leaf][to_slices(f.box)]) for f in fetches]
        blob = np.full(layout.size(k), 0xAB, np.uint8)  # stale bytes: fill must overwrite all
        fill(blob, layout, k, fetches, layout.gaps(k), datas)
        blobs[k] = blob
    if nodes == 2 and redundancy == "replica":  # both halves of "dp" from one device, uncut
        assert len(merged) == 2, merged
    return layout, arrays, blobs


class _View:
    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def view(self, off: int, n: int) -> np.ndarray:
        return self.a[off : off + n]


def _check_pieces(layout: SnapshotLayout, arrays, node: int, data: np.ndarray) -> None:
    for p in layout.by_node[node]:
        meta = layout.leaves[p.leaf]
        got = data[p.offset : p.offset + p.nbytes].view(meta.dtype).reshape(box_shape(p.box))
        want = arrays[p.leaf][to_slices(p.box)]
        assert got.tobytes() == want.tobytes(), (node, meta.name, p.box)


CASES = [
    (2, "replica", 2),
    (4, "replica", 2),
    (3, "replica", 3),
    (2, "xor", 2),
    (3, "xor", 3),
    (4, "xor", 4),
    (5, "xor", 4),  # the trailing single node joins: one group of 5
    (6, "xor", 3),
]


@pytest.mark.parametrize(("nodes", "redundancy", "group_size"), CASES)
def test_any_single_lost_node_of_a_group_decodes(nodes, redundancy, group_size):
    layout, arrays, blobs = _job(nodes, redundancy, group_size)
    assert layout.redundancy == redundancy
    # pieces tile every leaf exactly once
    for li, arr in enumerate(arrays):
        assert sum(np.prod(box_shape(p.box)) for p in layout.by_leaf[li]) == max(arr.size, 1)
    for k in range(nodes):
        _check_pieces(layout, arrays, k, blobs[k])
    for lost in range(nodes):
        others = {m: _View(blobs[m]) for m in range(nodes) if m != lost}
        decoded = decode_node(layout, lost, others)
        _check_pieces(layout, arrays, lost, decoded)
        if redundancy == "xor":
            assert decoded.tobytes() == blobs[lost][: layout.primary[lost]].tobytes(), lost


@pytest.mark.parametrize(("nodes", "redundancy", "group_size"), CASES)
def test_two_lost_nodes_of_one_group_are_not_decodable(nodes, redundancy, group_size):
    layout, _, _ = _job(nodes, redundancy, group_size)
    for g in layout.groups:
        for a, b in itertools.combinations(g, 2):
            entries = {n: None for n in range(nodes) if n not in (a, b)}
            ok = [recovery._decodable(layout, n, entries) for n in (a, b)]
            if redundancy == "xor" or len(g) == 2:
                assert not any(ok), (g, a, b)
            else:  # a replica ring of 3+: one of two lost neighbours may still have its copy
                assert not all(ok), (g, a, b)
    # one lost node per group at once: all decodable
    entries = {n: None for n in range(nodes) if n not in [g[0] for g in layout.groups]}
    assert all(recovery._decodable(layout, g[0], entries) for g in layout.groups)


def test_redundancy_memory_overhead():
    layout, _, _ = _job(4, "xor", 4)
    # xor keeps one lane of ~1/(G-1) of the biggest node per node; replica a whole copy
    assert max(layout.red_bytes) <= -(-max(layout.primary) // 3) + 64
    rep, _, _ = _job(4, "replica", 2)
    none, _, _ = _job(4, None, 2)
    assert rep.red_bytes == none.red_bytes == [0] * 4
    # replica: a node's blob holds its own pieces and the previous node's, and nothing else
    for n in range(4):
        assert rep.size(n) == none.size(n) + none.size(Replica.backup_of(rep, n))
        held = sorted(
            [(p.offset, p.nbytes) for p in rep.by_node[n]]
            + [(off, p.nbytes) for p, locs in rep.copies.items() for h, off in locs if h == n]
        )
        assert all(a + na <= b for (a, na), (b, _) in itertools.pairwise(held))  # no overlap
        assert sum(nb for _, nb in held) + sum(nb for _, nb in rep.gaps(n)) == rep.size(n)


def test_layout_json_roundtrip():
    layout, _, _ = _job(3, "xor", 3)
    again = SnapshotLayout.from_json(layout.to_json())
    assert again.digest == layout.digest
    assert again.pieces == layout.pieces and again.groups == layout.groups


def test_groups():
    assert make_groups(1, 2) == [[0]]
    assert make_groups(4, 2) == [[0, 1], [2, 3]]
    assert make_groups(5, 2) == [[0, 1], [2, 3, 4]]
    assert make_groups(3, 4) == [[0, 1, 2]]


def test_exchange_merges_requests_and_serves_only_fetched_ranges():
    import numpy as np

    from ucp_jax._src.memory.exchange import Fetched, merge

    # adjacent or overlapping ranges of one node and server merge; others stay apart
    got = merge([(1, 0, 64, 64), (1, 0, 0, 64), (1, 0, 100, 50), (2, 0, 0, 8), (1, 3, 128, 8)])
    assert got == [(1, 0, 0, 150), (1, 3, 128, 8), (2, 0, 0, 8)]
    f = Fetched(node=1)
    f.add(128, np.arange(64, dtype=np.uint8))
    f.add(0, np.arange(32, dtype=np.uint8))
    assert f.covers(130, 10) and not f.covers(20, 20) and not f.covers(180, 20)
    assert f.view(130, 3).tolist() == [2, 3, 4] and f.nbytes == 96
    with pytest.raises(RuntimeError, match="were not fetched"):
        f.view(40, 8)


def _pieces_layout(redundancy, page_align=None):
    """Two nodes: a 100-byte leaf each, and a 256 KiB leaf split into a row slab per node."""
    metas = [
        LeafMeta("small", (25,), np.dtype(np.float32), "param"),
        LeafMeta("tiny", (25,), np.dtype(np.float32), "param"),
        LeafMeta("big", (64, 1024), np.dtype(np.float32), "param"),
    ]
    regions = [[(((0, 25),), 0)], [(((0, 25),), 1)],
               [(((0, 32), (0, 1024)), 0), (((32, 64), (0, 1024)), 1)]]  # fmt: skip
    pieces = build_pieces(metas, regions, 2)
    kw = {} if page_align is None else {"page_align": page_align}
    return SnapshotLayout(metas, 2, [[0, 1]], redundancy, pieces, **kw)


def test_big_pieces_start_on_a_page_unless_they_continue_a_shard():
    none = _pieces_layout(None)
    off = {(p.leaf, p.node): p.offset for p in none.pieces}
    # each node's slab of `big` (128 KiB) starts on a page: the two can be mapped back to back
    assert off == {(0, 0): 0, (1, 1): 0, (2, 0): 4096, (2, 1): 4096}
    rep = _pieces_layout("replica")
    big1 = next(p for p in rep.pieces if p.leaf == 2 and p.node == 1)
    big0 = next(p for p in rep.pieces if p.leaf == 2 and p.node == 0)
    assert big0.offset == 4096
    # node 0 keeps node 1's slab right after its own (the next slab of the shard): one view
    assert rep.copy_offset(big1, 0) == big0.offset + big0.nbytes
    for lay in (none, rep):
        again = SnapshotLayout.from_json(lay.to_json())
        assert again.pieces == lay.pieces and again.digest == lay.digest


def test_layouts_of_the_previous_format_keep_their_offsets():
    old = _pieces_layout(None, page_align=64)
    text = old.to_json()
    assert '"format":"ucp-mem-layout/1"' in text
    again = SnapshotLayout.from_json(text)
    assert {(p.leaf, p.node): p.offset for p in again.pieces}[(2, 0)] == 128  # 64-byte aligned
    assert again.digest == old.digest != _pieces_layout(None).digest
    with pytest.raises(ValueError, match="not a snapshot layout this version reads"):
        SnapshotLayout.from_json(text.replace("ucp-mem-layout/1", "ucp-mem-layout/9"))
