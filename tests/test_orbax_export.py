"""`ucp export orbax` / `export_orbax`: a plain Orbax checkpoint that Orbax alone restores onto
any sharding, as a tree of atoms or in the training program's own layout."""

from __future__ import annotations

import os

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import assert_tree_bitexact
from helpers import mesh_of, need_devices, place, targets
from mp import state

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli
from ucp_jax._src.errors import ArgumentError, MismatchError
from ucp_jax._src.frameworks.orbax.export import export_orbax

STACK = [(r"layers\.w", ucp.Stacked("layers.{i}.w"))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A state saved from a (2, 4) mesh, the scanned [4, ...] leaf as per-layer atoms."""
    params, opt_state = state.reference_state()
    mesh = mesh_of((2, 4))
    path = tmp_path_factory.mktemp("ucp") / "step_2"
    ucp.save(path, place(params, mesh), place(opt_state, mesh), step=2, rules=STACK)
    return path, params, opt_state


def _restore(path, tree):
    with ocp.StandardCheckpointer() as ck:
        return ck.restore(path, tree)


def test_atoms_tree_restores_with_orbax_alone_onto_a_new_sharding(tmp_path, saved):
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    path, _, _ = saved
    dst = tmp_path / "orbax"
    assert cli(["export", "orbax", str(path), str(dst)]) == 0
    with ocp.StandardCheckpointer() as ck:
        meta = ck.metadata(dst)
    tree = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta.item_metadata.tree)
    got = _restore(dst, targets(tree, mesh_of((4, 2)), style="fsdp"))
    ck = ucp.open(path)
    assert int(got["step"]) == 2
    for name, info in ck.atoms.items():
        for slot in info.slots:
            if info.role is not None:
                node = got
                for k in name.split("."):
                    node = node[k]
            else:
                node = got["params"] if slot == "fp32" else got["opt_state"][slot]
                for k in name.split("."):
                    node = node[k]
            assert isinstance(node, jax.Array)
            assert np.asarray(node).tobytes() == np.asarray(ck.read(name, slot)).tobytes(), name
    leaf = got["params"]["layers"]["0"]["w"]
    assert len(leaf.sharding.device_set) == 8  # laid out on the new mesh


def test_targets_give_the_programs_own_layout_on_any_sharding(tmp_path, saved):
    path, params, opt_state = saved
    mesh = mesh_of((4, 2))
    pt, ot = targets(params, mesh), targets(opt_state, mesh)
    dst = export_orbax(path, tmp_path / "orbax", params_target=pt, opt_state_target=ot,
                       rules=STACK)  # fmt: skip
    other = mesh_of((8,))
    want = {"params": params, "opt_state": opt_state}  # the program's own target: no step
    got = _restore(dst, targets(want, other, style="fsdp"))
    assert_tree_bitexact(got["params"], params)
    assert_tree_bitexact(jax.tree.leaves(got["opt_state"]), jax.tree.leaves(opt_state))
    assert isinstance(got["opt_state"][0], optax.ScaleByAdamState)
    dst = export_orbax(path, tmp_path / "orbax_step", params_target=pt, opt_state_target=ot,
                       rules=STACK, step_leaf=True)  # fmt: skip
    got = _restore(dst, targets({**want, "step": np.int64(2)}, other, style="fsdp"))
    assert got["step"] == 2


def test_manager_layout(tmp_path, saved):
    path, _, _ = saved
    root = tmp_path / "root"
    assert cli(["export", "orbax", str(path), str(root), "--manager", "--item", "state"]) == 0
    assert (root / "2" / "state").is_dir()
    with ocp.CheckpointManager(root) as mgr:
        assert mgr.latest_step() == 2
        got = mgr.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    assert int(got["state"]["step"]) == 2
    assert cli(["export", "orbax", str(path), str(root), "--manager"]) == 1  # exists


def test_names_that_make_no_tree_are_refused(tmp_path):
    ucp.save(tmp_path / "c", {"a": np.zeros(2, np.float32), "a.b": np.ones(2, np.float32)})
    with pytest.raises(MismatchError, match="targets"):
        export_orbax(tmp_path / "c", tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("url", ["s3://bucket/run/exp", "gs://bucket/exp"])
def test_orbax_to_or_from_a_url_is_refused_not_written_locally(tmp_path, saved, monkeypatch,
                                                                 capsys, url):  # fmt: skip
    """Orbax checkpoints are read and written through Orbax's own API on local folders: a URL
    is refused, not turned into a local folder named `s3:` (what `ucp export orbax` did)."""
    path, _, _ = saved
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ucp.UcpError, match="local folder here"):
        export_orbax(path, url)
    with pytest.raises(ucp.UcpError, match="local folder here"):
        ucp.import_orbax(url, tmp_path / "ck")
    capsys.readouterr()
    assert cli(["export", "orbax", str(path), url]) == 1
    assert cli(["convert", "orbax", url, str(tmp_path / "ck2")]) == 1
    err = capsys.readouterr().err
    assert err.count("local folder here") == 2 and "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("exporter", ["orbax", "maxtext"])
def test_an_export_onto_its_own_source_is_refused(saved, tmp_path, exporter):
    path, _, _ = saved
    export = export_orbax if exporter == "orbax" else ucp.export_maxtext
    # the checkpoint itself, a folder holding it, a folder inside it
    for dst, how in ((path, "be"), (os.path.dirname(path), "hold"), (os.path.join(path, "x"), "lie inside")):  # fmt: skip
        with pytest.raises(ArgumentError, match=f"would {how} the checkpoint it is exported from"):
            export(path, dst, overwrite=True)
    assert ucp.open(path).step == 2 and not os.path.exists(os.path.join(path, "x"))


def test_a_step_without_a_manager_is_refused(saved, tmp_path, capsys):
    path, _, _ = saved
    with pytest.raises(ucp.UcpError, match="pass manager=True"):
        export_orbax(path, tmp_path / "out", step=3)
    assert cli(["export", "orbax", str(path), str(tmp_path / "out"), "--step", "3"]) == 1
    assert "--manager" in capsys.readouterr().err and not (tmp_path / "out").exists()
