"""Version-3 saves encode whole shards themselves (format/encode.py) and write them as raw values.

The referee is TensorStore: a checkpoint saved this way must hold, key for key, the very bytes
TensorStore's own zarr3 array write gives (UCP_DIRECT_WRITE=0), and read back bit-exact through
TensorStore's zarr3 driver (UCP_DIRECT_READ=0), through ucp's direct reads, and pass `ucp verify`;
the fingerprints the writer took from the encoder must be those `ucp verify` recomputes from disk.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from conftest import assert_tree_bitexact
from helpers import mesh_of, targets

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli_main
from ucp_jax._src.format import encode, integrity
from ucp_jax._src.format.manifest import SlotInfo

pytestmark = pytest.mark.skipif(not encode.available(), reason="no hardware CRC32C here")


def _state(dtype: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    dt = jnp.bfloat16 if dtype == "bf16" else np.dtype(dtype)
    return {
        "big": rng.standard_normal((1024, 2048)).astype(dt),  # inner chunks in shards
        "wide": rng.standard_normal((8, 4096)).astype(dt),
        "odd": rng.standard_normal((12, 40)).astype(dt),  # one chunk per shard
        "prime": rng.standard_normal((7, 13)).astype(dt),  # nothing divides: one edge shard
        "vec": rng.standard_normal(64).astype(dt),
        "cube": rng.standard_normal((16, 24, 40)).astype(dt),
        "scalar": np.asarray(rng.standard_normal()).astype(dt),
        "empty": np.zeros((0, 8), dt),
    }


def _save(path: Path, state: dict, mesh_shape: tuple[int, ...], style: str, direct: bool,
          monkeypatch) -> int:  # fmt: skip
    """Save `state` placed on a mesh; return how many shards the encoder wrote."""
    placed = jax.tree.map(
        lambda x, t: jax.device_put(x, t.sharding),
        state,
        targets(state, mesh_of(mesh_shape), style),
    )
    with _encoded(monkeypatch, direct) as calls:
        ucp.save(path, placed)
    return len(calls)


@contextlib.contextmanager
def _encoded(monkeypatch, direct: bool) -> Iterator[list[str]]:
    """Within: `UCP_DIRECT_WRITE` on or off, and the array paths of the shards encoded here."""
    monkeypatch.setenv("UCP_DIRECT_WRITE", "1" if direct else "0")
    calls: list[str] = []
    real = encode.encode_shard

    def counting(data: np.ndarray, info: SlotInfo, *rest) -> tuple[bytes | bytearray, str]:
        calls.append(info.path)
        return real(data, info, *rest)

    monkeypatch.setattr(encode, "encode_shard", counting)
    try:
        yield calls
    finally:
        monkeypatch.setattr(encode, "encode_shard", real)
        monkeypatch.delenv("UCP_DIRECT_WRITE")


def _values(path: Path) -> dict[str, bytes]:
    """Every chunk value of a version-3 checkpoint, read through TensorStore's OCDBT kvstore."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
    keys = [k.decode() for k in kv.list().result()]
    chunk = re.compile(r"^atoms/.+/c(/[0-9]+)*$")
    return {k: bytes(kv.read(k).result().value) for k in keys if chunk.match(k)}


def _read_with_tensorstore(path: Path, monkeypatch) -> dict[str, np.ndarray]:
    monkeypatch.setenv("UCP_DIRECT_READ", "0")
    ck = ucp.open(path)
    out = {}
    for name, atom in ck.atoms.items():
        for slot in atom.slots:
            out[name] = np.asarray(ck.array(name, slot).read().result())
    monkeypatch.delenv("UCP_DIRECT_READ")
    return out


@pytest.mark.parametrize("dtype", ["float32", "bf16", "int8", "bool"])
@pytest.mark.parametrize(
    ("mesh_shape", "style"), [((2, 4), "spread"), ((8,), "fsdp"), ((2, 2), "replicated")]
)
def test_raw_shards_are_tensorstores_bytes(
    tmp_path: Path, monkeypatch, dtype: str, mesh_shape, style: str
) -> None:
    """Every dtype, several meshes: each chunk value the encoder wrote is byte for byte the one
    TensorStore's array write stores; TensorStore's zarr3 driver, ucp's direct reads and
    `ucp verify` all read it back exactly."""
    monkeypatch.setenv("UCP_LAYOUT", "aggregated")
    state = _state(dtype)
    if dtype == "bool":
        state = {k: v > 0 for k, v in state.items()}
    n_raw = _save(tmp_path / "raw", state, mesh_shape, style, True, monkeypatch)
    n_ts = _save(tmp_path / "ts", state, mesh_shape, style, False, monkeypatch)
    assert n_raw > 0 and n_ts == 0, (n_raw, n_ts)
    sharded = [s for a in ucp.open(tmp_path / "raw").atoms.values() for s in a.slots.values()
               if s.inner_chunks is not None]  # fmt: skip
    assert sharded, "no array with inner chunks: the case this test is for is missing"
    mine, theirs = _values(tmp_path / "raw"), _values(tmp_path / "ts")
    assert sorted(mine) == sorted(theirs)
    assert n_raw == len(theirs), f"{n_raw} of {len(theirs)} shards encoded: expected every one"
    for k in theirs:
        assert mine[k] == theirs[k], f"{k}: {len(mine[k])} bytes written, TensorStore's differ"
    by_ts = _read_with_tensorstore(tmp_path / "raw", monkeypatch)
    assert_tree_bitexact(by_ts, {k: np.asarray(v) for k, v in state.items()})
    out, _ = ucp.restore(tmp_path / "raw", targets(state, mesh_of(mesh_shape), style))
    assert_tree_bitexact(jax.tree.map(np.asarray, out), state)
    assert cli_main(["verify", str(tmp_path / "raw")]) == 0


def test_partial_shards_fall_back_in_the_same_transaction(tmp_path: Path, monkeypatch) -> None:
    """A region that does not cover whole shards goes through TensorStore's array write, in the
    same transactions as the encoder's raw values; the checkpoint reads back exactly."""
    monkeypatch.setenv("UCP_LAYOUT", "aggregated")
    info = SlotInfo("float32", "a", (4, 8))
    assert encode.covers_whole_shards((8, 8), info, ((4, 8), (0, 8)))
    assert not encode.covers_whole_shards((7, 8), info, ((4, 7), (0, 8)))  # a padded edge shard
    assert not encode.covers_whole_shards((8, 8), info, ((2, 6), (0, 8)))  # not on the grid
    assert not encode.covers_whole_shards((8, 8), SlotInfo("int4", "a", (4, 8)), ((0, 8), (0, 8)))
    assert not encode.covers_whole_shards((8, 8), SlotInfo("float32", "a", (4, 8), (3, 8)),
                                          ((0, 8), (0, 8)))  # fmt: skip
    real = encode.covers_whole_shards
    monkeypatch.setattr(encode, "covers_whole_shards",
                        lambda shape, i, box: "prime" not in i.path and real(shape, i, box))  # fmt: skip
    state = {"prime": np.arange(7 * 13, dtype=np.float32).reshape(7, 13),
             "even": np.arange(64 * 8, dtype=np.float32).reshape(64, 8)}  # fmt: skip
    n = _save(tmp_path / "ck", state, (1,), "replicated", True, monkeypatch)
    assert n == 1, n  # "even" only
    by_ts = _read_with_tensorstore(tmp_path / "ck", monkeypatch)
    assert_tree_bitexact(by_ts, state)
    out, _ = ucp.restore(tmp_path / "ck", targets(state, mesh_of((1,)), "replicated"))
    assert_tree_bitexact(jax.tree.map(np.asarray, out), state)
    assert cli_main(["verify", str(tmp_path / "ck")]) == 0


@pytest.mark.parametrize(
    "dtype", ["float32", "bf16", "int8", "bool", "float16", "int32", "uint16", "float64", "int64"]
)
@pytest.mark.parametrize(
    ("shape", "chunks", "inner"),
    [((), (), None), ((6,), (6,), None), ((8, 12), (8, 12), (2, 12)), ((8, 12), (8, 12), (4, 3)),
     ((4, 6, 10), (4, 6, 10), (2, 3, 5)), ((16, 4), (8, 4), (1, 4))],
)  # fmt: skip
@pytest.mark.parametrize("in_c", [True, False], ids=["c-extension", "numpy-python"])
@pytest.mark.parametrize("layout", ["transposed", "c-order", "inside-larger"])
def test_encode_shard_matches_tensorstore_and_fingerprint(
    tmp_path: Path, monkeypatch, dtype: str, shape, chunks, inner, in_c: bool, layout: str
) -> None:
    """One shard per case, sharded and not; the data a transposed view, C-ordered, or a view
    inside a larger array: the encoder's bytes equal TensorStore's for the same region, and its
    fingerprint equals `integrity.fingerprint_range` over those bytes. Both ways: the inner
    chunks gathered (`gather_chunks`, wherever the last axis is contiguous) and their trailers
    written (`seal_chunks`) by the C extension, or by numpy's copy and the Python loop."""
    from ucp_jax._src.format import scatter_read

    if in_c and not (scatter_read.can_seal() and hasattr(scatter_read._native, "gather_chunks")):
        pytest.skip("the C extension is not built here")
    monkeypatch.setattr(scatter_read, "can_seal", lambda: in_c)
    gathered: list[bool] = []
    real_gather = scatter_read.gather_chunks

    def gather(*args: Any) -> bool:
        gathered.append(in_c and real_gather(*args))
        return gathered[-1]

    monkeypatch.setattr(scatter_read, "gather_chunks", gather)
    from ucp_jax._src.format import store

    rng = np.random.default_rng(1)
    dt = jnp.bfloat16 if dtype == "bf16" else np.dtype(dtype)
    full = rng.standard_normal(tuple(reversed(shape))).astype(dt).T  # a non-C-contiguous view
    if dtype == "bool":
        full = full > 0
    if layout == "c-order":
        full = full.copy(order="C")
    elif layout == "inside-larger" and shape:
        big = np.zeros(tuple(d + 3 for d in shape), full.dtype)
        big[tuple(slice(1, 1 + d) for d in shape)] = full
        full = big[tuple(slice(1, 1 + d) for d in shape)]
    info = SlotInfo(dtype if dtype != "bf16" else "bfloat16", "x/fp32", tuple(chunks),
                    None if inner is None else tuple(inner))  # fmt: skip
    loc = store.Location.parse(str(tmp_path))
    arr = ts.open(store.array_spec(loc, shape, info), create=True, context=loc.ctx).result()
    arr.write(full).result()
    for idx, rel in encode.shards_of(info, tuple((0, d) for d in shape)):
        value, fp = encode.encode_shard(full[rel] if rel else full, info)
        f = tmp_path / "x" / "fp32" / store.chunk_key(idx)
        assert value == f.read_bytes(), idx
        fd = os.open(f, os.O_RDONLY)
        try:
            assert fp == integrity.fingerprint_range(fd, 0, len(value), info)
        finally:
            os.close(fd)
    if in_c and inner is not None and layout != "transposed":
        assert all(gathered) and gathered, "the C gather was not used on a contiguous last axis"


def test_encode_shard_refuses_a_partial_shard() -> None:
    with pytest.raises(ValueError, match="expected one whole shard of shape"):
        encode.encode_shard(np.zeros((3, 4), np.float32), SlotInfo("float32", "a", (4, 4)))


def test_a_data_file_is_synced_once_and_again_when_it_grew(tmp_path: Path, monkeypatch) -> None:
    """A save starts making each data file durable as transactions land: a file once, then again
    only if a commit still writing it made it grow, not every file at every commit."""
    from ucp_jax._src.format.durable import sync_landed

    class Syncs:
        def __init__(self):
            self.asked: list[str] = []

        def start(self, path):
            self.asked.append(os.path.basename(path))

    syncs = Syncs()
    asked = syncs.asked
    d = tmp_path / "ocdbt.p0" / "d"
    d.mkdir(parents=True)
    (d / "a").write_bytes(b"x" * 10)
    requested: dict[str, int] = {}
    sync_landed(syncs, str(tmp_path), 0, requested)
    assert asked == ["a"]
    (d / "b").write_bytes(b"y")
    sync_landed(syncs, str(tmp_path), 0, requested)
    assert asked == ["a", "b"]
    with open(d / "b", "ab") as f:
        f.write(b"more")
    sync_landed(syncs, str(tmp_path), 0, requested)
    assert asked == ["a", "b", "b"]
    sync_landed(syncs, str(tmp_path), 0, requested)
    assert asked == ["a", "b", "b"]
    sync_landed(syncs, None, 0, requested)  # not a local save: nothing to ask
    sync_landed(syncs, str(tmp_path / "gone"), 0, requested)  # no data files yet
    assert asked == ["a", "b", "b"]


def _sixteen_transactions() -> dict[str, np.ndarray]:
    """64 MiB in 8 leaves: a save of it commits 16 transactions of 4 MiB (`transaction_bytes`)."""
    rng = np.random.default_rng(5)
    return {f"w{i}": rng.standard_normal((1024, 2048), np.float32) for i in range(8)}


def test_a_save_makes_data_files_durable_while_it_writes(tmp_path: Path, monkeypatch) -> None:
    """Data files are fdatasynced as their transactions land, before the save's last write, not
    all in the fsync pass before COMMIT (the disk cache's flush then overlaps the writing), and the
    checkpoint restores bit-exact; `UCP_EARLY_SYNC=0` leaves them all to that pass."""
    from ucp_jax._src import save as save_mod
    from ucp_jax._src.format import durable

    events: list[str] = []
    datasync, tree = durable._datasync, save_mod.sync_tree

    def recorded_datasync(path):
        events.append("datasync")
        datasync(path)

    def recorded_tree(root, **kw):
        events.append("sync_tree")
        return tree(root, **kw)

    monkeypatch.setattr(durable, "_datasync", recorded_datasync)
    monkeypatch.setattr(save_mod, "sync_tree", recorded_tree)
    state = _sixteen_transactions()
    ucp.save(tmp_path / "early", state)
    assert events[-1] == "sync_tree" and events.count("sync_tree") == 1
    assert events.count("datasync") >= 8, events  # (16 transactions in a few data files)
    got = ucp.open(tmp_path / "early")
    for k, v in state.items():
        np.testing.assert_array_equal(got.read(k), v)
    events.clear()
    monkeypatch.setenv("UCP_EARLY_SYNC", "0")
    ucp.save(tmp_path / "late", state)
    assert events == ["sync_tree"]


def test_an_early_sync_error_fails_the_save(tmp_path: Path, monkeypatch) -> None:
    """A write error reported to an early fdatasync (EIO: the disk lost the data) fails the save,
    naming the error, and nothing is committed: Linux reports it to that one fsync, not again to
    the pass before COMMIT, so swallowing it would commit a checkpoint with lost data."""
    import errno

    from ucp_jax._src.format import durable

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(durable.os, "fdatasync", failing)
    with pytest.raises(OSError, match=r"making .*ocdbt\.p0/d/\S+ durable \(fdatasync\): Input/"):
        ucp.save(tmp_path / "ck", _sixteen_transactions())
    assert ucp.list_checkpoints(tmp_path) == []


def test_an_error_of_the_settling_wait_is_raised(tmp_path: Path, monkeypatch) -> None:
    """settle_file (imports: wait for a file's writeback, then drop its pages) raises the error
    the wait reports (fdatasync, or sync_file_range with UCP_EARLY_SYNC=0), naming the file,
    where it was ignored."""
    import ctypes
    import errno

    from ucp_jax._src.format import durable

    def failing(fd, offset, nbytes, flags):
        ctypes.set_errno(errno.EIO)
        return -1

    def failing_datasync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(durable, "_libc_sync_file_range", lambda: failing)
    monkeypatch.setattr(durable.os, "fdatasync", failing_datasync)
    path = tmp_path / "data"
    path.write_bytes(b"x" * 4096)
    with pytest.raises(OSError, match=r"making .*data durable \(fdatasync\): Input/output error"):
        durable.settle_file(str(path))
    monkeypatch.setenv("UCP_EARLY_SYNC", "0")
    with pytest.raises(OSError, match=r"writing back .*data: Input/output error"):
        durable.settle_file(str(path))
    durable.start_writeback(str(path))  # (asking to start, best effort: no error)


def test_an_import_whose_data_the_disk_lost_fails(tmp_path: Path, monkeypatch) -> None:
    """An importer settles its data files on a background thread (writeback waited for, pages
    dropped); a write error that wait reports (EIO) fails the import, naming the file, and
    nothing is committed. It was swallowed with the file's size check, and the final fsync pass
    is not told again: the import committed a checkpoint whose data the disk had lost."""
    import errno

    from ucp_jax._src.format import durable
    from ucp_jax._src.frameworks.common.writer import AtomWriter

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(durable.os, "fdatasync", failing)
    a = np.random.default_rng(3).standard_normal((2048, 2048), np.float32)  # 16 MiB
    with (
        pytest.raises(OSError, match=r"making .*ocdbt\.p0/d/\S+ durable \(fdatasync\): Input/"),
        AtomWriter(tmp_path / "ck", layout="aggregated", max_inflight_bytes=4 << 20) as w,
    ):
        w.atom("a", a.shape)
        for r in range(0, 2048, 256):
            w.write("a", "fp32", ((r, r + 256), (0, 2048)), a[r : r + 256].copy())
        w.commit(step=1, source={"framework": "test"})
    assert ucp.list_checkpoints(tmp_path) == []


def _import(dst: Path, arrays: dict[str, np.ndarray], direct: bool, monkeypatch, *,
            box_rows: int, budget: int = 256 << 10) -> int:  # fmt: skip
    """Import `arrays` with AtomWriter (version 3) in boxes of `box_rows` rows; return how many
    shards the sink encoded itself."""
    from ucp_jax._src.frameworks.common import writer
    from ucp_jax._src.frameworks.common.writer import AtomWriter

    monkeypatch.setattr(writer, "IMPORT_SHARD_BYTES", 128 << 10)
    with (
        _encoded(monkeypatch, direct) as calls,
        AtomWriter(
            dst, layout="aggregated", max_inflight_bytes=budget, encode_whole_shards=True
        ) as w,
    ):
        for name, a in arrays.items():
            w.atom(name, a.shape)
            rows = box_rows if a.ndim > 1 else a.shape[0]  # a vector in one go
            for r in range(0, a.shape[0], rows):
                box = ((r, min(r + rows, a.shape[0])), *((0, d) for d in a.shape[1:]))
                w.write(name, "fp32", box, a[r : r + rows].copy())
        w.commit(step=1, source={"framework": "test"})
    return len(calls)


@pytest.mark.parametrize("dtype", ["float32", "bf16", "int8"])
def test_imports_encode_whole_shards_as_tensorstore_does(
    tmp_path: Path, monkeypatch, dtype: str
) -> None:
    """An import's whole shards are encoded by its sink: key for key TensorStore's bytes, nothing
    read back for the fingerprint table (the encoder's own), and `ucp verify`, TensorStore's
    zarr3 driver and ucp's reads all agree. Rows that end in a padded edge shard, and boxes
    that cut shards, go through TensorStore's array write."""
    from ucp_jax._src.frameworks.common import sink_aggregated

    rng = np.random.default_rng(4)
    dt = jnp.bfloat16 if dtype == "bf16" else np.dtype(dtype)
    arrays = {
        "big": rng.standard_normal((64, 4096)).astype(dt),  # shards of rows, inner chunks
        "edge": rng.standard_normal((37, 2048)).astype(dt),  # a padded edge shard
        "vec": rng.standard_normal(300).astype(dt),  # one shard, no inner chunks
    }
    read_back: list[str] = []
    real = integrity.fingerprints_many

    def counting(kv, items):
        read_back.extend(k for _, keys in items for k in keys)
        return real(kv, items)

    monkeypatch.setattr(sink_aggregated.integrity, "fingerprints_many", counting)
    n_raw = _import(tmp_path / "raw", arrays, True, monkeypatch, box_rows=32)
    assert n_raw > 0 and read_back and all(k.startswith("atoms/edge/") for k in read_back), (
        read_back
    )
    assert _import(tmp_path / "ts", arrays, False, monkeypatch, box_rows=32) == 0
    sharded = [s for a in ucp.open(tmp_path / "raw").atoms.values() for s in a.slots.values()
               if s.inner_chunks is not None]  # fmt: skip
    assert sharded, "no array with inner chunks: the case this test is for is missing"
    mine, theirs = _values(tmp_path / "raw"), _values(tmp_path / "ts")
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert mine[k] == theirs[k], f"{k}: {len(mine[k])} bytes written, TensorStore's differ"
    by_ts = _read_with_tensorstore(tmp_path / "raw", monkeypatch)
    assert_tree_bitexact(by_ts, {k: np.asarray(v) for k, v in arrays.items()})
    assert cli_main(["verify", str(tmp_path / "raw")]) == 0


@pytest.mark.parametrize("budget", [4096, 4 << 20], ids=["many-transactions", "one-transaction"])
def test_import_raw_and_array_writes_of_one_shard_keep_the_last(
    tmp_path: Path, monkeypatch, budget: int
) -> None:
    """Shards written whole (encoded by the sink) and in part (TensorStore's array write), in
    turns, in one transaction or across several: the last write of every element wins, and the
    fingerprints are those of what landed (`ucp verify`). A source released by
    `release_sources` is no longer read."""
    from ucp_jax._src.frameworks.common import writer
    from ucp_jax._src.frameworks.common.writer import AtomWriter

    monkeypatch.setattr(writer, "IMPORT_SHARD_BYTES", 4096)  # shards of 4 rows of 256 f32
    rng = np.random.default_rng(6)
    want = np.zeros((16, 256), np.float32)
    dst = tmp_path / "ck"
    with AtomWriter(dst, layout="aggregated", max_inflight_bytes=budget,
                    encode_whole_shards=True) as w:  # fmt: skip
        w.atom("x", want.shape)
        assert w._sink._encodes

        def put(r0: int, r1: int, c0: int = 0, c1: int = 256) -> None:
            data = rng.standard_normal((r1 - r0, c1 - c0)).astype(np.float32)
            want[r0:r1, c0:c1] = data
            w.write("x", "fp32", ((r0, r1), (c0, c1)), data)

        put(0, 16)  # whole shards 0-3
        put(1, 3)  # part of shard 0
        put(0, 4)  # shard 0 whole again
        put(2, 3, 5, 100)  # and in part again
        put(4, 8, 10, 20)  # part of shard 1
        put(4, 8)  # shard 1 whole
        put(8, 16, 3, 200)  # parts of shards 2 and 3
        put(12, 16)  # shard 3 whole
        put(13, 14, 0, 9)  # and in part
        put(8, 12)  # shard 2 whole
        src = rng.standard_normal((4, 256)).astype(np.float32)
        want[12:16] = src
        w.write("x", "fp32", ((12, 16), (0, 256)), src)
        w.release_sources()
        src[:] = -1  # a released source is no longer read
        w.commit(step=1, source={"framework": "test"})
    ck = ucp.open(dst)
    assert np.asarray(ck.read("x", "fp32")).tobytes() == want.tobytes()
    assert_tree_bitexact(_read_with_tensorstore(dst, monkeypatch), {"x": want})
    assert cli_main(["verify", str(dst)]) == 0
