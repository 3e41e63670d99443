"""Universal checkpoints through Orbax's v1 API: `training.Checkpointer` and the free functions,
saved on one mesh and loaded onto another; v0-saved steps load through v1; what v1 cannot do."""

from __future__ import annotations

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import assert_tree_bitexact
from helpers import fit_shape, mesh_of, targets
from mp import state

import ucp_jax as ucp
import ucp_jax.orbax as uo

STACK = [(r"layers\.w", ucp.Stacked("layers.{i}.w"))]


@pytest.fixture(scope="module")
def ref():
    return state.reference_state()


def _placed(tree, mesh):
    return state.globalize(tree, mesh)


def test_training_checkpointer_saves_on_2x4_and_loads_on_8_and_4x2(tmp_path, ref):
    params, opt_state = ref
    mesh = mesh_of((2, 4))
    save = uo.UniversalSave(_placed(params, mesh), _placed(opt_state, mesh), rules=STACK)
    with ocp.v1.training.Checkpointer(tmp_path / "run") as ckptr:
        ckptr.save_checkpointables(7, {"universal": save})
        assert ckptr.latest is not None and ckptr.latest.step == 7
        for shape in ((8,), (4, 2)):
            other = mesh_of(shape)
            load = uo.UniversalRestore(targets(params, other), targets(opt_state, other))
            got = ckptr.load_checkpointables(7, {"universal": load})["universal"]
            assert_tree_bitexact(got.params, params)
            assert_tree_bitexact(got.opt_state, opt_state)
            leaf = got.params["layers"]["w"]
            assert leaf.sharding.mesh.devices.shape == fit_shape(shape)
        meta = ckptr.load_checkpointables(7)["universal"]  # no target: the manifest
    assert isinstance(meta, ucp.Checkpoint) and meta.step == 7
    step = tmp_path / "run" / "7"
    handlers = json.loads((step / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
    assert handlers == {"universal": "ucp_jax.orbax.UniversalCheckpointableHandler"}
    assert ucp.open(step / "universal").atoms["layers.3.w"].shape == (16, 8)  # a ucp checkpoint


def test_free_functions_and_a_v0_saved_step(tmp_path, ref):
    params, opt_state = ref
    mesh, other = mesh_of((2, 4)), mesh_of((8,))
    ocp.v1.save_checkpointables(tmp_path / "free", {"u": uo.UniversalSave(_placed(params, mesh))})
    got = ocp.v1.load_checkpointables(
        tmp_path / "free", {"u": uo.UniversalRestore(targets(params, other))}
    )["u"]
    assert_tree_bitexact(got.params, params)
    with ocp.CheckpointManager(tmp_path / "v0", item_names=("u",)) as mgr:  # the v0 handler
        mgr.save(3, args=ocp.args.Composite(u=uo.UniversalSave(_placed(params, mesh),
                                                               _placed(opt_state, mesh))))  # fmt: skip
    with ocp.v1.training.Checkpointer(tmp_path / "v0") as ckptr:
        got = ckptr.load_checkpointables(
            3, {"u": uo.UniversalRestore(targets(params, other), targets(opt_state, other))}
        )["u"]
    assert_tree_bitexact(got.params, params)
    assert_tree_bitexact(got.opt_state, opt_state)


def test_what_v1_does_not_allow(tmp_path, ref):
    """No layout can be registered: ocp.v1.load cannot read a bare universal checkpoint, nor a
    checkpointable this handler saved (v1's layout takes only PyTrees there)."""
    params, _ = ref
    ucp.save(tmp_path / "bare", params)
    with pytest.raises(Exception, match=r"(?i)layout|no valid pytree"):
        ocp.v1.load(tmp_path / "bare", targets(params, mesh_of((8,))))
    assert np.asarray(ucp.open(tmp_path / "bare").read("dense.kernel")).shape == (16, 24)
    ocp.v1.save_checkpointables(tmp_path / "v1", {"universal": uo.UniversalSave(params)})
    with pytest.raises(Exception, match="as a V1 Orbax PyTree"):  # load is for PyTrees only
        ocp.v1.load(
            tmp_path / "v1", targets(params, mesh_of((8,))), checkpointable_name="universal"
        )


@pytest.mark.parametrize("api", ["v1", "v0"])
def test_a_failed_save_leaves_the_process_free_to_exit(tmp_path, api):
    """A save that fails in the handler (a leaf of the wrong type): the error is raised and the
    process exits at once. Orbax had started creating the step's folders; the v1 handler did not
    wait for them, and an Orbax thread then held the interpreter at exit until its coordination
    timeout (60 s and more; the v0 handler already waited)."""
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent(f"""
        import jax, numpy as np, orbax.checkpoint as ocp, ucp_jax.orbax as uo
        good, bad = {{"w": np.ones(4, np.float32)}}, {{"w": "a string"}}
        if {api!r} == "v1":
            with ocp.v1.training.Checkpointer({str(tmp_path / "ck")!r}) as ck:
                ck.save_checkpointables(3, {{"universal": uo.UniversalSave(good)}})
                try:
                    ck.save_checkpointables(9, {{"universal": uo.UniversalSave(bad)}})
                except TypeError as e:
                    print("refused:", e)
        else:
            m = ocp.CheckpointManager({str(tmp_path / "ck")!r})
            m.save(3, args=uo.UniversalSave(good))
            try:
                m.save(9, args=uo.UniversalSave(bad)); m.wait_until_finished()
            except TypeError as e:
                print("refused:", e)
            m.close()
        print("done")
    """)  # fmt: skip
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t
    assert p.returncode == 0, p.stderr[-2000:]
    assert "refused: leaf 'w' is a str" in p.stdout and p.stdout.rstrip().endswith("done")
    assert took < 30, f"the process took {took:.0f} s to exit"
