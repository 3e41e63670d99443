"""Orbax: UniversalCheckpointHandler in ocp.CheckpointManager, alone and in a Composite.

Async saves (device->host copy before `save` returns, write in Orbax's futures, COMMIT at Orbax's
finalize), max_to_keep, restore onto other meshes (with rules when the layout changes),
item_metadata without array reads, background errors raised by Orbax, a SIGKILLed save that never
becomes latest_step(), and a 2-process jax job. Each saved item is a plain universal checkpoint.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import assert_tree_bitexact
from helpers import float_params, mesh_of, need_devices, place, targets, trained_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mp import state
from mp.kill_worker import wrote_data
from mp.runner import run_and_kill, run_job

import ucp_jax as ucp
import ucp_jax.orbax as uo
from ucp_jax._src import cli
from ucp_jax._src.frameworks.orbax import handler as orbax_src

WORKER = Path(__file__).parent / "mp" / "orbax_worker.py"
TIMEOUT_S = 180


def _manager(root: Path, *, max_to_keep: int | None = None, **kw) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True)
    return ocp.CheckpointManager(root, options=options, **kw)


def _adamw_state(mesh, seed=0):
    params, opt_state = trained_state(optax.adamw(1e-2), float_params(seed))
    return place(params, mesh), place(opt_state, mesh)


def _no_array_reads(monkeypatch):
    """Make any TensorStore array open fail: metadata must come from the manifest alone."""
    import tensorstore as ts

    def refuse(*a, **k):
        raise AssertionError("item_metadata opened an array")

    monkeypatch.setattr(ts, "open", refuse)


def test_async_steps_max_to_keep_restore_on_other_mesh(tmp_path):
    mngr = _manager(tmp_path, max_to_keep=2)
    saved = {}
    for step in (1, 2, 3, 4):
        params, opt_state = _adamw_state(mesh_of((2, 4)), seed=step)
        saved[step] = jax.device_get((params, opt_state))
        mngr.save(step, args=uo.UniversalSave(params, opt_state))
        # The device->host copy is done when save returns: the trainer may free its arrays.
        for x in jax.tree.leaves((params, opt_state)):
            x.delete()
    mngr.wait_until_finished()
    assert mngr.all_steps() == [3, 4]
    assert mngr.latest_step() == 4
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]  # no tmp folders, old steps deleted

    # The item folder is a plain universal checkpoint: COMMIT, manifest, atoms; the CLI reads it.
    item = tmp_path / "4" / "default"
    assert (item / "COMMIT").exists() and (item / "manifest.json").exists()
    ck = ucp.open(item)
    assert ck.step == 4
    assert {"fp32", "exp_avg", "exp_avg_sq"} <= set(ck.atoms["dense.kernel"].slots)
    out = io.StringIO()
    assert cli.inspect_checkpoint(str(item), out=out) == 0
    assert "dense.kernel" in out.getvalue() and "step 4" in out.getvalue()
    assert cli.verify_checkpoint(str(item), out=io.StringIO()) == 0

    # Restore the latest onto another mesh, bit-exact, params and adamw state.
    ref_params, ref_opt = saved[4]
    mesh = mesh_of((4, 2))
    restored = mngr.restore(
        mngr.latest_step(),
        args=uo.UniversalRestore(targets(ref_params, mesh), targets(ref_opt, mesh)),
    )
    assert isinstance(restored, uo.UniversalState)
    params, opt_state = restored
    assert_tree_bitexact(ref_params, params)
    assert_tree_bitexact(ref_opt, opt_state)
    kernel = params["dense"]["kernel"]
    assert kernel.sharding == NamedSharding(mesh, P("a", "b"))
    mngr.close()


def test_item_metadata_alone_reads_no_arrays(tmp_path, monkeypatch):
    params, opt_state = _adamw_state(mesh_of((8,)))
    mngr = _manager(tmp_path)
    mngr.save(7, args=uo.UniversalSave(params, opt_state, extra={"run": "a"}))
    mngr.wait_until_finished()
    # A fresh manager (a restarted job) names its handler, as Orbax requires for metadata.
    fresh = ocp.CheckpointManager(tmp_path, item_handlers=uo.UniversalCheckpointHandler())
    _no_array_reads(monkeypatch)
    for m in (mngr, fresh):
        md = m.item_metadata(7)
        assert isinstance(md, ucp.Checkpoint)
        assert md.step == 7 and md.extra == {"run": "a"}
        emb = md.atoms["emb.embedding"]
        assert (emb.shape, emb.dtype) == ((32, 8), "bfloat16")
        assert set(emb.slots) == {"fp32", "exp_avg", "exp_avg_sq"}
        assert emb.pattern == []  # identity
        assert md.atoms["opt_state.0.count"].slots["value"].dtype == "int32"
    mngr.close()


def test_composite_with_json_item(tmp_path, monkeypatch):
    params, opt_state = _adamw_state(mesh_of((2, 4)))
    meta = {"lr": 0.01, "tokens": [1, 2, 3], "name": "run-7"}
    mngr = _manager(tmp_path, max_to_keep=3)
    for step in (10, 20):
        mngr.save(
            step,
            args=ocp.args.Composite(
                state=uo.UniversalSave(params, opt_state),
                meta=ocp.args.JsonSave(meta | {"s": step}),
            ),
        )
    mngr.wait_until_finished()
    assert mngr.all_steps() == [10, 20]
    assert (tmp_path / "20" / "state" / "COMMIT").exists()
    assert ucp.open(tmp_path / "20" / "state").step == 20

    mesh = mesh_of((1, 8))
    fresh = _manager(tmp_path)
    restored = fresh.restore(
        20,
        args=ocp.args.Composite(
            state=uo.UniversalRestore(targets(params, mesh), targets(opt_state, mesh)),
            meta=ocp.args.JsonRestore(),
        ),
    )
    assert restored.meta == meta | {"s": 20}
    assert_tree_bitexact(jax.device_get(params), restored.state.params)
    assert_tree_bitexact(jax.device_get(opt_state), restored.state.opt_state)

    # item_metadata in a Composite: the universal item's atoms, no array read.
    _no_array_reads(monkeypatch)
    md = fresh.item_metadata(20)
    assert isinstance(md.state, ucp.Checkpoint)
    assert md.state.atoms["dense.kernel"].shape == (16, 24)
    assert md.state.atoms["dense.kernel"].dtype == "float32"
    mngr.close()
    fresh.close()


def test_background_error_raised_by_orbax(tmp_path, monkeypatch):
    params = place(float_params(), mesh_of((2, 4)))
    mngr = _manager(tmp_path)
    mngr.save(1, args=uo.UniversalSave(params))
    mngr.wait_until_finished()

    def broken(self, manifest):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(orbax_src._InPlace, "commit", broken)
    mngr.save(2, args=uo.UniversalSave(params))  # the copy succeeded; the write fails later
    with pytest.raises(OSError, match="disk full"):
        mngr.wait_until_finished()
    monkeypatch.undo()
    assert mngr.latest_step() == 1
    assert ocp.CheckpointManager(tmp_path).all_steps() == [1]
    # Errors in the synchronous part (planning) are raised by save itself.
    with pytest.raises(TypeError, match="ShapeDtypeStruct"):
        mngr.save(3, args=uo.UniversalSave(targets(params, mesh_of((8,)))))
    mngr.close()


def test_sync_manager_and_plain_checkpointers(tmp_path):
    params = place(float_params(), mesh_of((8,)))
    want = jax.device_get(params)
    tgt = targets(want, mesh_of((2, 4)))
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, step_prefix="step")
    mngr = ocp.CheckpointManager(tmp_path / "m", options=options)
    mngr.save(12, args=uo.UniversalSave(params))
    assert mngr.all_steps() == [12]
    assert ucp.open(tmp_path / "m" / "step_12" / "default").step == 12  # step from the folder
    # the manager's root and a step are no checkpoints: each says which folders in it are
    # (it said only "a folder that holds no checkpoint"; `convert orbax` said "not an Orbax
    # checkpoint" of a folder that needs no conversion)
    with pytest.raises(ucp.NotACheckpointError, match=r"checkpoints: .*step_12/default"):
        ucp.open(tmp_path / "m")
    # a step folder names its universal items (it said "an Orbax checkpoint ...; import it with
    # `ucp convert orbax`", which then refused: the item is universal already)
    with pytest.raises(ucp.NotACheckpointError, match=r"an Orbax step \(_CHECKPOINT_METADATA\) "
                       r"whose items are universal checkpoints: .*step_12/default;"):  # fmt: skip
        ucp.open(tmp_path / "m" / "step_12")
    assert cli.main(["inspect", str(tmp_path / "m" / "step_12")]) == 1
    # an item of a manager's step is not deleted alone (Orbax would list a step it cannot restore)
    item = tmp_path / "m" / "step_12" / "default"
    with pytest.raises(ucp.ArgumentError, match=r"item of a step an Orbax CheckpointManager saved"):
        ucp.delete_checkpoint(item)
    assert cli.main(["rm", str(item)]) == 1
    assert ucp.open(item).step == 12
    with pytest.raises(ucp.NotACheckpointError, match=r"step_12/default is a universal checkpoint"):
        ucp.import_orbax(tmp_path / "m" / "step_12", tmp_path / "converted")
    assert_tree_bitexact(want, mngr.restore(12, args=uo.UniversalRestore(tgt)).params)
    mngr.close()
    # a manager that commits in place (Orbax's way on GCS and S3): no tmp folder to read
    from orbax.checkpoint._src.path.atomicity import CommitFileTemporaryPath

    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, step_prefix="step",
                                           temporary_path_class=CommitFileTemporaryPath)  # fmt: skip
    mngr = ocp.CheckpointManager(tmp_path / "c", options=options)
    mngr.save(5, args=uo.UniversalSave(params))
    assert ucp.open(tmp_path / "c" / "step_5" / "default").step == 5
    mngr.close()
    for ckptr in (
        ocp.AsyncCheckpointer(uo.UniversalCheckpointHandler()),
        ocp.Checkpointer(uo.UniversalCheckpointHandler()),
    ):
        path = tmp_path / type(ckptr).__name__
        ckptr.save(path, args=uo.UniversalSave(params, step=3, extra={"k": 1}))
        if isinstance(ckptr, ocp.AsyncCheckpointer):
            ckptr.wait_until_finished()
        ck = ucp.open(path)  # the path itself is the universal checkpoint
        assert (ck.step, ck.extra) == (3, {"k": 1})
        assert_tree_bitexact(want, ckptr.restore(path, args=uo.UniversalRestore(tgt)).params)
        ckptr.close()


@pytest.mark.parametrize("in_place", [False, True])
def test_an_item_saved_alone_takes_no_step_from_its_parents_name(tmp_path, in_place):
    # ocp.Checkpointer(handler).save(path) without a step: no manager, so no step, however the
    # folder above is named (it recorded 2024 for runs/exp_2024/final, and `ucp export orbax
    # --manager` then wrote a step 2024)
    from orbax.checkpoint._src.path.atomicity import CommitFileTemporaryPath

    params = place(float_params(), mesh_of((8,)))
    kw = {"temporary_path_class": CommitFileTemporaryPath} if in_place else {}
    for path in (tmp_path / "exp_2024" / "final", tmp_path / "7" / "ckpt"):
        ckptr = ocp.Checkpointer(uo.UniversalCheckpointHandler(), **kw)
        ckptr.save(path, args=uo.UniversalSave(params))
        ckptr.close()
        assert ucp.open(path).step is None
    # a manager's step still comes from its folder, committed in place or renamed
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, **kw)
    mngr = ocp.CheckpointManager(tmp_path / "exp_2024" / "run", options=options)
    mngr.save(6, args=uo.UniversalSave(params))
    mngr.wait_until_finished()
    mngr.close()
    assert ucp.open(tmp_path / "exp_2024" / "run" / "6" / "default").step == 6


def _ref_fuse(subs, n, axis):
    """The fused leaf for TP degree n: concat over shards r of concat_k(sub_k[r-th of n])."""
    parts = [np.split(s, n, axis=axis) for s in subs]
    return np.concatenate([np.concatenate([p[r] for p in parts], axis) for r in range(n)], axis)


def test_restore_with_rules_when_tp_changes(tmp_path):
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    sizes = (16, 8, 8)
    rng = np.random.default_rng(5)
    subs = [rng.standard_normal((12, s)).astype(np.float32) for s in sizes]
    rules = [(r"(.*\.)?qkv", ucp.Fused(sizes, axis=1, shard_axis="tensor"))]
    smesh = mesh_of((2, 4), ("data", "tensor"))
    leaf = jax.device_put(_ref_fuse(subs, 4, 1), NamedSharding(smesh, P(None, "tensor")))
    params = {"attn": {"qkv": leaf}, "w": place(rng.standard_normal((8, 4), np.float32), smesh)}
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)
    _, opt_state = opt.update(jax.tree.map(lambda p: p * 0.5 + 1.0, params), opt_state, params)
    mngr = _manager(tmp_path)
    mngr.save(1, args=uo.UniversalSave(params, opt_state, rules=rules))
    mngr.wait_until_finished()
    ck = mngr.item_metadata(1)
    assert ck.atoms["attn.qkv"].shape == (12, 32)
    assert ck.atoms["attn.qkv"].pattern[0]["type"] == "Fused"
    np.testing.assert_array_equal(ck.read("attn.qkv"), np.concatenate(subs, 1))  # the n=1 atom

    dmesh = mesh_of((4, 2), ("data", "tensor"))  # TP 4 -> 2: the fused leaf's order changes
    pt = {
        "attn": {
            "qkv": jax.ShapeDtypeStruct(
                (12, 32), np.float32, sharding=NamedSharding(dmesh, P(None, "tensor"))
            )
        },
        "w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(dmesh, P())),
    }
    ot = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(dmesh, P())),
        jax.eval_shape(opt.init, pt),
    )
    p2, o2 = mngr.restore(1, args=uo.UniversalRestore(pt, ot, rules=rules))
    want = _ref_fuse(subs, 2, 1)
    assert not np.array_equal(want, np.asarray(leaf))  # the layouts really differ
    np.testing.assert_array_equal(np.asarray(p2["attn"]["qkv"]), want)
    assert p2["attn"]["qkv"].sharding == pt["attn"]["qkv"].sharding
    # the moments follow the same pattern: mu = 0.1 * (0.5 * w + 1)
    mu_want = _ref_fuse([0.1 * (0.5 * s + 1) for s in subs], 2, 1)
    np.testing.assert_allclose(np.asarray(o2[0].mu["attn"]["qkv"]), mu_want, rtol=1e-6)
    assert int(o2[0].count) == 1
    # without rules, the rules saved in the manifest are used (Fused takes n from the target mesh)
    p3, _ = mngr.restore(1, args=uo.UniversalRestore(pt))
    np.testing.assert_array_equal(np.asarray(p3["attn"]["qkv"]), want)
    mngr.close()


# ------------------------------------------------------------------------------- SIGKILL


def _run_and_kill(mode: str, root: Path, log: Path) -> None:
    """Start the trainer, SIGKILL it when it says so; fail with its output if it never does."""
    run_and_kill([str(WORKER), "kill", mode, str(root)], log, TIMEOUT_S, ["STEP1 DONE"],
                 UCP_INFLIGHT_BYTES=str(8 << 20))  # fmt: skip


@pytest.mark.parametrize("mode", ["writing", "finalize"])
def test_sigkilled_save_never_becomes_latest(tmp_path, mode):
    root = tmp_path / "ckpt"
    _run_and_kill(mode, root, tmp_path / "worker.log")
    tmps = [n for n in os.listdir(root) if n.startswith("2.orbax-checkpoint-tmp")]
    assert tmps, os.listdir(root)  # killed inside the save
    items = list((root / tmps[0]).iterdir())
    item = next(p for p in items if p.name.startswith("default"))
    assert not (item / "COMMIT").exists()  # never a universal checkpoint
    assert wrote_data(item)  # chunks were written before the kill
    if mode == "finalize":
        assert (item / "manifest.json").exists()  # everything written, then killed
    with pytest.raises(ucp.NotACheckpointError):
        ucp.open(item)

    mngr = _manager(root)
    assert mngr.all_steps() == [1]
    assert mngr.latest_step() == 1
    ref = float_params()
    params, _ = mngr.restore(1, args=uo.UniversalRestore(targets(ref, mesh_of((4, 2)))))
    assert_tree_bitexact(ref, params)
    # the next save of step 2 replaces the leftovers and is published
    mngr.save(2, args=uo.UniversalSave(place(float_params(1), mesh_of((8,)))))
    mngr.wait_until_finished()
    assert mngr.latest_step() == 2
    assert ucp.open(root / "2" / "default").step == 2
    mngr.close()


# -------------------------------------------------------------------------- 2 processes


def test_two_processes_save_2x4_restore_4x2(tmp_path):
    run_job(lambda i, addr: [str(WORKER), "job", str(i), addr, str(tmp_path)], 2, TIMEOUT_S)
    reports = [json.loads((tmp_path / f"report_{i}.json").read_text()) for i in range(2)]
    for r in reports:
        assert r["shards_checked"] > 0 and r["steps"] == [1, 2]
        assert {"dense.kernel", "head", "layers.w", "scale"} <= set(r["atoms"])
    assert reports[0]["shards_checked"] == reports[1]["shards_checked"]

    # Here, in one process with 8 devices: the step the job saved restores onto (2, 2, 2).
    root = tmp_path / "ckpt"
    assert sorted(os.listdir(root)) == ["1", "2"]
    ck = ucp.open(root / "2" / "default")
    assert ck.step == 2 and ck.extra == {"job": "2x4"}
    assert ck.manifest.source["process_count"] == 2
    ref_params, ref_opt = state.reference_state()
    mesh = mesh_of((2, 2, 2))
    pt, ot = state.targets_on(ref_params, mesh), state.targets_on(ref_opt, mesh)
    mngr = ocp.CheckpointManager(root)
    assert mngr.latest_step() == 2
    params, opt_state = mngr.restore(2, args=uo.UniversalRestore(pt, ot))
    assert state.check_shards(params, ref_params, pt, "params") > 0
    assert state.check_shards(opt_state, ref_opt, ot, "opt_state") > 0
    # step 1 held params + 1
    p1, _ = mngr.restore(1, args=uo.UniversalRestore(pt))
    np.testing.assert_array_equal(
        np.asarray(p1["dense"]["kernel"]), np.asarray(ref_params["dense"]["kernel"]) + 1
    )
    mngr.close()
