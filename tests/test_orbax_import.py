"""`ucp convert orbax` / `ucp.import_orbax` on checkpoints Orbax itself wrote.

Each checkpoint is converted, restored by `ucp.restore` onto another mesh, and compared bit for
bit with what Orbax's own restore gives; Adam's moments must be the `exp_avg` / `exp_avg_sq` slots
of their parameter's atom. Damaged or foreign input must give a clear UcpError and leave nothing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import assert_tree_bitexact
from flax import nnx
from helpers import fit_shape, mesh_of, place, targets
from mp import state
from mp.runner import run_job

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli

WORKER = Path(__file__).parent / "mp" / "orbax_native_worker.py"
STACK = [(r"layers\.w", ucp.Stacked("layers.{i}.w"))]  # the scanned [4, 16, 8] leaf, per layer


@pytest.fixture(scope="module")
def ref() -> tuple:
    """Params of several dtypes (bf16, a scalar, a [4, ...] scanned stack) and adamw state."""
    return state.reference_state()


def _orbax_restore(path: Path, tree: object) -> object:
    """What Orbax restores from `path` onto the (4, 2) mesh: the reference for every test."""
    with ocp.StandardCheckpointer() as ck:
        return ck.restore(path, targets(tree, mesh_of((4, 2))))


def _check_moments(dst: Path, opt_state: object) -> None:
    """Adam's mu / nu are slots of their parameter's atom; the count keeps its optax role."""
    ck = ucp.open(dst)
    adam = opt_state[0]
    for name, slot, tree in (("dense.kernel", "exp_avg", adam.mu), ("head", "exp_avg_sq", adam.nu)):
        leaf = tree["dense"]["kernel"] if name == "dense.kernel" else tree["head"]
        got = ck.read(name, slot)
        assert got.dtype == np.asarray(leaf).dtype
        assert got.tobytes() == np.asarray(leaf).tobytes(), (name, slot)
    assert ck.atoms["opt_state.0.count"].role == "ScaleByAdamState.count"
    assert not any(".mu." in n or ".nu." in n for n in ck.atoms), sorted(ck.atoms)


def _leftovers(parent: Path) -> list[str]:
    return sorted(os.listdir(parent))


# -------------------------------------------------------------------- StandardCheckpointer


@pytest.mark.parametrize("layout", ["ocdbt-zarr2", "files-zarr3"])
def test_standard_checkpointer_2x4_converts_and_restores_on_4x2(tmp_path, ref, layout):
    ref_params, ref_opt = ref
    save = mesh_of((2, 4))
    params, opt_state = place(ref_params, save), place(ref_opt, save)
    src = tmp_path / "orbax"
    if layout == "ocdbt-zarr2":
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(src, {"params": params, "opt_state": opt_state, "step": 42})
    else:
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(src, args=ocp.args.PyTreeSave(
                {"params": params, "opt_state": opt_state, "step": 42}))  # fmt: skip
        assert not (src / "manifest.ocdbt").exists()
    want = _orbax_restore(src, {"params": ref_params, "opt_state": ref_opt, "step": np.int64(42)})

    dst = tmp_path / "ucp"
    assert cli(["convert", "orbax", str(src), str(dst)]) == 0
    ck = ucp.open(dst)
    assert ck.step == 42 and ck.manifest.source["framework"] == "orbax"
    assert set(ck.atoms["dense.kernel"].slots) == {"fp32", "exp_avg", "exp_avg_sq"}
    _check_moments(dst, ref_opt)
    other = mesh_of((4, 2))
    p, o = ucp.restore(dst, targets(ref_params, other), targets(ref_opt, other))
    assert_tree_bitexact(p, want["params"])
    assert_tree_bitexact(o, want["opt_state"])
    assert p["dense"]["kernel"].sharding.mesh.devices.shape == fit_shape((4, 2))
    assert cli(["verify", str(dst)]) == 0

    # the same checkpoint with the scanned leaf as per-layer atoms (rules recorded: no rules
    # are needed to restore into the stacked layout)
    if layout == "ocdbt-zarr2":
        ucp.import_orbax(src, tmp_path / "stacked", rules=STACK)
        ck = ucp.open(tmp_path / "stacked")
        assert {f"layers.{i}.w" for i in range(4)} <= set(ck.atoms)
        assert ck.atoms["layers.2.w"].shape == (16, 8)
        assert set(ck.atoms["layers.2.w"].slots) == {"fp32", "exp_avg", "exp_avg_sq"}
        p, o = ucp.restore(tmp_path / "stacked", targets(ref_params, other),
                           targets(ref_opt, other))  # fmt: skip
        assert_tree_bitexact(p, want["params"])
        assert_tree_bitexact(o, want["opt_state"])


def test_nnx_state_saved_by_orbax_gets_model_names(tmp_path):
    """`nnx.state(model)` saved by Orbax: atoms are 'up.kernel', not 'up.kernel.value'."""

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.up = nnx.Linear(8, 16, rngs=rngs)
            self.down = nnx.Linear(16, 8, rngs=rngs)

    st = nnx.state(Model(nnx.Rngs(0)), nnx.Param)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "nnx", place(st, mesh_of((2, 4))))
    ucp.import_orbax(tmp_path / "nnx", tmp_path / "ucp")
    assert sorted(ucp.open(tmp_path / "ucp").atoms) == [
        "down.bias", "down.kernel", "up.bias", "up.kernel"]  # fmt: skip
    target = nnx.state(Model(nnx.Rngs(1)), nnx.Param)
    got, _ = ucp.restore(tmp_path / "ucp", targets(target, mesh_of((4, 2))))
    assert_tree_bitexact(nnx.to_pure_dict(got), jax.device_get(nnx.to_pure_dict(st)))


# ------------------------------------------------------------------------- CheckpointManager


def test_checkpoint_manager_composite_items_several_steps(tmp_path, ref):
    ref_params, ref_opt = ref
    save = mesh_of((2, 4))
    params, opt_state = place(ref_params, save), place(ref_opt, save)
    root = tmp_path / "mngr"
    with ocp.CheckpointManager(root) as mngr:
        for step in (1, 2, 3):  # each step's params differ: a wrong step would show
            bumped = jax.tree.map(lambda x, s=step: x + s, params)
            mngr.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(bumped), opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave({"run": "demo"})))  # fmt: skip
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2, 3]
        want = mngr.restore(2, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(targets(ref_params, mesh_of((4, 2)))),
            opt_state=ocp.args.StandardRestore(targets(ref_opt, mesh_of((4, 2))))))  # fmt: skip

    other = mesh_of((2, 2, 2))
    pt, ot = targets(ref_params, other), targets(ref_opt, other)
    latest = ucp.import_orbax(root, tmp_path / "latest")  # the root: its latest step
    assert ucp.open(latest).step == 3
    step2 = ucp.import_orbax(root, tmp_path / "step2", step=2)
    ck = ucp.open(step2)
    assert ck.step == 2 and ck.manifest.source["orbax"]["items"] == ["opt_state", "params"]
    p, o = ucp.restore(step2, pt, ot)
    assert_tree_bitexact(p, want["params"])
    assert_tree_bitexact(o, want["opt_state"])
    _check_moments(step2, ref_opt)
    p3, _ = ucp.restore(latest, pt)
    three = np.asarray(ref_params["dense"]["kernel"]) + np.float32(3)
    assert np.asarray(p3["dense"]["kernel"]).tobytes() == three.tobytes()
    # one item of a step folder, by the CLI
    assert cli(["convert", "orbax", str(root / "1"), str(tmp_path / "p1"), "--item", "params"]) == 0
    ck = ucp.open(tmp_path / "p1")
    assert ck.step == 1 and set(ck.atoms["dense.kernel"].slots) == {"fp32"}


# ------------------------------------------------------------------------------ 2 processes


def test_checkpoint_written_by_two_processes(tmp_path, ref):
    run_job(lambda i, addr: [str(WORKER), str(i), addr, str(tmp_path)], 2, 300)
    ref_params, ref_opt = ref
    src = tmp_path / "orbax"
    want = _orbax_restore(src, {"params": ref_params, "opt_state": ref_opt, "step": np.int64(7)})
    assert_tree_bitexact(want["params"], ref_params)  # Orbax itself reads back what was saved
    dst = ucp.import_orbax(src, tmp_path / "ucp", max_inflight_bytes=4096)  # tiny budget
    assert ucp.open(dst).step == 7
    other = mesh_of((4, 2))
    p, o = ucp.restore(dst, targets(ref_params, other), targets(ref_opt, other))
    assert_tree_bitexact(p, want["params"])
    assert_tree_bitexact(o, want["opt_state"])
    _check_moments(Path(dst), ref_opt)


# ----------------------------------------------------------------------- damaged and foreign


@pytest.fixture(scope="module")
def small_orbax(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("small") / "orbax"
    params = {"a": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(5, np.float32)}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(src, {"params": params, "opt_state": optax.adam(0.1).init(params)})
    return src


def _damaged(small_orbax: Path, tmp_path: Path, how: str) -> Path:
    src = tmp_path / "src"
    if how == "chunk-missing":  # one zarr3 folder per array: metadata intact, data gone
        params = {"a": np.ones((64, 8), np.float32), "z": np.ones(4, np.float32)}
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(src, args=ocp.args.PyTreeSave({"params": params}))
        chunks = [f for f in (src / "params.z").rglob("*") if f.is_file() and f.name != "zarr.json"]
        assert chunks
        for f in chunks:
            f.unlink()
        return src
    shutil.copytree(small_orbax, src)
    if how == "metadata-garbage":
        (src / "_METADATA").write_text("{not json")
    elif how == "metadata-truncated":
        text = (src / "_METADATA").read_text()
        (src / "_METADATA").write_text(text[: len(text) // 2])
    elif how == "data-missing":
        for d in src.rglob("d"):
            for f in d.iterdir():
                f.unlink()
    elif how == "data-corrupt":
        for d in src.rglob("d"):
            for f in d.iterdir():
                raw = bytearray(f.read_bytes())
                raw[len(raw) // 2 :] = b"\xff" * (len(raw) - len(raw) // 2)
                f.write_bytes(bytes(raw))
    elif how == "ocdbt-manifest-gone":
        (src / "manifest.ocdbt").unlink()
    return src


@pytest.mark.parametrize(
    "how",
    [
        "metadata-garbage",
        "metadata-truncated",
        "data-missing",
        "data-corrupt",
        "ocdbt-manifest-gone",
        "chunk-missing",
    ],
)
def test_damaged_orbax_checkpoint_clear_error_nothing_left(tmp_path, small_orbax, how):
    src = _damaged(small_orbax, tmp_path, how)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ucp.UcpError) as e:
        ucp.import_orbax(src, out / "ucp")
    assert isinstance(e.value, ucp.OrbaxImportError | ucp.NotACheckpointError), repr(e.value)
    assert str(src) in str(e.value), str(e.value)
    assert _leftovers(out) == [], _leftovers(out)
    print(how, "->", e.value)  # shown with -s: what a user reads


def test_not_an_orbax_checkpoint(tmp_path, small_orbax, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "empty").mkdir()
    ucp.save(tmp_path / "universal", {"w": np.ones(3, np.float32)})
    (tmp_path / "file").write_text("x")
    for src in ("empty", "universal", "file", "missing"):
        with pytest.raises(ucp.NotACheckpointError, match=r"Orbax|no such folder"):
            ucp.import_orbax(tmp_path / src, out / "ucp")
    with pytest.raises(ucp.NotACheckpointError, match="no PyTree item 'state'"):
        ucp.import_orbax(small_orbax.parent, out / "ucp", item="state")
    assert _leftovers(out) == []
    # the CLI: one line, exit 1, nothing written
    assert cli(["convert", "orbax", str(tmp_path / "empty"), str(out / "ucp")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an Orbax checkpoint" in err[0], err
    assert _leftovers(out) == []
    # an existing destination is refused, and kept
    ucp.import_orbax(small_orbax, out / "ucp")
    with pytest.raises(FileExistsError):
        ucp.import_orbax(small_orbax, out / "ucp")
    assert ucp.open(out / "ucp").atoms.keys() >= {"a", "b"}
