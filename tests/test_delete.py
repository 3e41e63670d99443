"""`ucp.delete_checkpoint`: a checkpoint is deleted whole or not at all, whatever interrupts it.

The bug it fixes: a trainer cleaning up old steps with `shutil.rmtree`, SIGKILLed during it,
left a folder holding COMMIT but no manifest; listings named it and opening it failed
(`test_long_runs.py::test_a_killed_trainer_leaves_no_temporary_folders`, 1 run in ~10). Here the
interruption is placed at every step of the deletion, and a real SIGKILL lands at random times
in a process that deletes checkpoints in a loop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from mp.runner import worker_env

import ucp_jax as ucp
from ucp_jax._src.format import removal, writers


def _state(n: int) -> dict:
    return {"w": np.full((64, 64), n, np.float32), "b": np.arange(64, dtype=np.float32) + n}


def _listed_all_open(root: Path | str) -> list:
    found = ucp.list_checkpoints(root)
    for p in found:
        assert ucp.open(p).read("b")[0] >= 0  # manifest and arrays there
    return found


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
def test_delete_removes_a_checkpoint_and_nothing_else(tmp_path: Path, monkeypatch, layout) -> None:
    monkeypatch.setenv("UCP_LAYOUT", layout)
    for n in (1, 2, 3):
        ucp.save(tmp_path / f"step_{n}", _state(n), step=n)
    (tmp_path / "notes.txt").write_text("mine")
    ucp.delete_checkpoint(tmp_path / "step_2")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step_1", "step_3"]
    assert [Path(p).name for p in _listed_all_open(tmp_path)] == ["step_1", "step_3"]
    ucp.delete_checkpoint(str(tmp_path / "step_3") + "/")  # a trailing slash names the same
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step_1"]


def test_delete_refuses_what_is_not_a_committed_checkpoint(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "weights.bin").write_bytes(b"123")
    with pytest.raises(ucp.NotACheckpointError, match="nothing deleted"):
        ucp.delete_checkpoint(data)
    assert (data / "weights.bin").read_bytes() == b"123"
    with pytest.raises(ucp.NotACheckpointError, match="no committed checkpoint"):
        ucp.delete_checkpoint(tmp_path / "absent")
    ucp.save(tmp_path / "real", _state(1), step=1)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ucp.UnsafePathError, match="symbolic link"):
        ucp.delete_checkpoint(tmp_path / "link")
    assert ucp.open(tmp_path / "real").step == 1


def test_delete_refuses_while_a_save_of_the_path_runs(tmp_path: Path, monkeypatch) -> None:
    """A save of the same path in progress (its lock held throughout): the delete refuses once
    its short wait is over, changing nothing."""
    monkeypatch.setattr(removal, "LOCK_WAIT_S", 0.2)
    ucp.save(tmp_path / "step_1", _state(1), step=1)
    lock = writers.PathLock(str(tmp_path / "step_1"))
    lock.acquire()
    try:
        with pytest.raises(ucp.WriterConflictError, match="in progress"):
            ucp.delete_checkpoint(tmp_path / "step_1")
    finally:
        lock.release()
    assert ucp.open(tmp_path / "step_1").step == 1
    ucp.delete_checkpoint(tmp_path / "step_1")
    assert os.listdir(tmp_path) == []


def test_delete_waits_out_a_sweep_holding_the_lock(tmp_path: Path) -> None:
    """A save into the same folder holds other paths' locks for a moment while it sweeps their
    leftovers (an async save does so while the trainer deletes old steps): the delete waits.
    It failed with WriterConflictError in test_long_runs' 200 async saves."""
    import threading

    ucp.save(tmp_path / "step_1", _state(1), step=1)
    lock = writers.PathLock(str(tmp_path / "step_1"))
    lock.acquire()
    threading.Timer(0.2, lock.release).start()
    ucp.delete_checkpoint(tmp_path / "step_1")
    assert os.listdir(tmp_path) == []


def test_interrupted_delete_leaves_no_listed_half_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """Killed after the rename, during the removal: nothing is listed; the next save sweeps it."""
    for n in (1, 2):
        ucp.save(tmp_path / f"step_{n}", _state(n), step=n)

    def killed(path: str, ignore_errors: bool = False) -> None:
        os.remove(os.path.join(path, "manifest.json"))  # part of the removal done, then dies
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(removal.shutil, "rmtree", killed)
        with pytest.raises(KeyboardInterrupt):
            ucp.delete_checkpoint(tmp_path / "step_1")
    assert [Path(p).name for p in _listed_all_open(tmp_path)] == ["step_2"]
    assert any(n.startswith(".step_1.ucp-old-") for n in os.listdir(tmp_path))
    ucp.save(tmp_path / "step_3", _state(3), step=3)  # sweeps the trash
    assert sorted(os.listdir(tmp_path)) == ["step_2", "step_3"]
    with monkeypatch.context() as m:  # again; then the next deletion sweeps it
        m.setattr(removal.shutil, "rmtree", killed)
        with pytest.raises(KeyboardInterrupt):
            ucp.delete_checkpoint(tmp_path / "step_2")
    assert len(os.listdir(tmp_path)) == 2
    ucp.delete_checkpoint(tmp_path / "step_3")
    assert os.listdir(tmp_path) == []


DELETER = textwrap.dedent(
    """
    import sys
    import ucp_jax as ucp
    import time
    for p in ucp.list_checkpoints(sys.argv[1]):
        ucp.delete_checkpoint(p)
        print("deleted", flush=True)
        time.sleep(0.002)  # a loaded machine's parent still kills before the loop ends
    print("done", flush=True)
    """
)


def test_sigkill_during_deletes_never_leaves_a_listed_half_checkpoint(tmp_path: Path) -> None:
    """A process deleting checkpoints in a loop, SIGKILLed at a spread of times: every listed
    checkpoint opens and reads, and a next save leaves no hidden folder behind."""
    script = tmp_path / "deleter.py"
    script.write_text(DELETER)
    root = tmp_path / "run"
    rng = np.random.default_rng(0)
    killed_mid = 0
    for trial in range(6):
        for n in range(12):
            ucp.save(root / f"t{trial}_{n:02d}", _state(n), step=n)
        proc = subprocess.Popen([sys.executable, str(script), str(root)], env=worker_env(1),
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout is not None
        for _ in range(int(rng.integers(1, 8))):  # some deleted, then killed during the next ones
            assert proc.stdout.readline().strip() == "deleted"
        time.sleep(float(rng.uniform(0.0, 0.002)))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        left = _listed_all_open(root)
        killed_mid += "done" not in out
        print(f"  trial {trial}: {len(left)} of 12 left", flush=True)
        ucp.save(root / f"after{trial}", _state(99), step=99)  # sweeps any trash
        assert [n for n in os.listdir(root) if n.startswith(".")] == []
        for p in ucp.list_checkpoints(root):
            ucp.delete_checkpoint(p)
        assert os.listdir(root) == []
    print(f"\n  killed before the loop ended: {killed_mid} of 6")
    assert killed_mid >= 2  # the kills landed among the deletes


def test_delete_in_an_object_store_drops_commit_first(monkeypatch) -> None:
    """memory:// (the S3 and GCS servers: test_object_stores.py): deleted whole; killed while its
    objects are removed, nothing is listed or opens as a checkpoint."""
    from ucp_jax._src.format import store

    root = "memory://del"
    for n in (1, 2):
        ucp.save(f"{root}/step_{n}", _state(n), step=n)
    ucp.delete_checkpoint(f"{root}/step_1")
    assert [str(p) for p in ucp.list_checkpoints(root)] == [f"{root}/step_2"]
    assert not store.Location.parse(f"{root}/step_1").has_any()

    def killed(self: store.Location) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(store.Location, "remove_all", killed)
        with pytest.raises(KeyboardInterrupt):
            ucp.delete_checkpoint(f"{root}/step_2")
    assert ucp.list_checkpoints(root) == []
    with pytest.raises(ucp.NotACheckpointError):
        ucp.open(f"{root}/step_2")
    with pytest.raises(ucp.NotACheckpointError, match="nothing deleted"):
        ucp.delete_checkpoint(f"{root}/step_2")


def test_cli_rm(tmp_path: Path, capsys) -> None:
    from ucp_jax._src.cli import main as cli_main

    for n in (1, 2):
        ucp.save(tmp_path / f"step_{n}", _state(n), step=n)
    (tmp_path / "other").mkdir()
    assert cli_main(["rm", str(tmp_path / "step_1")]) == 0
    assert capsys.readouterr().out.strip() == f"deleted {tmp_path / 'step_1'}"
    assert cli_main(["rm", str(tmp_path / "step_2"), str(tmp_path / "other")]) == 1
    out, err = capsys.readouterr()
    assert out.strip() == f"deleted {tmp_path / 'step_2'}"
    assert err.startswith("ucp rm: ") and "nothing deleted" in err
    assert sorted(os.listdir(tmp_path)) == ["other"]


def test_a_half_removed_checkpoint_is_not_listed_and_ucp_rm_removes_it(tmp_path: Path, caplog):
    """What a plain `rm -r` interrupted midway leaves (COMMIT, no manifest) is not listed, with a
    warning that names it and the fix, so `list_checkpoints(root)[-1]` is always restorable."""
    import logging

    from ucp_jax._src.cli import main as cli_main

    for n in (1, 2):
        ucp.save(tmp_path / f"step_{n}", _state(n), step=n)
    (tmp_path / "step_2" / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        assert [Path(p).name for p in _listed_all_open(tmp_path)] == ["step_1"]
    assert "step_2 holds COMMIT but no manifest.json" in caplog.text and "ucp rm" in caplog.text
    assert cli_main(["rm", str(tmp_path / "step_2")]) == 0
    assert sorted(os.listdir(tmp_path)) == ["step_1"]
