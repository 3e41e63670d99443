"""Non-tensor state in the in-memory tier: `snapshot(..., extra=...)` comes back with its step.

JSON-able data and bytes (a data loader's own state), from shared memory, and from the persisted
universal checkpoint (its manifest's `extra` holds every process's) when memory is gone.
Single process here, and each scheme's rebuild of a lost node's extra; the 2- and 4-process
SIGKILL jobs (memory, replica, XOR parity, persisted) are in test_memory_multiprocess.py.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of, place, targets

import ucp_jax as ucp
from ucp_jax.memory import SnapshotManager


def _mgr(tmp_path, **kw):
    return SnapshotManager(tmp_path / "persist", redundancy=None,
                           namespace=f"extra-{tmp_path.name}", **kw)  # fmt: skip


def test_extra_comes_back_with_its_step_from_memory_and_disk(tmp_path):
    mesh = mesh_of((2, 4))
    state = place({"w": jnp.arange(32.0).reshape(8, 4)}, mesh)
    mgr = _mgr(tmp_path, persist_every=2)
    try:
        for step in (1, 2, 3):
            loader = {"epoch": 0, "position": step * 100}
            assert mgr.snapshot(step, state, extra=loader if step != 3 else b"grain\x00state")
        mgr.wait()
        got, _ = mgr.restore(targets(state, mesh))
        assert mgr.restored.step == 3 and mgr.restored.source == "memory"
        assert mgr.restored.extra == b"grain\x00state"
        np.testing.assert_array_equal(got["w"], state["w"])
        # the persisted checkpoint (step 2) carries every process's extra
        ck = ucp.open(tmp_path / "persist" / "step_2")
        assert ck.extra == {"source": "ucp.memory",
                            "process_extra": [{"epoch": 0, "position": 200}]}  # fmt: skip
    finally:
        mgr.free(all_nodes=True)
    # memory gone: the persisted fallback gives the extra of its own step
    mgr = _mgr(tmp_path)
    try:
        mgr.restore(targets(state, mesh))
        assert mgr.restored.source == "persisted" and mgr.restored.step == 2
        assert mgr.restored.extra == {"epoch": 0, "position": 200}
    finally:
        mgr.free(all_nodes=True)


def test_no_extra_and_bad_extra(tmp_path):
    mesh = mesh_of((8,))
    state = place({"w": jnp.ones(8)}, mesh)
    mgr = _mgr(tmp_path)
    try:
        mgr.snapshot(1, state)
        mgr.restore(targets(state, mesh))
        assert mgr.restored.extra is None
        with pytest.raises(TypeError, match="JSON-serialisable or bytes"):
            mgr.snapshot(2, state, extra={"loader": object()})
        # a dict keyed by the bytes marker came back as bytes, or broke the restore (base64)
        for marked in ({"__ucp_bytes__": "AAE="}, [{"a": {"__ucp_bytes__": "hello world!"}}]):
            with pytest.raises(TypeError, match="key '__ucp_bytes__', which marks bytes"):
                mgr.snapshot(2, state, extra=marked)
        loop: list = []
        loop.append(loop)
        with pytest.raises(TypeError, match="JSON-serialisable or bytes"):
            mgr.snapshot(2, state, extra=loop)
        # a negative step was snapshotted (and persisted) but never found again
        with pytest.raises(ValueError, match="step -1 is negative"):
            mgr.snapshot(-1, state)
        mgr.restore(targets(state, mesh))
        assert mgr.restored.step == 1 and mgr.restored.extra is None
    finally:
        mgr.free(all_nodes=True)


@pytest.mark.parametrize("name", ["replica", "xor"])
def test_a_lost_nodes_extra_is_rebuilt_by_its_scheme(name):
    """Each node keeps what its scheme says of its peers' serialised extras (different lengths);
    any one lost node of a group is rebuilt from what the others keep and their own extras."""
    from types import SimpleNamespace

    from ucp_jax._src.memory import extra as extras
    from ucp_jax._src.memory.schemes import scheme_for

    scheme = scheme_for(name)
    group = [0, 1, 2]
    layout = SimpleNamespace(group_of={n: group for n in group})
    own = {n: extras.serial(extras.encode({"loader": bytes([n]) * (5 + 7 * n), "n": n}))
           for n in group}  # fmt: skip
    kept = {
        n: scheme.keep_extras(layout, n, {s: own[s] for s in scheme.extra_sources(layout, n)})
        for n in group
    }
    for lost in group:
        left = [n for n in group if n != lost]
        got = scheme.rebuild_extra(layout, lost, {n: kept[n] for n in left},
                                   {n: own[n] for n in left})  # fmt: skip
        assert got == own[lost]
        assert extras.decode(json.loads(got)) == {"loader": bytes([lost]) * (5 + 7 * lost),
                                                  "n": lost}  # fmt: skip
    # two lost nodes of a group of three: replica and xor give up (None), never a wrong extra
    assert scheme.rebuild_extra(layout, 0, {2: kept[2]}, {2: own[2]}) is None


def test_a_rollback_makes_the_new_trajectory_the_newest(tmp_path, caplog):
    """Train to step 10 with snapshots, roll back to step 5 (a loss spike) and train 6..8 again on
    other data: the newest snapshot is step 8 of the new trajectory, in memory and on disk (the
    abandoned steps 9 and 10 go, with a warning); a restarted manager restores it."""
    import logging

    mesh = mesh_of((8,))
    mgr = _mgr(tmp_path, persist_every=2, keep=2)
    states = {}
    try:
        state = place({"w": jnp.zeros(64)}, mesh)
        for step in range(1, 11):
            state = place({"w": state["w"] + 1.0}, mesh)
            states[step] = np.asarray(state["w"])
            mgr.snapshot(step, state)
        mgr.wait()
        state = place({"w": jnp.asarray(states[5])}, mesh)
        with caplog.at_level(logging.WARNING, logger="ucp_jax"):
            for step in (6, 7, 8):
                state = place({"w": state["w"] + 100.0}, mesh)
                assert mgr.snapshot(step, state)
            mgr.wait()
        assert "rolled back" in caplog.text and "[9, 10]" in caplog.text
        assert mgr.latest_step() == 8
        mgr.close()
        again = _mgr(tmp_path, persist_every=2, keep=2)
        got, _ = again.restore(targets({"w": state["w"]}, mesh))
        assert again.restored.step == 8
        np.testing.assert_array_equal(got["w"], np.asarray(state["w"]))  # 305, not 10
        disk = [ucp.open(p).step for p in ucp.list_checkpoints(tmp_path / "persist")]
        assert disk == [2, 4, 6, 8]
        on_disk, _ = ucp.restore(tmp_path / "persist" / "step_8", {"w": np.zeros(64, np.float32)})
        np.testing.assert_array_equal(on_disk["w"], np.asarray(state["w"]))
        again.free(all_nodes=True)
    finally:
        mgr.free(all_nodes=True)


def test_a_damaged_persisted_checkpoint_is_passed_over_for_the_one_before(tmp_path, caplog):
    # memory gone, the newest persisted checkpoint damaged on disk (a byte flipped in its
    # largest data file): the restore takes the one before it, with a warning, where it raised
    # ChecksumError; all of them damaged: NotACheckpointError naming each
    import glob
    import logging
    import os

    mesh = mesh_of((2, 4))
    states = {s: place({"w": jnp.arange(64.0).reshape(8, 8) * s}, mesh) for s in (1, 2, 3, 4)}
    mgr = _mgr(tmp_path, persist_every=2)
    for s, state in states.items():
        mgr.snapshot(s, state, extra={"step": s})
    mgr.free(all_nodes=True)

    def flip(step: int) -> None:
        files = [f for f in glob.glob(f"{tmp_path}/persist/step_{step}/d/*") if os.path.isfile(f)]
        big = max(files, key=os.path.getsize)
        with open(big, "r+b") as f:
            f.seek(os.path.getsize(big) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))

    flip(4)
    mgr = _mgr(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="ucp_jax"):
            got, _ = mgr.restore(targets(states[2], mesh))
        assert (mgr.restored.step, mgr.restored.source) == (2, "persisted")
        assert mgr.restored.extra == {"step": 2}
        np.testing.assert_array_equal(got["w"], states[2]["w"])
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "step_4 (step 4) is damaged" in said and "trying the one before it" in said
        flip(2)
        with pytest.raises(ucp.NotACheckpointError, match="every persisted checkpoint under"):
            mgr.restore(targets(states[2], mesh))
    finally:
        mgr.free(all_nodes=True)
