"""`rs2`: two parities per group (P = XOR, Q = Reed–Solomon over GF(2^8), bit-sliced).

Simulated for many nodes in one process, as tests/test_memory_layout.py does (fake devices, every
node's blob filled exactly as the engine fills it, then the digests exchanged and kept as the
engine does before a snapshot commits): in groups of k = 3, 4 and 8 (and 2, and several groups),
every single lost node and every pair of lost nodes of a group is rebuilt bit-exact, reading only
the byte ranges the scheme names; three lost nodes are not decodable, and recovery says which;
a stale parity, any one-bit damage to a parity, or a missing digest table, raises
`ParityMismatch` instead of giving wrong bytes; each node's `extra` is rebuilt from any two lost. GF(2^8) in bit-sliced form is
checked against byte-wise field arithmetic.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from test_memory_layout import _check_pieces, _job

from ucp_jax._src.memory import extra as extras
from ucp_jax._src.memory import gf256, recovery
from ucp_jax._src.memory import redundancy as red
from ucp_jax._src.memory.blobs import Decoded
from ucp_jax._src.memory.layout import SnapshotLayout, make_groups
from ucp_jax._src.memory.redundancy import decode_nodes, decode_ranges
from ucp_jax._src.memory.schemes import ParityMismatch, scheme_for

RS2 = scheme_for("rs2")


def _seal(layout, blobs) -> None:
    """What the engine does before each node commits: digests of its own lanes to its peers,
    who keep them (`PeerExchange.seal`)."""
    s = layout.scheme
    digests = {n: json.loads(json.dumps(s.digest(layout, n, blobs[n]))) for n in blobs}
    for n in blobs:
        s.keep_digests(layout, n, blobs[n], {m: digests[m] for m in s.digest_sources(layout, n)})


def _sealed(nodes, k, rows=40, seed=0):
    layout, arrays, blobs = _job(nodes, "rs2", k, rows=rows, seed=seed)
    _seal(layout, blobs)
    return layout, arrays, blobs


class _Ranges:
    """A node's blob that serves only the byte ranges the scheme said it reads."""

    def __init__(self, blob: np.ndarray, ranges: list[tuple[int, int]]) -> None:
        self.blob, self.ranges = blob, ranges

    def view(self, off: int, n: int) -> np.ndarray:
        assert any(a <= off and off + n <= a + m for a, m in self.ranges), (off, n, self.ranges)
        return self.blob[off : off + n]


def _rebuild(layout, blobs, lost, want=None, named=None):
    """Decode `lost` (members of one group) from the others, through the ranges they name
    (with `want`: only those parts of the lost nodes; `named` receives the ranges)."""
    g = layout.group_of[lost[0]]
    present = [n for n in range(layout.nodes) if n not in lost]
    ranges: dict[int, list[tuple[int, int]]] = {} if named is None else named
    for n in lost:
        for node, off, nb in decode_ranges(layout, n, present, want):
            assert node in g and node not in lost, (node, lost)
            ranges.setdefault(node, []).append((off, nb))
    others = {m: _Ranges(blobs[m], ranges.get(m, [])) for m in g if m not in lost}
    return decode_nodes(layout, list(lost), others, want)


@pytest.mark.parametrize("k", [3, 4, 8])
def test_every_pair_of_a_group_is_rebuilt_bit_exact(k):
    layout, arrays, blobs = _sealed(k, k)
    assert layout.groups == [list(range(k))] and layout.redundancy == "rs2"
    c = RS2.lane_bytes(layout, 0)
    # the lanes are used: every node's pieces part spans all k-2 of its lanes
    assert all(c * (k - 3) < layout.primary[n] <= c * (k - 2) for n in range(k))
    for r in (1, 2):
        for lost in itertools.combinations(range(k), r):
            present = [n for n in range(k) if n not in lost]
            assert all(recovery._decodable(layout, n, present) for n in lost)
            got = _rebuild(layout, blobs, list(lost))
            for n in lost:
                _check_pieces(layout, arrays, n, got[n])  # every piece of the lost node
                assert got[n].tobytes() == blobs[n][: layout.primary[n]].tobytes()


@pytest.mark.parametrize("k", [3, 4, 8])
def test_three_lost_nodes_of_a_group_are_not_decodable_and_recovery_names_them(k):
    layout, _, _ = _sealed(k, k, rows=4)
    for lost in itertools.combinations(range(k), 3):
        present = {n: [0] for n in range(k) if n not in lost}
        assert not any(recovery._decodable(layout, n, present) for n in lost)
    present = {n: [0] for n in range(k) if n not in (0, 1, 2)}
    cands, why = recovery._select({(1, 7, layout.digest): present}, lambda key: layout, {})
    assert cands == []
    assert why == [f"step 7: node(s) [0, 1, 2] lost in group {list(range(k))} "
                   "(rs2 rebuilds any 2 lost node(s) of a group)"]  # fmt: skip


def test_two_lost_in_each_of_several_groups_at_once():
    layout, arrays, blobs = _sealed(7, 3)  # groups [0, 1, 2] and [3, 4, 5, 6]
    assert layout.groups == [[0, 1, 2], [3, 4, 5, 6]]
    lost = [0, 2, 4, 6]
    present = [1, 3, 5]
    assert all(recovery._decodable(layout, n, present) for n in lost)
    for group_lost in ([0, 2], [4, 6]):
        got = _rebuild(layout, blobs, group_lost)
        for n in group_lost:
            _check_pieces(layout, arrays, n, got[n])


def test_groups_smaller_than_three_join_the_previous_and_a_pair_survives_one():
    assert make_groups(8, 6, min_size=3) == [list(range(8))]
    assert make_groups(2, 6, min_size=3) == [[0, 1]]
    layout, arrays, blobs = _sealed(2, 2)  # a group of 2: P only (each keeps the other's copy)
    assert RS2.tolerance(2) == 1 and layout.red_bytes[0] < 2 * RS2.lane_bytes(layout, 0)
    for n in (0, 1):
        _check_pieces(layout, arrays, n, _rebuild(layout, blobs, [n])[n])
    assert not recovery._decodable(layout, 0, [])


@pytest.mark.parametrize("k", [4, 6, 8])
def test_memory_overhead_is_two_lanes_of_a_k_minus_2_share(k):
    layout, _, _ = _sealed(k, k, rows=400)
    for n in range(k):
        share = max(layout.primary) / (k - 2)
        # two parity lanes (rounded up to 512 bytes) and a digest table of 8 (2k + 1) bytes
        assert 2 * share <= layout.red_bytes[n] <= 2 * (share + 512) + 8 * (2 * k + 1) + 64
    xor, _, _ = _job(k, "xor", k, rows=400)
    assert max(layout.red_bytes) > max(xor.red_bytes)  # the price of the second parity


def _lose_both_data(layout, s):
    """The two data members of stripe s (of a group of 4): their rebuild needs P and Q."""
    return RS2.data_of(layout, layout.groups[0], s)


def test_a_stale_parity_is_detected_not_decoded():
    layout, _, blobs = _sealed(4, 4)
    _, _, older = _sealed(4, 4, seed=1)  # the same layout, another step's values
    g = layout.groups[0]
    lost = _lose_both_data(layout, 0)  # stripe 0: data of nodes 2 and 3, P on 0, Q on 1
    assert lost == [2, 3]
    q_holder, q_off = RS2.parity_at(layout, g, 0, 1)
    c = RS2.lane_bytes(layout, 0)
    stale = {n: b.copy() for n, b in blobs.items()}
    stale[q_holder][q_off : q_off + c] = older[q_holder][q_off : q_off + c]
    with pytest.raises(ParityMismatch, match=r"does not match the digest node [01] kept"):
        _rebuild(layout, stale, lost)
    _rebuild(layout, blobs, lost)  # (the fresh parity rebuilds them)


@pytest.mark.parametrize("which", [0, 1])  # a damaged P, a damaged Q
def test_a_damaged_parity_is_detected_for_one_or_two_lost(which):
    layout, _, blobs = _sealed(4, 4)
    g = layout.groups[0]
    h, off = RS2.parity_at(layout, g, 1, which)  # stripe 1: data of nodes 0 and 3
    # one lost data node of stripe 1 rebuilt from P (its holder present), or from Q when the
    # other lost node is P's holder; two from both
    one = [0] if which == 0 else [0, RS2.holders(layout, g, 1)[0]]
    for pos, bit in itertools.product([0, 100, 777, 1000], range(8)):  # every bit of a few bytes
        bad = {n: b.copy() for n, b in blobs.items()}
        bad[h][off + pos] ^= 1 << bit
        for lost in ([0, 3], one):
            with pytest.raises(ParityMismatch, match="stale or damaged"):
                _rebuild(layout, bad, lost)


def test_a_snapshot_without_digest_table_cannot_be_rebuilt():
    layout, _, blobs = _job(4, "rs2", 4, rows=40)  # filled, never sealed
    with pytest.raises(ParityMismatch, match="no digest table"):
        _rebuild(layout, blobs, [1, 2])


@pytest.mark.parametrize("k", [3, 4, 8])
def test_a_lost_nodes_extra_is_rebuilt_from_any_two_lost(k):
    """Each node keeps P and Q of the others' serialised extras (different lengths)."""
    from types import SimpleNamespace

    group = list(range(k))
    layout = SimpleNamespace(group_of={n: group for n in group})
    own = {n: extras.serial(extras.encode({"loader": bytes([n]) * (5 + 7 * n), "n": n}))
           for n in group}  # fmt: skip
    kept = {n: RS2.keep_extras(layout, n, {s: own[s] for s in RS2.extra_sources(layout, n)})
            for n in group}  # fmt: skip
    for r in (1, 2):
        for lost in itertools.combinations(group, r):
            left = [n for n in group if n not in lost]
            for n in lost:
                got = RS2.rebuild_extra(layout, n, {m: kept[m] for m in left},
                                        {m: own[m] for m in left})  # fmt: skip
                assert got == own[n], (lost, n)
    if k >= 4:
        left = group[3:]
        assert RS2.rebuild_extra(layout, 0, {m: kept[m] for m in left},
                                 {m: own[m] for m in left}) is None  # fmt: skip


@pytest.mark.parametrize("k", [4, 8])
def test_a_partial_rebuild_reads_only_what_the_wanted_lanes_need_and_is_bit_exact(k):
    """A process reading one piece of a lost node rebuilds only the stripes of the lanes that
    hold it, reading less than a whole rebuild; what it wanted is bit-exact."""
    layout, _, blobs = _sealed(k, k, rows=60)
    g = layout.groups[0]
    for lost in itertools.combinations(range(k), 2):
        n = lost[0]
        for p in layout.by_node[n]:
            want = {n: [(p.offset, p.nbytes)]}
            named: dict[int, list[tuple[int, int]]] = {}
            got = _rebuild(layout, blobs, list(lost), want, named)
            assert (
                got[n][p.offset : p.offset + p.nbytes].tobytes()
                == blobs[n][p.offset : p.offset + p.nbytes].tobytes()
            )
            full: dict[int, list[tuple[int, int]]] = {}
            _rebuild(layout, blobs, list(lost), None, full)
            stripes = {s for s in range(k) if n in RS2.data_of(layout, g, s)
                       and p.offset < RS2.lane(layout, n, s)[1]
                       and RS2.lane(layout, n, s)[0] < p.offset + p.nbytes}  # fmt: skip
            nbytes = sum(nb for rs in named.values() for _, nb in rs)
            if len(stripes) < k - 2:  # the piece is in fewer lanes than the node has
                assert nbytes < sum(nb for rs in full.values() for _, nb in rs), (lost, p)


@pytest.mark.parametrize("k", [3, 4, 8])
def test_a_rebuild_in_many_column_blocks_is_bit_exact(k, monkeypatch):
    """The solve runs `SOLVE_COLS` columns of the packets at a time (a short last lane too)."""
    from ucp_jax._src.memory import rs2

    monkeypatch.setattr(rs2, "SOLVE_COLS", 64)
    layout, arrays, blobs = _sealed(k, k, rows=60)
    assert RS2.lane_bytes(layout, 0) // 8 >= 2 * rs2.SOLVE_COLS
    assert any(layout.primary[n] % RS2.lane_bytes(layout, n) for n in range(k))  # a short lane
    for lost in itertools.combinations(range(k), 2):
        got = _rebuild(layout, blobs, list(lost))
        for n in lost:
            _check_pieces(layout, arrays, n, got[n])


def test_a_partial_rebuild_still_detects_a_damaged_piece_or_parity():
    layout, _, blobs = _sealed(4, 4, rows=60)
    g = layout.groups[0]
    lost = [2, 3]  # stripe 0: both data lanes lost; P on 0, Q on 1
    want = {2: [(RS2.lane(layout, 2, 0)[0], 8)], 3: []}  # 8 bytes of node 2's lane of stripe 0
    for h, off in (RS2.parity_at(layout, g, 0, 0), RS2.parity_at(layout, g, 0, 1)):
        bad = {n: x.copy() for n, x in blobs.items()}
        bad[h][off + RS2.lane_bytes(layout, 0) - 1] ^= 0x10  # far from the bytes wanted
        with pytest.raises(ParityMismatch, match="stale or damaged"):
            _rebuild(layout, bad, lost, want)
    # node 1's lane of stripe 3 (data: 1, 2; P on 3 lost, Q on 0): a damaged surviving piece
    bad = {n: x.copy() for n, x in blobs.items()}
    bad[1][RS2.lane(layout, 1, 3)[0] + 5] ^= 1
    with pytest.raises(ParityMismatch, match="stale or damaged"):
        _rebuild(layout, bad, [2, 3], {2: [(RS2.lane(layout, 2, 3)[0], 8)], 3: []})


@pytest.mark.parametrize(("k", "sharers"), [(3, 2), (4, 3), (4, 4), (8, 5)])
def test_a_rebuild_split_between_processes_is_bit_exact_and_checked(k, sharers, monkeypatch):
    """`share`: each of n processes solves share i of the columns of every stripe into the same
    buffers (`decode_share`, unchecked); together they give what `decode_parts` gives, and
    `check_parts` passes; one wrong byte in any share is caught."""
    from ucp_jax._src.memory import rs2

    monkeypatch.setattr(rs2, "SOLVE_COLS", 64)  # several column blocks per share
    layout, arrays, blobs = _sealed(k, k, rows=60)
    g = layout.groups[0]
    for lost in itertools.combinations(range(k), 2):
        others = {m: _Ranges(blobs[m], [(0, len(blobs[m]))]) for m in g if m not in lost}
        want = {n: [(0, layout.primary[n])] for n in lost}
        units = RS2.share_units(layout, list(lost), others, want)
        lanes = {s: [RS2.lane(layout, n, s) for n in lost if n in RS2.data_of(layout, g, s)]
                 for s in range(k)}  # fmt: skip
        assert units == [s for s, ls in lanes.items() if any(b > a for a, b in ls)]
        out = {n: np.zeros(layout.primary[n], np.uint8) for n in lost}
        for i in range(sharers):
            RS2.decode_share(layout, list(lost), others, [(s, i, sharers) for s in units], out)
        RS2.check_parts(layout, list(lost), others, want, out)
        for n in lost:
            _check_pieces(layout, arrays, n, out[n])
            assert out[n].tobytes() == blobs[n][: layout.primary[n]].tobytes()
        n = lost[0]
        out[n][len(out[n]) // 2] ^= 4  # a peer's wrong byte
        with pytest.raises(ParityMismatch, match="does not match the digest"):
            RS2.check_parts(layout, list(lost), others, want, out)


def test_schemes_without_digests_do_not_share_a_rebuild():
    layout, _, _ = _job(4, "xor", 4)
    assert layout.scheme.share_units(layout, [1], [0, 2, 3], {1: [(0, 8)]}) == []


def test_a_rebuilt_node_serves_only_the_ranges_planned():
    d = Decoded(np.arange(100, dtype=np.uint8), [(10, 20), (30, 5), (60, 0)])
    assert d.view(10, 25).tolist() == list(range(10, 35))  # (adjacent ranges merged)
    assert d.view(12, 3).tolist() == [12, 13, 14] and len(d.view(50, 0)) == 0
    for off, n in ((0, 11), (34, 2), (60, 1), (90, 5)):
        with pytest.raises(RuntimeError, match="not planned for rebuilding"):
            d.view(off, n)
    assert Decoded(np.zeros(4, np.uint8)).view(0, 4).tolist() == [0] * 4  # no plan: all of it


@pytest.mark.parametrize("redundancy", ["xor", "rs2"])
def test_staged_copies_then_blocked_xors_fill_the_same_blob(redundancy, monkeypatch):
    """On CPU devices with a donated state the step copies the XOR sources out (`stage`) and
    the XORs run later, a block at a time: the same blob, whatever the sources hold by then."""
    fetched: dict = {}
    layout, _, blobs = _job(4, redundancy, 4, rows=400, fetched=fetched)  # (one XOR block)
    monkeypatch.setattr(red, "XOR_BLOCK", 1024)
    assert layout.red_bytes[0] > 3 * red.XOR_BLOCK
    for k, (fetches, datas) in fetched.items():
        stage = np.empty(red.stage_bytes(layout, k, fetches), np.uint8)
        blob = np.full(layout.size(k), 0xCD, np.uint8)
        originals = list(datas)
        _, xors = red.copy_out(blob, layout, k, fetches, layout.gaps(k), datas, stage)
        assert all(d is None for d in datas)
        for d in originals:  # the next step overwrites the donated buffers
            d.view(np.uint8)[:] = 0x5A
        red.xor_fill(blob[layout.primary[k] :], xors)
        assert blob.tobytes() == blobs[k].tobytes(), k


def test_digests_are_zlibs_crc32_so_older_snapshots_still_verify():
    """zlib-ng computes the digests now; the values are zlib's CRC-32, as before."""
    import zlib

    from ucp_jax._src.memory.shm import blob_crc as _crc

    rng = np.random.default_rng(3)
    for n in (0, 1, 63, 4096, 1 << 20):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert _crc(a) == zlib.crc32(a.tobytes())
    a = rng.integers(0, 256, 999, dtype=np.uint8)
    assert _crc(a[1::2]) == zlib.crc32(a[1::2].tobytes())  # (a strided view: copied first)


def test_layout_with_rs2_round_trips():
    layout, _, _ = _job(8, "rs2", 4, rows=8)
    assert layout.groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    again = SnapshotLayout.from_json(layout.to_json())
    assert again.digest == layout.digest and again.red_bytes == layout.red_bytes


# --------------------------------------------------------------------------- GF(2^8), bit-sliced


def _symbols(lane: np.ndarray) -> np.ndarray:
    """The GF(2^8) symbols of a lane in bit-sliced form: bit b of symbol t is bit t of packet b."""
    w = len(lane) // 8
    bits = np.unpackbits(lane.reshape(8, w), axis=1, bitorder="little")
    return sum(bits[b].astype(np.int64) << b for b in range(8))


def _mul_table() -> np.ndarray:
    """Byte-wise products in GF(2^8) mod 0x11d, from log/exp tables (independent of gf256)."""
    exp, log = np.zeros(510, np.int64), np.zeros(256, np.int64)
    x = 1
    for i in range(255):
        exp[i], log[x] = x, i
        x = (x << 1) ^ (0x11D if x & 0x80 else 0)
    exp[255:] = exp[:255]
    a = np.arange(256)
    t = exp[(log[a][:, None] + log[a][None, :]) % 255]
    t[0, :] = t[:, 0] = 0
    return t


def test_bit_sliced_multiplication_is_field_multiplication():
    table = _mul_table()
    assert gf256.gmul(0x80, 2) == table[0x80, 2] == 0x1D and gf256.ginv(2) == 0x8E
    assert all(table[a, gf256.ginv(a)] == 1 for a in range(1, 256))
    assert sorted(gf256.COEFFS) == list(range(1, 256))
    rng = np.random.default_rng(0)
    lane = rng.integers(0, 256, 1024, dtype=np.uint8)
    sym = _symbols(lane)
    for c in (1, 2, 3, 0x8E, 0x47, 0xFF, 0x1D):
        out = gf256.mul(lane, c)
        assert (_symbols(out) == table[sym, c]).all(), c
        # piece by piece, in any order, bytes outside each piece taken as zero
        acc = np.zeros_like(lane)
        for lo, hi in [(700, 1024), (0, 13), (13, 700)]:
            for a, b, d in gf256.segments(c, len(lane) // 8, lo, hi):
                gf256.xor_into(acc[d : d + b - a], lane[a:b])
        assert (acc == out).all(), c
    rows = lane.reshape(8, -1)
    for c in range(1, 256):  # the row forms, with `program`'s shared XORs, for every constant
        want = gf256.mul(lane, c).reshape(8, -1)
        got = gf256.mul_rows(rows.view(np.uint64), c, np.empty_like(rows.view(np.uint64)))
        assert (got.view(np.uint8) == want).all(), c
        acc = rows.copy()
        gf256.mul_xor_rows(acc, rows, c)
        assert (acc == want ^ rows).all(), c
