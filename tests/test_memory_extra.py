"""Non-tensor state in the in-memory tier: `snapshot(..., extra=...)` comes back with its step.

JSON-able data and bytes (a data loader's own state), from shared memory, and from the persisted
universal checkpoint (its manifest's `extra` holds every process's) when memory is gone.
Single process here; the 2-process SIGKILL job is in test_memory_multiprocess.py when it runs.
"""

from __future__ import annotations

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
    finally:
        mgr.free(all_nodes=True)
