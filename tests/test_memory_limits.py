"""Bounded memory: a restore and the converters under an address-space limit (RLIMIT_AS, in a
subprocess) of their baseline plus 1.5x the largest array (256 MiB) succeed, streaming; below what
they need they fail with a clear error (`HostMemoryError`, a UcpError), never a crash or an OOM
kill (past the limit a buffer TensorStore cannot allocate aborts the process: the readers and
writers check before they start).

The import maps its source file whole (np.memmap), which RLIMIT_AS counts in full: it runs with
UCP_IMPORT_INFLIGHT_BYTES=16 MiB here; with the default 64 MiB it needs about 1.75x (and is
refused clearly at 1.5x).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mp.runner import worker_env

import ucp_jax as ucp

WORKER = Path(__file__).parent / "mp" / "memlimit_worker.py"
LARGEST = 256 << 20  # bytes of the largest array: it dominates what the process holds


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    work = tmp_path_factory.mktemp("memlimit")
    big = {"w": np.ones((LARGEST // 4 // 4096, 4096), np.float32), "b": np.ones(64, np.float32)}
    small = {"w": np.ones((256, 4096), np.float32), "b": np.ones(64, np.float32)}
    for tag, tree in (("", big), ("small", small)):
        ucp.save(work / f"{tag}ck", tree)
        safetensors_numpy.save_file(tree, work / f"{tag}m.safetensors")
    return work


def _run(op: str, work: Path, frac: float) -> dict:
    argv = [sys.executable, str(WORKER), op, str(work), str(LARGEST), str(frac)]
    p = subprocess.run(["sh", "-c", 'ulimit -s 1024 && exec "$@"', "sh", *argv],
                       env=worker_env(2, MALLOC_ARENA_MAX="2", UCP_IMPORT_INFLIGHT_BYTES=str(16 << 20)),
                       capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, f"{op} at {frac}x ended with {p.returncode}:\n{p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("op", ["restore", "import", "export"])
def test_streams_within_one_and_a_half_times_the_largest_array(work: Path, op: str) -> None:
    out = _run(op, work, 1.5)
    assert out["ok"], out


@pytest.mark.parametrize(("op", "frac"), [("restore", 0.5), ("import", 0.5), ("export", 0.01)])
def test_below_what_is_needed_a_clear_error(work: Path, op: str, frac: float) -> None:
    """Below what each needs (the export streams in blocks: it needs far less than the array)."""
    out = _run(op, work, frac)
    assert not out["ok"] and out["error"] == "HostMemoryError", out
    assert "address-space limit" in out["message"] or "address space" in out["message"], out
    print(f"\n{op} at {frac}x: {out['message'][:240]}")


@pytest.mark.parametrize("rule", [None, "transposed"])
def test_block_reads_are_bit_exact(tmp_path: Path, rule: str | None, monkeypatch) -> None:
    """Through TensorStore (object stores; local folders read directly, tests/test_direct_read.py),
    a piece larger than READ_BLOCK is read in row blocks (a last partial one too), straight
    into the restored array, through a transposing view as well."""
    monkeypatch.setenv("UCP_DIRECT_READ", "0")
    from conftest import assert_tree_bitexact
    from helpers import mesh_of, targets

    from ucp_jax._src import restore as restore_mod

    rng = np.random.default_rng(5)
    tree = {"w": rng.standard_normal((2300, 4100), dtype=np.float32)}  # 36 MiB: 3 uneven blocks
    rules = [("w", ucp.Transposed((1, 0)))] if rule else []
    ucp.save(tmp_path / "ck", tree, rules=rules)
    blocks: list[int] = []
    real = restore_mod._AllOf
    monkeypatch.setattr(restore_mod, "_AllOf", lambda fs: blocks.append(len(fs)) or real(fs))
    for mesh in ((1,), (2,)):  # transposed: the atom is stored (4100, 2300), read through .T
        out, _ = ucp.restore(tmp_path / "ck", targets(tree, mesh_of(mesh)))
        assert_tree_bitexact(tree, out)
    assert blocks and max(blocks) >= 3, blocks  # read in blocks, a partial last one included
