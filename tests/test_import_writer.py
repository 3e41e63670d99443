"""AtomWriter, the writer of every importer: format version 3 by default, version 2 on request.

Version 3 writes in transactions that commit once their shards are whole; a shard left open
(a budget smaller than a shard, fragments in any order) is rewritten by a later transaction, which
must start from what the earlier one wrote. Either way `ucp.open`, `ucp verify` and the fingerprint
checks read the result like a save.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli_main
from ucp_jax._src.frameworks.common.writer import AtomWriter


def _write(dst, a: np.ndarray, b: np.ndarray, *, budget: int, order: list[int], step: int) -> str:
    flat = a.reshape(-1)
    with AtomWriter(dst, max_inflight_bytes=budget) as w:
        w.atom("a", a.shape)
        w.atom("b", b.shape)
        for s in order:  # flat fragments of `a`, in any order
            w.write_flat("a", "fp32", flat[s : s + step], s)
        w.write("b", "fp32", ((0, b.shape[0]), (0, b.shape[1])), b)
        w.write_scalar("b", "step", 7)
        w.flush()  # landed: readable through the writer's array
        got = w.array("b", "fp32", b.dtype).read().result()
        assert np.asarray(got).tobytes() == b.tobytes()
        return w.commit(step=3, source={"framework": "test"})


@pytest.mark.parametrize("budget", [4096, 64 << 20], ids=["shards-rewritten", "shards-whole"])
@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
def test_writer_layouts_and_open_shards(tmp_path, monkeypatch, budget, layout):
    monkeypatch.setenv("UCP_LAYOUT", layout)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((96, 1000)).astype(np.float32)
    b = rng.standard_normal((5, 3)).astype(np.float32)
    step = 7919  # fragments that straddle rows and shards
    order = list(range(0, a.size, step))
    rng.shuffle(order)
    dst = tmp_path / "ck"
    _write(dst, a, b, budget=budget, order=order, step=step)
    ck = ucp.open(dst)
    assert ck.manifest.version == (3 if layout == "aggregated" else 2)
    assert (dst / "ocdbt.p0").is_dir() == (layout == "aggregated")
    assert (dst / "atoms").is_dir() == (layout == "per-array")
    assert np.asarray(ck.read("a", "fp32")).tobytes() == a.tobytes()
    assert np.asarray(ck.read("b", "fp32")).tobytes() == b.tobytes()
    assert int(np.asarray(ck.read("b", "step"))) == 7
    assert cli_main(["verify", str(dst)]) == 0


def test_aggregated_import_is_a_handful_of_files(tmp_path):
    """Many atoms, one database: a few data files, not one per chunk."""
    rng = np.random.default_rng(1)
    dst = tmp_path / "ck"
    with AtomWriter(dst, layout="aggregated") as w:
        for i in range(64):
            x = rng.standard_normal((32, 32)).astype(np.float32)
            w.atom(f"l{i}", x.shape)
            w.write(f"l{i}", "fp32", ((0, 32), (0, 32)), x)
        w.commit(step=None, source={"framework": "test"})
    files = [f for _, _, fs in os.walk(dst) for f in fs]
    # 7-8 files on a quiet machine; under load TensorStore spreads commits and their B-tree
    # nodes over more data files (17 seen once in the full suite). One per chunk would be 128+.
    assert len(files) <= 24, files
    assert cli_main(["verify", str(dst)]) == 0


def test_failed_aggregated_import_leaves_nothing(tmp_path):
    dst = tmp_path / "ck"
    with pytest.raises(RuntimeError, match="boom"), AtomWriter(dst, layout="aggregated") as w:
        w.atom("a", (4, 4))
        w.write("a", "fp32", ((0, 4), (0, 4)), np.ones((4, 4), np.float32))
        raise RuntimeError("boom")
    assert not dst.exists() and not (tmp_path / ".ck.ucp-tmp").exists()


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
def test_a_large_box_reaches_the_sink_shard_by_shard(tmp_path, monkeypatch, layout):
    """A box larger than a shard is handed to the sink in pieces of at most a shard, cut on every
    axis (here shards of one row's quarter); with a budget of one shard the aggregated sink lets
    one transaction land at a time (what it holds stays within the budget, not 3 shards)."""
    from ucp_jax._src.frameworks.common import writer

    shard = 4096
    monkeypatch.setattr(writer, "IMPORT_SHARD_BYTES", shard)
    a = np.random.default_rng(2).standard_normal((8, 4096)).astype(np.float32)  # 128 KiB
    held: list[int] = []
    pieces: list[int] = []
    with AtomWriter(tmp_path / "ck", layout=layout, max_inflight_bytes=shard) as w:
        w.atom("a", a.shape)
        sink_write = w._sink.write

        def write(info, box, data, keep):
            pieces.append(data.nbytes)
            sink_write(info, box, data, keep)
            if layout == "aggregated":  # bytes the open and the landing transactions hold
                held.append(w._sink._landing + w._sink._staged)

        monkeypatch.setattr(w._sink, "write", write)
        w.write("a", "fp32", ((0, 8), (0, 4096)), a)
        assert w.atoms["a"]["slots"]["fp32"].chunks == (1, 1024)
        w.commit(step=None, source={"framework": "test"})
    assert len(pieces) == 32 and max(pieces) == shard, pieces
    if layout == "aggregated":
        assert max(held) <= shard, held
    assert np.asarray(ucp.open(tmp_path / "ck").read("a", "fp32")).tobytes() == a.tobytes()
    assert cli_main(["verify", str(tmp_path / "ck")]) == 0


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
def test_a_slot_left_partly_unwritten_is_never_committed(tmp_path, layout) -> None:
    """An importer that declares a slot and writes only part of it (a source file it skipped)
    fails at commit, naming the atom and the count: zeros are never committed as values."""
    with (
        pytest.raises(ucp.MismatchError, match=r"'frozen.w' slot 'fp32' was written for 8 of"),
        AtomWriter(tmp_path / "ck", layout=layout) as w,
    ):
        w.atom("ok", (4, 4))
        w.write("ok", "fp32", ((0, 4), (0, 4)), np.ones((4, 4), np.float32))
        w.atom("frozen.w", (4, 4))
        w.write("frozen.w", "fp32", ((0, 2), (0, 4)), np.ones((2, 4), np.float32))
        w.commit(step=1, source={"framework": "test"})
    assert not (tmp_path / "ck").exists()
