"""Long runs: 200 successive async saves with garbage collection, and 1,000 in-memory snapshots.

File descriptors, threads, resident memory and the shared-memory namespace are measured after the
20th iteration and at the end: they stay flat (within a small slack; nothing grows per
iteration). No temporary folder is left behind, also after a trainer is SIGKILLed mid-save (the
next save into the folder sweeps what it left; a new snapshot manager frees its torn snapshots).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from helpers import mesh_of, place
from mp.runner import worker_env

import ucp_jax as ucp
from ucp_jax._src.memory.shm import committed
from ucp_jax.memory import SnapshotManager

WORKER = Path(__file__).parent / "mp" / "longrun_worker.py"
SHM = Path("/dev/shm")


def _usage(shm: Path | None = None) -> dict[str, int]:
    """This process's open fds, OS threads and RSS (bytes); with `shm`, the bytes under it."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    out = {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
           "rss": rss}  # fmt: skip
    if shm is not None:
        out["shm"] = sum(p.stat().st_blocks * 512 for p in shm.rglob("*") if p.is_file())
    return out


def _flat(at20: dict[str, int], end: dict[str, int], rss_slack: int) -> None:
    print(f"\n  after 20: {at20}\n  at end:   {end}")
    assert end["fds"] <= at20["fds"] + 2, (at20, end)
    assert end["threads"] <= at20["threads"] + 2, (at20, end)
    assert end["rss"] <= at20["rss"] + rss_slack, (at20, end)
    if "shm" in end:
        assert end["shm"] <= at20["shm"], (at20, end)


def _state(n: int) -> dict:
    return {"w": np.full((256, 256), n, np.float32), "b": np.arange(256, dtype=np.float32) + n}


def test_200_async_saves_with_garbage_collection(tmp_path: Path) -> None:
    root = tmp_path / "run"
    mesh = mesh_of((2,))
    at20: dict[str, int] = {}
    for n in range(1, 201):
        ucp.async_save(root / f"step_{n:04d}", place(_state(n), mesh), step=n)
        for old in ucp.list_checkpoints(root)[:-3]:  # keep the newest 3 (the last may be running)
            ucp.delete_checkpoint(old)
        if n == 20:
            at20 = _usage()
    ucp.async_save(root / "step_0201", place(_state(201), mesh), step=201).wait()
    for old in ucp.list_checkpoints(root)[:-3]:
        ucp.delete_checkpoint(old)
    _flat(at20, _usage(), rss_slack=48 << 20)
    assert sorted(os.listdir(root)) == ["step_0199", "step_0200", "step_0201"]
    assert ucp.open(root / "step_0201").read("w")[0, 0] == 201
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_1000_snapshots(tmp_path: Path) -> None:
    shm = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else tmp_path / "shm"
    ns = f"ucp-longrun-{uuid.uuid4().hex[:8]}"
    mgr = SnapshotManager(None, keep=2, shm_dir=shm, namespace=ns)
    mesh = mesh_of((2,))
    tree = place(_state(0), mesh)
    try:
        at20: dict[str, int] = {}
        for n in range(1, 1001):
            mgr.snapshot(n, tree)
            if n == 20:
                mgr.wait()
                at20 = _usage(shm / f"ucp-{ns}")
        mgr.wait()
        _flat(at20, _usage(shm / f"ucp-{ns}"), rss_slack=32 << 20)
        assert mgr.latest_step() == 1000
        steps = sorted(n for n in os.listdir(shm / f"ucp-{ns}" / "0") if n.startswith("step_"))
        assert steps == ["step_1000", "step_999"]
    finally:
        mgr.free()
        mgr.close()
    assert not (shm / f"ucp-{ns}").exists()


def test_a_killed_trainer_leaves_no_temporary_folders(tmp_path: Path) -> None:
    root, shm, ns = tmp_path / "run", tmp_path / "shm", "killed"
    proc = subprocess.Popen([sys.executable, str(WORKER), str(root), str(shm), ns],
                            env=worker_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # bounded: the worker prints one line per step
            if line.startswith("saved 6"):
                break
        time.sleep(0.03)  # into the next save
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    left = sorted(os.listdir(root))
    print(f"\n  left by the kill: {left}")
    ucp.save(root / "step_100", _state(100), step=100)  # sweeps what the killed saves left
    assert all(not n.startswith(".") for n in os.listdir(root)), os.listdir(root)
    assert all(ucp.open(p).step is not None for p in ucp.list_checkpoints(root))
    mgr = SnapshotManager(None, keep=2, shm_dir=shm, namespace=ns)
    try:
        mgr.snapshot(101, place(_state(101), mesh_of((2,))))
        mgr.wait()
        node = shm / f"ucp-{ns}" / "0"
        steps = sorted(n for n in os.listdir(node) if n.startswith("step_"))
        whole = sorted(e.path.name for e in committed(node))
        assert steps == whole and len(steps) <= 2, (steps, whole)  # no torn snapshot left
        assert [n for n in os.listdir(node) if n.startswith(".") and n != ".free"] == []
    finally:
        mgr.free()
        mgr.close()
