"""A save that dies midway never leaves something that looks like a checkpoint.

A subprocess trainer (tests/mp/kill_worker.py) is SIGKILLed while it writes a ~128 MiB state, or
after it wrote COMMIT into the staging folder but before it renamed it into place. In process,
saves to a local folder and to a `memory://` kvstore raise midway (injected). In every case the
earlier checkpoint is intact, the partial one is neither listed nor openable, and the next save
to the same path succeeds.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from conftest import assert_tree_bitexact
from helpers import float_params, mesh_of, place, targets
from mp.kill_worker import wrote_data
from mp.runner import run_and_kill

import ucp_jax as ucp
from ucp_jax._src import save as save_mod

KILL_WORKER = Path(__file__).parent / "mp" / "kill_worker.py"
TIMEOUT_S = 120


def _run_and_kill(mode: str, root: Path, log: Path) -> None:
    """Start the trainer, SIGKILL it when it says so; fail with its output if it never does."""
    run_and_kill([str(KILL_WORKER), mode, str(root)], log, TIMEOUT_S, ["STEP1 DONE"],
                 UCP_INFLIGHT_BYTES=str(8 << 20))  # fmt: skip


def _small_state(seed: int = 0):
    return place(float_params(seed), mesh_of((2, 4)))


def _assert_not_a_checkpoint(path) -> None:
    with pytest.raises(ucp.NotACheckpointError, match="step_2"):
        ucp.open(path)
    with pytest.raises(ucp.NotACheckpointError):
        ucp.restore(path, targets(float_params(), mesh_of((4, 2))))


def _assert_restores(path, seed: int = 0) -> None:
    want = float_params(seed)
    got, _ = ucp.restore(path, targets(want, mesh_of((4, 2))))
    assert_tree_bitexact(want, got)


@pytest.mark.parametrize("mode", ["writing", "renaming"])
def test_sigkill_midsave(tmp_path, mode):
    root = tmp_path / "ckpts"
    _run_and_kill(mode, root, tmp_path / "stderr.txt")

    staging = root / ".step_2.ucp-tmp"
    assert staging.is_dir(), "the kill should leave the staging folder behind"
    assert wrote_data(staging), "the save was killed before it wrote any data"
    if mode == "writing":
        assert not (staging / "COMMIT").exists(), "the save finished before the kill"
    else:
        assert (staging / "COMMIT").exists() and (staging / "manifest.json").exists()
    assert not (root / "step_2").exists()

    assert ucp.list_checkpoints(root) == [str(root / "step_1")]
    _assert_not_a_checkpoint(root / "step_2")
    assert ucp.open(root / "step_1").step == 1
    _assert_restores(root / "step_1")

    # The next save to the same path clears the leftovers and commits.
    ucp.save(root / "step_2", _small_state(seed=2), step=2)
    assert not staging.exists()
    assert ucp.list_checkpoints(root) == [str(root / "step_1"), str(root / "step_2")]
    assert ucp.open(root / "step_2").step == 2
    _assert_restores(root / "step_2", seed=2)
    _assert_restores(root / "step_1")


# ------------------------------------------------------------------------- in-process failures


class Injected(RuntimeError):
    pass


def _fail_midwrite(monkeypatch: pytest.MonkeyPatch, after: int = 3) -> None:
    """The next blocking save raises after `after` regions have been handed to the writer.

    Pass the save max_inflight_bytes=1, so that those regions are durable before it raises.
    """
    stream = save_mod.SaveJob._stream

    def failing(self):  # type: ignore[no-untyped-def]
        for i, item in enumerate(stream(self)):
            if i == after:
                raise Injected("disk on fire")
            yield item

    monkeypatch.setattr(save_mod.SaveJob, "_stream", failing)


def _fail_before_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next save raises after every region is written, before the manifest and COMMIT."""
    wait = save_mod.Rendezvous.wait

    def failing(self, name: str):  # type: ignore[no-untyped-def]
        if name == "written":
            raise Injected("lost the job")
        return wait(self, name)

    monkeypatch.setattr(save_mod.Rendezvous, "wait", failing)


def _stored_keys(root: str, name: str) -> list[str]:
    """Keys stored under root/name, local folder (incl. its staging folder) or kvstore."""
    from ucp_jax._src.format.store import Location

    loc = Location.parse(root)
    if loc.local_path is not None:
        return [
            str(Path(d, f))
            for folder in (f"{name}", f".{name}.ucp-tmp")
            for d, _, fs in os.walk(Path(loc.local_path, folder))
            for f in fs
        ]
    return [k.decode() for k in loc.child(name).kv().list().result()]


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpts")
    return f"memory://ucp-test-kill-{uuid.uuid4().hex}"


@pytest.mark.parametrize("how", ["blocking-midwrite", "async-before-commit"])
def test_failed_save_is_not_a_checkpoint(root, how, monkeypatch):
    ucp.save(f"{root}/step_1", _small_state(), step=1)
    with monkeypatch.context() as m:
        if how == "blocking-midwrite":
            _fail_midwrite(m)
            with pytest.raises(Injected):
                ucp.save(f"{root}/step_2", _small_state(seed=2), step=2, max_inflight_bytes=1)
        else:
            _fail_before_commit(m)
            h = ucp.async_save(f"{root}/step_2", _small_state(seed=2), step=2)
            with pytest.raises(RuntimeError, match="lost the job"):
                h.wait()
    keys = _stored_keys(root, "step_2")
    data_files = [k for k in keys if "ocdbt.p0/d/" in k]  # the aggregated layout's
    chunks = [k for k in keys if "/c/" in k or k.endswith("/c")]
    if root.startswith("memory://"):  # in place: what was written stays, with no COMMIT
        # The regions handed over before the failure sit in a transaction that is aborted (a tiny
        # state is one transaction), so what stays is the metadata transaction's data files: one
        # or two, as TensorStore happens to split it (asking for two failed now and then).
        assert chunks or data_files, f"nothing was written: {keys}"
    else:  # a local staging folder is removed when its save fails: its space is given back
        assert keys == [], keys
    assert not any(k.endswith("COMMIT") for k in keys), keys

    assert ucp.list_checkpoints(root) == [f"{root}/step_1"]
    _assert_not_a_checkpoint(f"{root}/step_2")
    _assert_restores(f"{root}/step_1")

    ucp.save(f"{root}/step_2", _small_state(seed=2), step=2)
    assert ucp.list_checkpoints(root) == [f"{root}/step_1", f"{root}/step_2"]
    _assert_restores(f"{root}/step_2", seed=2)


def test_failed_overwrite_keeps_the_old_checkpoint(root, monkeypatch):
    """A save with overwrite=True that dies midway leaves the checkpoint it was replacing intact."""
    ucp.save(f"{root}/step_1", _small_state(), step=1)
    with monkeypatch.context() as m:
        _fail_midwrite(m)
        with pytest.raises(Injected):
            ucp.save(
                f"{root}/step_1", _small_state(seed=5), step=5, overwrite=True, max_inflight_bytes=1
            )
    if root.startswith("memory://"):
        # Object stores are written in place: an overwrite first deletes the old checkpoint
        # (COMMIT included), so an interrupted one leaves nothing, never a mix of old and new.
        assert ucp.list_checkpoints(root) == []
        with pytest.raises(ucp.NotACheckpointError):
            ucp.open(f"{root}/step_1")
        return
    assert ucp.list_checkpoints(root) == [f"{root}/step_1"]
    assert ucp.open(f"{root}/step_1").step == 1
    _assert_restores(f"{root}/step_1")
