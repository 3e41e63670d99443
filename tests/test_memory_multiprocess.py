"""In-memory fault tolerance across real jax.distributed jobs (localhost, gloo, CPU devices).

Every snapshot carries each process's data-loader state (`extra`: bytes inside JSON data, different
per process and step); every restore below checks that each process gets its own back, of the
step restored: from memory, rebuilt from the replica or the XOR parity when its node is lost, and
from the persisted manifest.

Replica: a 2-process x 4-device job trains 5 steps (donated buffers) with a snapshot per step and
a universal checkpoint every 2; one process is SIGKILLed and the job dies. New jobs with the same
namespace then resume bit for bit: from memory (2 processes, and 1 process with 4 devices), after
node 1's shared memory is wiped too from the replica node 0 keeps (and training goes on with the
same bits), and with both nodes of the group wiped from the persisted step 4 (logged).

No redundancy: a 2-process job snapshots 3 steps, each node keeping half of every replicated
shard; resumes on 2 processes and on 1 map those halves back to back (nothing copied but the few
small slabs too short to start on a page).

XOR: a 4-process x 2-device job (one parity group of 4) trains 3 steps; a bit of one node's
committed snapshot is flipped in shared memory, and a resume rebuilds that node from the parity
(its blob fails its CRC-32); one process is killed and its shared memory wiped; a 2-process x 4-device job resumes bit-exact from the XOR parity (on
another mesh); with a second node of the group wiped, 1 process falls back to the persisted
checkpoint.

The state mixes leaves replicated across processes (their redundancy copies are free) and leaves
sharded across processes (exchanged with a ppermute when the snapshot is taken).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from mp.mem_worker import loader_state
from mp.runner import free_port, worker_env

WORKER = Path(__file__).parent / "mp" / "mem_worker.py"
TIMEOUT_S = 180


class Job:
    """One jax.distributed job of `nprocs` worker processes."""

    def __init__(self, root: Path, name: str, nprocs: int, devices: int, **cfg) -> None:
        self.root, self.name, self.nprocs = root, name, nprocs
        env = worker_env(devices)
        # the xor job takes the accelerators' path (device-side copies), the replica job the CPU one
        env["UCP_SNAPSHOT_DEVICE_COPIES"] = "1" if cfg.get("device_copies") else "0"
        addr = f"127.0.0.1:{free_port()}"
        self.lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self.procs = []
        for i in range(nprocs):
            c = dict(cfg, pid=i, nprocs=nprocs, addr=addr, report=str(self._report(i)))
            err = open(self._err(i), "w")  # noqa: SIM115 (closed in finish)
            p = subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(c)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            p.err = err
            self.procs.append(p)
            threading.Thread(target=self._pump, args=(i, p), daemon=True).start()

    def _report(self, i: int) -> Path:
        return self.root / f"{self.name}_{i}.json"

    def _err(self, i: int) -> Path:
        return self.root / f"{self.name}_{i}.err"

    def _pump(self, i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            self.lines.put((i, line.strip()))
        self.lines.put((i, None))

    def stderr(self, i: int) -> str:
        return self._err(i).read_text()

    def _fail(self, why: str) -> None:
        self.kill_all()
        text = "\n".join(
            f"--- process {i} (exit {p.returncode}):\n{self.stderr(i)[-4000:]}"
            for i, p in enumerate(self.procs)
        )
        pytest.fail(f"job {self.name}: {why}\n{text}")

    def wait_for(self, marker: str) -> None:
        """Until every process printed `marker`."""
        seen: set[int] = set()
        deadline = time.monotonic() + TIMEOUT_S
        while len(seen) < self.nprocs:
            try:
                i, line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                self._fail(f"no {marker!r} after {TIMEOUT_S} s")
            if line is None:
                self.procs[i].wait()
                self._fail(f"process {i} exited before {marker!r}")
            if line == marker:
                seen.add(i)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.err.close()

    def crash(self, victim: int) -> None:
        """SIGKILL one process; the job dies (the others are killed if still alive after 0.5 s)."""
        os.kill(self.procs[victim].pid, signal.SIGKILL)
        self.procs[victim].wait()
        time.sleep(0.5)
        self.kill_all()
        assert self.procs[victim].returncode == -signal.SIGKILL

    def finish(self) -> list[dict]:
        self.wait_for("RESUME DONE")
        for p in self.procs:
            p.wait(timeout=TIMEOUT_S)
        self.kill_all()
        if any(p.returncode != 0 for p in self.procs):
            self._fail("a process failed")
        return [json.loads(self._report(i).read_text()) for i in range(self.nprocs)]

    def reports(self) -> list[dict]:
        return [json.loads(self._report(i).read_text()) for i in range(self.nprocs)]


def _shm(namespace: str) -> Path:
    return Path("/dev/shm") / f"ucp-{namespace}"


def _trained(root: Path, name: str, nprocs: int, devices: int, victim: int, **cfg) -> list[dict]:
    """Train with snapshots until every process reports, then SIGKILL `victim` (the job dies)."""
    job = Job(root, name, nprocs, devices, mode="train", **cfg)
    job.wait_for("SNAPSHOTS DONE")
    reports = job.reports()
    job.crash(victim=victim)
    return reports


def _resume(root: Path, out: dict, name: str, nprocs: int, devices: int, **cfg) -> None:
    """Resume on `nprocs` x `devices`; out[name] = the reports, out[name_log] = first/last stderr."""
    job = Job(root, name, nprocs, devices, mode="resume", **cfg)
    out[name] = job.finish()
    out[name + "_log"] = job.stderr(0) + (job.stderr(nprocs - 1) if nprocs > 1 else "")


@contextlib.contextmanager
def _scenario(tmp_path_factory, name: str):
    """(folder, namespace, the config every job of the scenario shares); the namespace's shared
    memory is removed afterwards."""
    root = tmp_path_factory.mktemp(f"mem_{name}")
    ns = f"test-{name}-{uuid.uuid4().hex[:8]}"
    try:
        yield root, ns, {"ckpt": str(root / "ckpt"), "namespace": ns}
    finally:
        shutil.rmtree(_shm(ns), ignore_errors=True)


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    out = {}
    with _scenario(tmp_path_factory, "replica") as (root, ns, base):
        out["train"] = _trained(root, "train", 2, 4, 1, steps=5, persist_every=2,
                                redundancy="replica", **base)  # fmt: skip

        def resume(name, nprocs, devices, **kw):
            _resume(root, out, name, nprocs, devices, **base, **kw)

        resume("memory", 2, 4, **{"continue": True})
        resume("memory_1proc", 1, 4)
        shutil.rmtree(_shm(ns) / "1")  # node 1 is gone
        resume("redundancy", 2, 4, **{"continue": True})
        resume("redundancy_1proc", 1, 4)
        shutil.rmtree(_shm(ns) / "0")  # both nodes of the group are gone
        shutil.rmtree(_shm(ns) / "1", ignore_errors=True)  # (the last job recreated it, empty)
        resume("persisted", 2, 4, **{"continue": True})
    return out


def _check(reports, train, step, source):
    """Every process restored `step` from `source`, bit-exact, with its own data-loader state of
    that step (snapshot extra: from its node's memory, rebuilt from its peers', or from the
    persisted manifest)."""
    digests = train[0]["digests"]
    assert all(d == train[0]["digests"] for d in (t["digests"] for t in train))
    for r in reports:
        assert (r["step"], r["source"]) == (step, source), r
        assert r["extra"] == repr(loader_state(r["pid"], step)), "wrong data-loader state"
        assert r["digest"] == digests[str(step)], "restored state differs from the trained one"
        if "next_digest" in r:
            assert r["next_digest"] == digests[str(step + 1)], "training did not go on bit-exact"


@pytest.fixture(scope="module")
def no_redundancy(tmp_path_factory):
    out = {}
    with _scenario(tmp_path_factory, "none") as (root, _, base):
        out["train"] = _trained(root, "train", 2, 4, 0, steps=3, redundancy=None, **base)
        _resume(root, out, "memory", 2, 4, **base, **{"continue": True})
        _resume(root, out, "memory_1proc", 1, 4, **base)
    return out


def test_without_redundancy_split_shards_are_mapped_not_copied(no_redundancy):
    # Each node kept half of the 4 MiB replicated `big` (and of its moments); a restore needs it
    # whole on every device: its slabs, page aligned in two blobs, are mapped back to back.
    out = no_redundancy
    _check(out["memory"], out["train"], 3, "memory")
    _check(out["memory_1proc"], out["train"], 3, "memory")
    assert [r["copied_bytes"] for r in out["memory"]] == [0, 0]
    # On one process w2 and emb (sharded across the two processes) are rebuilt from two slabs
    # of 1 and 2 KiB (too small to start on a page): copied, 36 KiB with their moments; `big`
    # and its moments (12 MiB) are not.
    assert out["memory_1proc"][0]["copied_bytes"] == 3 * 4 * 2 * (32 * 8 * 4) + 3 * 64 * 32 * 2


def test_train_job_snapshots(replica):
    stats = [r["stats"] for r in replica["train"]]
    assert [s["step"] for s in stats] == [5, 5]
    # w2, emb and their two moments are sharded across the processes: exchanged with a ppermute
    assert all(s["rolls"] == 6 for s in stats)
    # all but the padding: < 64 B per piece, < 4 KiB before each page-aligned run (big, mu, nu)
    assert all(s["nbytes"] - s["copied_bytes"] < 64 * 64 + 3 * 4096 for s in stats)


def test_resume_from_memory_after_sigkill(replica):
    _check(replica["memory"], replica["train"], 5, "memory")
    assert replica["memory"][0]["lost"] == []


def test_resume_on_a_smaller_mesh(replica):
    _check(replica["memory_1proc"], replica["train"], 5, "memory")
    _check(replica["redundancy_1proc"], replica["train"], 5, "redundancy")


def test_resume_from_the_replica_after_a_node_is_wiped(replica):
    _check(replica["redundancy"], replica["train"], 5, "redundancy")
    assert replica["redundancy"][0]["lost"] == [1]
    assert "node(s) [1] decoded from replica" in replica["redundancy_log"]


def test_two_nodes_of_a_group_wiped_falls_back_to_the_persisted_checkpoint(replica):
    _check(replica["persisted"], replica["train"], 4, "persisted")
    assert replica["persisted"][0]["path"].endswith("step_4")
    assert "falling back to the persisted universal checkpoint" in replica["persisted_log"]


@pytest.fixture(scope="module")
def xor(tmp_path_factory):
    out = {}
    with _scenario(tmp_path_factory, "xor") as (root, ns, base):
        out["train"] = _trained(root, "train", 4, 2, 2, steps=3, persist_every=2,
                                redundancy="xor", device_copies=True, **base)  # fmt: skip
        data = _shm(ns) / "2" / "step_3" / "data.bin"  # a bit flipped in node 2's memory
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 3)
            b = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b ^ 1]))
        _resume(root, out, "damaged", 2, 4, **base)
        shutil.rmtree(_shm(ns) / "2")
        _resume(root, out, "parity", 2, 4, **base)  # 4 nodes -> 2 processes
        shutil.rmtree(_shm(ns) / "1")
        shutil.rmtree(_shm(ns) / "2", ignore_errors=True)
        _resume(root, out, "persisted", 1, 4, **base)
    return out


def test_xor_parity_recovers_a_lost_node(xor):
    _check(xor["parity"], xor["train"], 3, "redundancy")
    assert xor["parity"][0]["lost"] == [2]


def test_xor_parity_rebuilds_a_node_damaged_in_shared_memory(xor):
    # node 2's committed blob no longer matches its CRC-32: rebuilt from the parity like a lost
    # node, never read as it is
    _check(xor["damaged"], xor["train"], 3, "redundancy")
    assert xor["damaged"][0]["lost"] == [2]
    assert "node(s) [2] fail their CRC-32 check (node 2: " in xor["damaged_log"]


def test_xor_two_lost_nodes_fall_back(xor):
    _check(xor["persisted"], xor["train"], 2, "persisted")
    assert "falling back to the persisted universal checkpoint" in xor["persisted_log"]


# ------------------------------------------- a cluster: each machine sees only its own memory


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    """Every process keeps its shared memory on its own 'machine' (a folder no other one sees)."""
    root = tmp_path_factory.mktemp("mem_machines")
    ns = f"test-machines-{uuid.uuid4().hex[:8]}"
    shm = Path("/dev/shm") / f"ucp-machines-{uuid.uuid4().hex[:8]}"
    base = {"ckpt": str(root / "ckpt"), "namespace": ns, "machines": str(shm)}
    out = {}
    try:
        out["train"] = _trained(root, "train", 2, 4, 0, steps=3, redundancy="replica", **base)

        def resume(name, nprocs, devices, **kw):
            _resume(root, out, name, nprocs, devices, **base, **kw)

        resume("same", 2, 4, **{"continue": True})
        shutil.rmtree(shm / "m1")  # machine 1 is replaced by a new one: its memory is gone
        resume("replaced", 2, 4, **{"continue": True})
        shutil.rmtree(shm / "m1")
        resume("replaced_1proc", 1, 8)  # and the job shrinks to the machine that is left
        xor_base = dict(base, namespace=ns + "-xor")
        out["xor_train"] = _trained(root, "xor_train", 4, 2, 3, steps=2, redundancy="xor",
                                    **xor_base)  # fmt: skip
        shutil.rmtree(shm / "m2" / f"ucp-{ns}-xor")  # machine 2 lost its memory
        _resume(root, out, "xor_replaced", 4, 2, **xor_base, **{"continue": True})
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return out


def test_cluster_restart_on_the_same_machines_reads_only_local_memory(machines):
    _check(machines["same"], machines["train"], 3, "memory")
    assert [r["fetched_bytes"] for r in machines["same"]] == [0, 0]


def test_cluster_replaced_machine_gets_its_state_from_its_peer(machines):
    """The new machine 1 sees no snapshot: process 0 sends it node 1's pieces (its replica)."""
    reports = machines["replaced"]
    _check(reports, machines["train"], 3, "redundancy")
    assert reports[0]["lost"] == [1]
    assert reports[0]["fetched_bytes"] == 0 and reports[1]["fetched_bytes"] > 0
    assert "MiB of it from other processes" in machines["replaced_log"]
    _check(machines["replaced_1proc"], machines["train"], 3, "redundancy")


def test_cluster_xor_decodes_a_lost_machine_from_bytes_of_the_others(machines):
    reports = machines["xor_replaced"]
    _check(reports, machines["xor_train"], 2, "redundancy")
    assert reports[2]["lost"] == [2]
    assert reports[2]["fetched_bytes"] > 0  # lanes and parity of nodes 0, 1 and 3
    assert "decoded from xor" in machines["xor_replaced_log"]


def test_a_snapshot_damaged_before_its_persist_is_persisted_by_no_process(tmp_path_factory):
    """A byte of process 1's step-2 snapshot flipped after its commit, before its persist: every
    process skips that persist alike (one process raising alone left the other in the next
    snapshot's collective: the job hung), logs why, and training goes on to the end."""
    with _scenario(tmp_path_factory, "persist_damage") as (root, _, base):
        job = Job(root, "train", 2, 4, mode="train", steps=3, persist_every=2,
                  redundancy="replica", persist_damage={"pid": 1, "step": 2}, **base)  # fmt: skip
        job.wait_for("SNAPSHOTS DONE")
        reports = job.reports()
        job.kill_all()
        assert [sorted(r["digests"]) for r in reports] == [["1", "2", "3", "4"]] * 2
        for i in range(2):
            assert "step 2 not persisted (on any process)" in job.stderr(i)
            assert "process(es) [1]" in job.stderr(i)
        import ucp_jax as ucp

        assert ucp.list_checkpoints(base["ckpt"]) == []


def test_a_snapshot_failed_on_one_process_fails_on_its_peers_at_once(tmp_path_factory):
    """Process 1's step-2 blob cannot be created (/dev/shm full). Its peer, which keeps its
    parity, stops waiting for it at once with an error naming it and the cause (it waited for the
    barrier timeout, 30 minutes, and then named a key); neither process commits or persists step
    2. The loop catches the errors and trains on; the later snapshots keep each step's own
    data-loader state: restored after node 0 is lost, step 4 comes back with step 4's extras
    (step 2's were taken: a process's exchange count fell one behind its peers' for good)."""
    with _scenario(tmp_path_factory, "shm_full") as (root, ns, base):
        cfg = dict(redundancy="xor", persist_every=2, catch=True, **base)
        t0 = time.monotonic()
        train = _trained(root, "train", 2, 4, 0, steps=4, shm_full={"pid": 1, "step": 2}, **cfg)
        assert time.monotonic() - t0 < TIMEOUT_S
        errors = [r["snapshot_errors"] for r in train]
        assert sorted(errors[0]) == sorted(errors[1]) == ["3"], errors  # raised by snapshot(3)
        assert "no space left for" in errors[1]["3"] and "(injected)" in errors[1]["3"]
        assert errors[0]["3"].startswith("AnotherProcessFailedError: ")
        assert "process 1's snapshot of step 2 failed" in errors[0]["3"]
        assert "no space left for" in errors[0]["3"]
        for node in ("0", "1"):
            committed = sorted(p.parent.name for p in (_shm(ns) / node).glob("step_*/COMMIT"))
            # snapshot(3) raised step 2's error instead of starting: keep=2 holds steps 1 and 4
            assert committed == ["step_1", "step_4"], (node, committed)
        import ucp_jax as ucp

        assert ucp.list_checkpoints(base["ckpt"]) == [os.path.join(base["ckpt"], "step_4")]
        shutil.rmtree(_shm(ns) / "0")
        out: dict = {}
        _resume(root, out, "redundancy", 2, 4, **cfg)
        _check(out["redundancy"], train, 4, "redundancy")
        assert out["redundancy"][0]["lost"] == [0]
