"""A real multi-process job: 2 processes x 4 CPU devices save on a (2, 4) mesh and restore elsewhere.

The workers (tests/mp/worker.py) save params + adamw state with `ucp.save` and `ucp.async_save`,
restore both onto (4, 2) and (8, 1) meshes in the same job and check their own shards bit for bit.
Here, in one process with 8 devices, the checkpoints they wrote restore bit-exact onto (2, 2, 2),
and their write records show each process wrote only regions its devices hold, each region once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import mesh_of
from mp import state
from mp.runner import run_job

import ucp_jax as ucp

WORKER = Path(__file__).parent / "mp" / "worker.py"
TIMEOUT_S = 240


def _run_job(root: Path) -> list[dict]:
    """Run the 2 workers to completion; fail with both processes' output otherwise."""
    run_job(lambda i, addr: [str(WORKER), str(i), addr, str(root)], 2, TIMEOUT_S)
    return [json.loads((root / f"report_{i}.json").read_text()) for i in range(2)]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("mp")
    return root, _run_job(root)


def test_workers_restore_on_other_meshes(job):
    _, reports = job
    # Each process checked every shard it holds of params and opt_state, 2 ckpts x 2 meshes.
    for r in reports:
        assert r["shards_checked"] > 0
    assert reports[0]["shards_checked"] == reports[1]["shards_checked"]


@pytest.mark.parametrize("name", ["sync", "async"])
def test_restore_in_one_process_on_2x2x2(job, name):
    root, _ = job
    ref_params, ref_opt = state.reference_state()
    ck = ucp.open(root / name)
    assert ck.step == {"sync": 7, "async": 8}[name]
    assert ck.manifest.source["process_count"] == 2
    assert ck.manifest.source["device_count"] == 8
    assert {"dense.kernel", "dense.bias", "emb.embedding", "layers.w", "head", "scale"} <= set(
        ck.atoms
    )
    assert {"fp32", "exp_avg", "exp_avg_sq"} <= set(ck.atoms["head"].slots)
    mesh = mesh_of((2, 2, 2))
    pt, ot = state.targets_on(ref_params, mesh), state.targets_on(ref_opt, mesh)
    params, opt_state = ucp.restore(root / name, pt, ot)
    n = state.check_shards(params, ref_params, pt, "params")
    n += state.check_shards(opt_state, ref_opt, ot, "opt_state")
    assert n > 0
    # The moments are non-trivial, so a mix-up of slots would show.
    assert ck.read("dense.kernel", "exp_avg").any()
    assert ck.read("dense.kernel", "exp_avg_sq").any()


def _overlap(a: list[list[int]], b: list[list[int]]) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


def _covered(a: list[list[int]], owned: list[list[list[int]]]) -> bool:
    """Whether box `a` lies within the union of the (grid, so disjoint) boxes `owned`: a write may
    merge several of a process's shards into one box, never reach outside them."""
    distinct = {tuple(map(tuple, o)) for o in owned}
    inter = sum(
        math.prod(max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(a, o))
        for o in distinct
    )
    return inter == math.prod(a1 - a0 for a0, a1 in a)


@pytest.mark.parametrize("name", ["sync", "async"])
def test_each_process_wrote_only_its_own_shards(job, name):
    root, reports = job
    ck = ucp.open(root / name)
    arrays = {s.path: tuple(a.shape) for a in ck.atoms.values() for s in a.slots.values()}
    recs = [r["checkpoints"][name] for r in reports]
    assert set().union(*(r["written"] for r in recs)) == set(arrays), "arrays written != manifest"
    wrote_bytes = [0, 0]
    for path, shape in arrays.items():
        pieces = []
        for pid, rec in enumerate(recs):
            owned = rec["owned"][path]
            for box in rec["written"].get(path, []):
                assert _covered(box, owned), (
                    f"process {pid} wrote {box} of {path} but holds only {owned}"
                )
                pieces.append((pid, box))
                wrote_bytes[pid] += math.prod(b - a for a, b in box)
        for i, (pa, a) in enumerate(pieces):
            for pb, b in pieces[i + 1 :]:
                assert not _overlap(a, b), f"{path}: {a} (process {pa}) and {b} ({pb}) overlap"
        volume = sum(math.prod(b - a for a, b in box) for _, box in pieces)
        assert volume == math.prod(shape), f"{path}: writes cover {volume} of {math.prod(shape)}"
    # Arrays sharded over mesh axis 'a' are split between the processes: both did real work.
    assert all(wrote_bytes), wrote_bytes
    for slot in ("fp32", "exp_avg", "exp_avg_sq"):
        path = ck.atoms["dense.kernel"].slots[slot].path
        rows = [sorted({box[0][0] for box in rec["written"][path]}) for rec in recs]
        assert rows == [[0], [8]], f"{path}: process row offsets {rows}"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_failing_on_one_process_stops_the_others_at_once(tmp_path, mode):
    """Process 1's writes fail (a full disk): process 1 raises its StorageFullError, process 0 stops at
    its next barrier with AnotherProcessFailedError naming process 1 and the error (it waited
    out the barrier timeout, 30 minutes by default, and then raised JAX's DEADLINE_EXCEEDED);
    nothing is committed. The workers' barrier timeout is 120 s: a few seconds means no wait."""
    worker = Path(__file__).parent / "mp" / "fail_worker.py"
    outs = run_job(lambda i, addr: [str(worker), str(i), addr, str(tmp_path), mode], 2, 200)
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert got[1]["error"] == "StorageFullError" and "injected on process 1" in got[1]["message"]
    # several processes wrote the partial files: the next save removes them (it said removed)
    assert "stay until the next save to this path removes them" in got[1]["message"], got[1]
    assert got[0]["error"] == "AnotherProcessFailedError", got[0]
    assert "process 1 failed" in got[0]["message"] and "StorageFullError" in got[0]["message"]
    assert max(g["seconds"] for g in got) < 60, got
    assert ucp.list_checkpoints(tmp_path) == []


@pytest.mark.parametrize(
    ("mode", "differs"),
    [("path", "path"), ("step", "step"), ("leaves", "leaves"), ("values", "values of host")],
)
def test_processes_saving_different_things_are_told_so(tmp_path, mode, differs):
    """Process 1 saves to another path (it waited at its own barriers until the timeout), another
    step, an extra leaf or another value of a numpy leaf (all three were committed silently,
    with process 0's): process 1 raises an ArgumentError naming what differs, process 0 stops
    at its next barrier; nothing is committed."""
    worker = Path(__file__).parent / "mp" / "fail_worker.py"
    outs = run_job(lambda i, addr: [str(worker), str(i), addr, str(tmp_path), mode], 2, 200)
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert got[1]["error"] == "ArgumentError", got[1]
    assert f"make different calls: {differs}" in got[1]["message"], got[1]
    assert got[0]["error"] == "AnotherProcessFailedError", got[0]
    assert max(g["seconds"] for g in got) < 60, got
    assert ucp.list_checkpoints(tmp_path) == []


def test_a_barrier_timeout_says_what_it_means(tmp_path):
    """Process 1 never calls save: process 0's barrier times out (2 s here) with an
    AnotherProcessFailedError saying a process died, hangs or did not make the call (it was
    JAX's raw DEADLINE_EXCEEDED)."""
    worker = Path(__file__).parent / "mp" / "fail_worker.py"
    outs = run_job(lambda i, addr: [str(worker), str(i), addr, str(tmp_path), "absent"], 2, 200)
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert got["error"] == "AnotherProcessFailedError", got
    assert "not every process reached the barrier" in got["message"], got
    assert "did not make this call" in got["message"] and "(2 s)" in got["message"]
    assert got["seconds"] < 5, got  # one timeout: no wait at the barriers left (3 x 2 s)
    assert ucp.list_checkpoints(tmp_path) == []
