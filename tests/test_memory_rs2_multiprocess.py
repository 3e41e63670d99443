"""rs2 across real jax.distributed jobs (localhost, gloo, CPU devices): two processes of a group
killed at once.

A 4-process x 2-device job (one rs2 group of 4: P and Q per stripe) trains 3 steps with a
snapshot per step (device-side copies, the accelerators' path; each process's data-loader state
as `extra`) and a universal checkpoint every 2; processes 1 and 2 are SIGKILLed at once and the
job dies. Then:

- one process (1 x 8 devices, a smaller mesh) restores copies of the job's shared memory that
  lack every pair of nodes in turn: step 3, rebuilt bit-exact (its own extra too when node 0 is
  lost); with a stale Q parity (the previous step's, committed so) and the two data nodes of its
  stripe lost, the rebuild is detected as wrong and it restores step 2 instead; the same bytes
  written after the commit fail the blob's CRC-32 before anything is decoded (step 2 again); with three nodes lost it
  falls back to the persisted step 2 and says which nodes are lost;
- with the shared memory of nodes 1 and 2 wiped, a 4 x 2 job (the same mesh) resumes step 3
  bit-exact from P and Q, every process with its own extra, and trains on with the same bits;
  a 2 x 4 job (a smaller mesh) does the same. The processes share the rebuild (each solves a
  share of the stripes' columns, all check the whole); with a peer that writes a wrong byte into
  its share, or one that never says it is done, the others rebuild alone, still bit-exact.

On a cluster (each process's shared memory on its own "machine"), two replaced machines get the
bytes that rebuild their nodes from the other two.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest
from mp.runner import run_job
from test_memory_multiprocess import Job, _check, _resume, _scenario, _shm

WORKER = Path(__file__).parent / "mp" / "rs2_worker.py"
PAIRS = list(itertools.combinations(range(4), 2))


@pytest.fixture(scope="module")
def rs2(tmp_path_factory):
    out: dict = {}
    with _scenario(tmp_path_factory, "rs2") as (root, ns, base):
        job = Job(root, "train", 4, 2, mode="train", steps=3, persist_every=2, redundancy="rs2",
                  device_copies=True, **base)  # fmt: skip
        job.wait_for("SNAPSHOTS DONE")
        out["train"] = job.reports()
        for victim in (1, 2):  # two processes of the group die at once
            os.kill(job.procs[victim].pid, signal.SIGKILL)
        for victim in (1, 2):
            job.procs[victim].wait()
        time.sleep(0.5)
        job.kill_all()
        assert [job.procs[v].returncode for v in (1, 2)] == [-signal.SIGKILL] * 2

        cases = {f"lost{a}{b}": {"lost": [a, b]} for a, b in PAIRS}
        cases["stale"] = {"lost": [2, 3], "stale": "committed"}
        cases["damaged"] = {"lost": [2, 3], "stale": "after"}
        cases["three"] = {"lost": [1, 2, 3]}
        cfg = dict(base, cases=cases, report=str(root / "cases.json"))
        ((_, err),) = run_job(lambda i, addr: [str(WORKER), json.dumps(cfg)], 1, 300, devices=8)
        out["cases"], out["cases_log"] = json.loads((root / "cases.json").read_text()), err

        shutil.rmtree(_shm(ns) / "1")  # the killed nodes' memory is gone too
        shutil.rmtree(_shm(ns) / "2")
        _resume(root, out, "same_mesh", 4, 2, **base, **{"continue": True})
        _resume(root, out, "smaller_mesh", 2, 4, **base)
        # a faulty peer of the rebuild the four processes share: wrong bytes, or never done
        _resume(root, out, "share_wrong", 4, 2, **base, share_fault={"pid": 1, "kind": "wrong"})
        _resume(root, out, "share_silent", 4, 2, **base, share_timeout=5,
                share_fault={"pid": 2, "kind": "silent"})  # fmt: skip
    return out


def _case(out, name, step, source, lost):
    r = dict(out["cases"][name], pid=0)
    _check([r], out["train"], step, source)
    assert r["lost"] == lost, r
    return r


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_every_pair_of_lost_nodes_is_rebuilt_on_a_smaller_mesh(rs2, a, b):
    _case(rs2, f"lost{a}{b}", 3, "redundancy", [a, b])


def test_a_stale_parity_is_detected_and_an_older_step_restored(rs2):
    _case(rs2, "stale", 2, "redundancy", [2, 3])
    log = rs2["cases_log"]
    assert "step 3 is not restorable from shared memory" in log
    assert "does not match the digest" in log and "stale or damaged" in log


def test_a_parity_damaged_after_its_commit_fails_its_crc_and_an_older_step_is_restored(rs2):
    # the same bytes written after the commit: the blob's CRC-32 no longer matches, so the node
    # keeping that parity counts as lost too (three of the group: step 3 is not decodable)
    _case(rs2, "damaged", 2, "redundancy", [2, 3])
    assert "fail their CRC-32 check" in rs2["cases_log"]


def test_three_lost_nodes_fall_back_to_the_persisted_checkpoint_naming_them(rs2):
    r = _case(rs2, "three", 2, "persisted", [])
    assert "node(s) [1, 2, 3] lost in group [0, 1, 2, 3] (rs2 rebuilds any 2" in r["reason"]
    assert "falling back to the persisted universal checkpoint" in rs2["cases_log"]


def test_two_killed_processes_resume_on_the_same_mesh(rs2):
    reports = rs2["same_mesh"]
    # every process gets its own extra back (rebuilt from P and Q for processes 1 and 2), and
    # the next training step gives the same bits as in the killed job
    _check(reports, rs2["train"], 3, "redundancy")
    assert all(r["lost"] == [1, 2] for r in reports)
    assert all("next_digest" in r for r in reports)
    assert "node(s) [1, 2] decoded from rs2" in rs2["same_mesh_log"]


def test_processes_of_a_machine_share_the_rebuild_of_the_lost_nodes(rs2):
    """The four processes all read nodes 1 and 2: each solved its share of the columns of the
    stripes, and all read the lanes the others rebuilt (checked: bit-exact above)."""
    reports = rs2["same_mesh"]
    for r in reports:
        assert r["rebuild"] == f"node(s) [1, 2] rebuilt with process(es) " \
                               f"{[p for p in range(4) if p != r['pid']]}", r  # fmt: skip
    # on the smaller mesh both processes read both nodes too
    assert all("rebuilt with process(es)" in r["rebuild"] for r in rs2["smaller_mesh"])
    assert "rebuilding node(s)" not in rs2["same_mesh_log"]


def test_a_peer_that_shares_wrong_bytes_is_detected_and_nobody_restores_them(rs2):
    reports = rs2["share_wrong"]
    _check(reports, rs2["train"], 3, "redundancy")  # bit-exact: rebuilt alone after all
    assert all(r["lost"] == [1, 2] for r in reports)
    wrong = [r for r in reports if "shared rebuild does not match the digests" in r["rebuild"]]
    assert reports[1] in wrong, reports  # (and every process that reads the wrong lane)
    assert all(r in wrong or "rebuilt with" in r["rebuild"] for r in reports)
    assert "rebuilding node(s) [1, 2] alone" in rs2["share_wrong_log"]


def test_a_peer_that_never_says_it_is_done_makes_the_others_rebuild_alone(rs2):
    reports = rs2["share_silent"]
    _check(reports, rs2["train"], 3, "redundancy")
    for r in reports:
        if r["pid"] == 2:  # its peers said so: it reads what they (and it) rebuilt
            assert "rebuilt with" in r["rebuild"], r
        else:
            assert "alone: process 2 did not say its share was done within 5 s" in r["rebuild"], r


def test_two_killed_processes_resume_on_a_smaller_mesh(rs2):
    _check(rs2["smaller_mesh"], rs2["train"], 3, "redundancy")
    assert all(r["lost"] == [1, 2] for r in rs2["smaller_mesh"])


@pytest.fixture(scope="module")
def rs2_machines(tmp_path_factory):
    """Every process keeps its shared memory on its own 'machine' (a folder no other one sees)."""
    root = tmp_path_factory.mktemp("mem_rs2_machines")
    ns = f"test-rs2m-{uuid.uuid4().hex[:8]}"
    shm = Path("/dev/shm") / f"ucp-rs2-machines-{uuid.uuid4().hex[:8]}"
    base = {"ckpt": str(root / "ckpt"), "namespace": ns, "machines": str(shm)}
    out: dict = {}
    try:
        job = Job(root, "train", 4, 2, mode="train", steps=2, redundancy="rs2", **base)
        job.wait_for("SNAPSHOTS DONE")
        out["train"] = job.reports()
        job.crash(victim=1)
        shutil.rmtree(shm / "m1" / f"ucp-{ns}")  # machines 1 and 2 are replaced: memory gone
        shutil.rmtree(shm / "m2" / f"ucp-{ns}")
        _resume(root, out, "replaced", 4, 2, **base, **{"continue": True})
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return out


def test_two_replaced_machines_rebuild_from_bytes_the_others_send(rs2_machines):
    """Processes 1 and 2 see no snapshot: 0 and 3 send them the lanes, parities and digest
    tables that rebuild nodes 1 and 2 (each process only the ranges it needs)."""
    reports = rs2_machines["replaced"]
    _check(reports, rs2_machines["train"], 2, "redundancy")
    assert all(r["lost"] == [1, 2] for r in reports)
    assert reports[1]["fetched_bytes"] > 0 and reports[2]["fetched_bytes"] > 0
    assert "decoded from rs2" in rs2_machines["replaced_log"]
