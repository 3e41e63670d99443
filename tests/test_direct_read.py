"""Local restores read shards directly (format/direct.py): positioned reads, a hardware CRC32C.

The referee is TensorStore: every restore here is compared bit for bit with the same restore
through TensorStore (UCP_DIRECT_READ=0) and with the saved values; the shard locations found by
walking OCDBT's B-tree are compared with what TensorStore's own kvstore reads for each key; and a
damaged shard read this way raises what TensorStore raises, never returns its bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from conftest import assert_tree_bitexact
from helpers import fit_shape, mesh_of, targets

import ucp_jax as ucp
from ucp_jax._src.format import direct, ocdbt_index, scatter_read

pytestmark = pytest.mark.skipif(not direct.available(), reason="no hardware CRC32C here")


def _state(dtype: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    dt = jnp.bfloat16 if dtype == "bf16" else np.dtype(dtype)
    return {
        "big": rng.standard_normal((512, 1024)).astype(dt),  # sharded: inner chunks in shards
        "wide": rng.standard_normal((8, 4096)).astype(dt),
        "odd": rng.standard_normal((12, 40)).astype(dt),  # one chunk per shard
        "vec": rng.standard_normal(64).astype(dt),
        "scalar": np.asarray(rng.standard_normal()).astype(dt),
    }


def _restore(path: Path, state: dict, mesh_shape: tuple[int, ...], style: str, direct_on: bool):
    os.environ["UCP_DIRECT_READ"] = "1" if direct_on else "0"
    try:
        before = direct.counts()
        out, _ = ucp.restore(path, targets(state, mesh_of(mesh_shape), style))
        after = direct.counts()
    finally:
        os.environ.pop("UCP_DIRECT_READ", None)
    return out, {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("scatter", ["1", "0"])  # chunks into scattered rows (C), or buffered
@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
@pytest.mark.parametrize("dtype", ["float32", "bf16", "int8", "bool"])  # 1-byte: a regression
@pytest.mark.parametrize(
    ("saved", "restored", "style"),
    [((2, 4), (2, 4), "spread"), ((2, 4), (4, 2), "spread"), ((8,), (2,), "fsdp"),
     ((1,), (8,), "fsdp"), ((2, 2), (1,), "replicated")],
)  # fmt: skip
def test_direct_reads_equal_tensorstore(
    tmp_path: Path, monkeypatch, scatter: str, layout: str, dtype: str, saved, restored, style: str
) -> None:
    """Same mesh and resharded, every dtype, both layouts, with and without the scattered-row
    reads: the direct read takes every shard and gives TensorStore's bytes."""
    monkeypatch.setenv("UCP_LAYOUT", layout)
    monkeypatch.setenv("UCP_SCATTER_READ", scatter)
    state = _state(dtype)
    placed = jax.tree.map(
        lambda x, t: jax.device_put(x, t.sharding), state, targets(state, mesh_of(saved))
    )
    ucp.save(tmp_path / "ck", placed)
    mine, n = _restore(tmp_path / "ck", state, restored, style, True)
    theirs, m = _restore(tmp_path / "ck", state, restored, style, False)
    assert_tree_bitexact(mine, theirs)
    assert_tree_bitexact(jax.tree.map(np.asarray, mine), state)
    assert n["direct"] > 0 and n["fallback"] == 0, n
    # Where "big" is stored in shards of inner chunks (2- and 4-byte types) and a target shard
    # holds some of their rows apart (all but the row split onto 8), the chunks are read
    # straight into those rows: a regression would fall back to the buffered path unnoticed.
    if scatter == "0":
        assert n["scatter"] == 0, n
    elif scatter_read.built() and dtype in ("float32", "bf16") and restored != (8,):
        assert n["scatter"] > 0, n
    assert m == {"direct": 0, "fallback": 0, "scatter": 0}, m


@pytest.mark.parametrize("scatter", ["1", "0"])  # the C reader, or Python's
@pytest.mark.parametrize(
    ("saved", "restored", "style", "cuts"),
    [((2, 4), (4, 2), "spread", True), ((1,), (8,), "fsdp", True),
     ((8,), (2,), "fsdp", False), ((2, 4), (2, 4), "spread", False)],
)  # fmt: skip
def test_fingerprints_from_the_read_equal_a_fresh_read(
    tmp_path: Path, monkeypatch, scatter: str, saved, restored, style: str, cuts: bool
) -> None:
    """A shard's fingerprint is taken from the index and trailers its read just checked, and
    the trailers of inner chunks it did not read are read for it: equal, shard by shard, to
    `integrity.fingerprint_range` reading the file afresh, whether the shard was read whole or
    in part (a reshard cuts shards), by the C reader or by Python's."""
    from ucp_jax._src.format import integrity

    monkeypatch.setenv("UCP_LAYOUT", "aggregated")
    monkeypatch.setenv("UCP_SCATTER_READ", scatter)
    seen: list[tuple[bool, bool]] = []  # (equal to the fresh read, shard read only in part)
    real = direct._read_sharded

    def spy(fd, ext, lay, origin, box, out, into, want):
        got = real(fd, ext, lay, origin, box, out, into, want)
        if want:
            fresh = integrity.fingerprint_range(fd, ext.offset, ext.length, lay.info)
            part = any(a > o or b < o + c for (a, b), o, c in zip(box, origin, lay.chunks))
            seen.append((got == fresh, part))
        return got

    monkeypatch.setattr(direct, "_read_sharded", spy)
    state = _state("float32")
    placed = jax.tree.map(
        lambda x, t: jax.device_put(x, t.sharding), state, targets(state, mesh_of(saved))
    )
    ucp.save(tmp_path / "ck", placed)
    mine, n = _restore(tmp_path / "ck", state, restored, style, True)
    assert_tree_bitexact(jax.tree.map(np.asarray, mine), state)
    assert n["fallback"] == 0 and seen, (n, seen)
    assert all(equal for equal, _ in seen), seen
    # where the targets cut stored shards, the trailers outside a part were read for it (with
    # fewer devices, as on one GPU, both meshes shrink to one device and nothing is cut)
    cuts = cuts and fit_shape(saved) == tuple(saved) and fit_shape(restored) == tuple(restored)
    assert any(part for _, part in seen) == cuts, seen


def test_transposed_and_fused_atoms(tmp_path: Path) -> None:
    """Atoms stored in another axis order or cut from a fused leaf are read through views."""
    rng = np.random.default_rng(0)
    state = {"w": rng.standard_normal((256, 96), np.float32),
             "qkv": rng.standard_normal((64, 3 * 128), np.float32)}  # fmt: skip
    rules = [("w", ucp.Transposed((1, 0))), ("qkv", ucp.Fused((128, 128, 128), axis=1))]
    ucp.save(tmp_path / "ck", state, rules=rules)
    for mesh in ((1,), (4,), (2, 4)):
        out, n = _restore(tmp_path / "ck", state, mesh, "spread", True)
        assert_tree_bitexact(jax.tree.map(np.asarray, out), state)
        assert n["direct"] > 0 and n["fallback"] == 0, n


def test_ocdbt_walk_finds_what_tensorstore_reads(tmp_path: Path) -> None:
    """A B-tree of several levels (tiny nodes): every key's extent holds the bytes TensorStore's
    kvstore reads for it; an inline value is carried as its bytes, an absent key is None."""
    folder = tmp_path / "db"
    spec = {"driver": "ocdbt", "base": f"file://{folder}/",
            "config": {"max_decoded_node_bytes": 256, "max_inline_value_bytes": 8}}  # fmt: skip
    kv = ts.KvStore.open(spec).result()
    rng = np.random.default_rng(1)
    values = {f"atoms/a{i:03d}/fp32/c/{i % 3}/{i % 5}": rng.bytes(int(rng.integers(9, 300)))
              for i in range(200)}  # fmt: skip
    values["atoms/tiny/c"] = b"1234"  # inline
    txn = ts.Transaction()
    for k, v in values.items():
        kv.with_transaction(txn)[k] = v
    txn.commit_sync()
    height = ts.ocdbt.dump(kv.base).result()["versions"][-1]["root_height"]
    assert height >= 2, height  # the walk descends through interior nodes
    index = ocdbt_index.OcdbtIndex(str(folder))
    wanted = [k.encode() for k in list(values)[::7]] + [b"atoms/tiny/c", b"atoms/none/c/0"]
    index.locate(wanted)
    for key in wanted:
        ext = index.found[key]
        if key == b"atoms/none/c/0":
            assert ext is None
            continue
        assert ext is not None, key
        if key == b"atoms/tiny/c":
            assert ext.inline == b"1234"
            continue
        with open(ext.path, "rb") as f:
            f.seek(ext.offset)
            assert f.read(ext.length) == kv[key.decode()], key


@pytest.mark.parametrize("scatter", ["1", "0"])
@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
@pytest.mark.parametrize("where", ["data", "index", "truncate"])
def test_damage_raises_what_tensorstore_raises(
    tmp_path: Path, monkeypatch, scatter: str, layout: str, where: str
) -> None:
    """A flipped data byte, a flipped shard-index byte, a truncated file: the direct read hands
    the shard to TensorStore, which raises ChecksumError naming the atom; nothing is returned."""
    monkeypatch.setenv("UCP_LAYOUT", layout)
    monkeypatch.setenv("UCP_SCATTER_READ", scatter)
    state = {"big": np.arange(512 * 1024, dtype=np.float32)}
    ucp.save(tmp_path / "ck", state)
    if layout == "aggregated":
        index = ocdbt_index.OcdbtIndex(str(tmp_path / "ck"))
        index.locate([b"atoms/big/fp32/c/0"])
        ext = index.found[b"atoms/big/fp32/c/0"]
        assert ext is not None
        path, offset, length = ext.path, ext.offset, ext.length
    else:
        path = str(tmp_path / "ck" / "atoms" / "big" / "fp32" / "c" / "0")
        offset, length = 0, os.path.getsize(path)
    assert length > 1 << 20  # the whole array in one shard of inner chunks and an index
    with open(path, "r+b") as f:
        if where == "truncate":
            f.truncate(offset + length - 4096)
        else:
            at = offset + (4096 if where == "data" else length - 20)  # the index ends a shard
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x40]))
    before = direct.counts()
    with pytest.raises(ucp.ChecksumError, match="atom 'big'"):
        ucp.restore(tmp_path / "ck", targets(state, mesh_of((1,))))
    after = direct.counts()
    assert after["fallback"] > before["fallback"], (before, after)


def test_disabled_by_environment(tmp_path: Path) -> None:
    """UCP_DIRECT_READ=0 sends every read through TensorStore (the object-store path)."""
    state = {"w": np.ones((64, 64), np.float32)}
    ucp.save(tmp_path / "ck", state)
    _, n = _restore(tmp_path / "ck", state, (2,), "spread", False)
    assert n == {"direct": 0, "fallback": 0, "scatter": 0}


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
def test_tensorstore_opens_only_what_it_reads(tmp_path: Path, monkeypatch, layout: str) -> None:
    """A restore that reads every shard directly opens no array in TensorStore (each slot is
    still checked: listing, zarr.json, fingerprints); a shard handed over to TensorStore opens
    its own array then, and only that one."""
    from ucp_jax._src import checkpoint

    monkeypatch.setenv("UCP_LAYOUT", layout)
    state = {"big": np.arange(512 * 1024, dtype=np.float32), "w": np.ones((64, 64), np.float32)}
    ucp.save(tmp_path / "ck", state)
    opened: list[str] = []
    real = checkpoint.store.open_array_async  # open_array calls it too

    def counting(loc, shape, info, **kw):
        opened.append(info.path)
        return real(loc, shape, info, **kw)

    monkeypatch.setattr(checkpoint.store, "open_array_async", counting)
    out, _ = ucp.restore(tmp_path / "ck", targets(state, mesh_of((2,))))
    assert_tree_bitexact(jax.tree.map(np.asarray, out), state)
    assert opened == []
    monkeypatch.setattr(direct, "read_shard", _refuse_big(direct.read_shard))
    out, _ = ucp.restore(tmp_path / "ck", targets(state, mesh_of((2,))))
    assert_tree_bitexact(jax.tree.map(np.asarray, out), state)
    assert opened == ["atoms/big/fp32"]


def _refuse_big(read_shard):
    """direct.read_shard that hands every shard of a 1-d array to TensorStore."""

    def refusing(ext, lay, *args, **kw):
        if len(lay.shape) == 1:
            raise direct.Mismatch("handed over by the test")
        return read_shard(ext, lay, *args, **kw)

    return refusing
