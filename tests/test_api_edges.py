"""The public API at its edges, each case a user hit: numpy is the referee for values and indices.

An async save of numpy leaves changed after it returned; a save into the empty folder a script
made; overwrite=True onto a folder of someone's files; Python numbers in a Linen TrainState;
64-bit leaves with JAX's 64-bit types off; ``Checkpoint.read`` with numpy's indices; targets whose
shardings do not divide; specs given per subtree; a bare array, a traced or a donated leaf, a
float step; checkpoint lists in step order; ``~`` in a path.
"""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp


@pytest.fixture
def mesh() -> jax.sharding.Mesh:
    return ucp.make_mesh(data=4, tensor=2)


# ------------------------------------------------------------------------------ saving


def test_async_save_keeps_numpy_leaves_as_they_were_when_it_returned(tmp_path) -> None:
    x = {"w": np.full((256, 64), 1.0, np.float32), "b": np.arange(8, dtype=np.int32)}
    want = {k: v.copy() for k, v in x.items()}
    h = ucp.async_save(tmp_path / "ck", x, step=1)
    x["w"][:] = 99.0  # the trainer goes on and changes its arrays in place
    x["b"] += 5
    h.wait()
    got, _ = ucp.restore(tmp_path / "ck", want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("how", ["save", "async_save", "overwrite"])
def test_save_into_an_empty_folder_made_for_it(tmp_path, how: str) -> None:
    d = tmp_path / "ck"
    os.makedirs(d)
    x = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    if how == "async_save":
        ucp.async_save(d, x, step=3).wait()
    else:
        ucp.save(d, x, step=3, overwrite=how == "overwrite")
    assert ucp.open(d).step == 3
    np.testing.assert_array_equal(ucp.restore(d, x)[0]["w"], x["w"])


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_other_files_is_never_replaced(tmp_path, overwrite: bool) -> None:
    d = tmp_path / "run"
    (d / "logs").mkdir(parents=True)
    (d / "notes.txt").write_text("precious")
    (d / "logs" / "train.log").write_text("log")
    with pytest.raises(FileExistsError, match=r"not a checkpoint's \(\['logs', 'notes.txt'\]\)"):
        ucp.save(d, {"w": np.ones(4, np.float32)}, overwrite=overwrite)
    assert sorted(os.listdir(d)) == ["logs", "notes.txt"]
    assert (d / "notes.txt").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no staging folder or lock left


def test_files_added_to_a_checkpoint_are_never_replaced(tmp_path) -> None:
    # a committed checkpoint with a file of the user's beside it (an evaluation's results), and
    # a folder of someone's files one of which is named COMMIT: an overwrite replaces the whole
    # folder, so both are refused, and nothing in them changes
    d = tmp_path / "step_100"
    ucp.save(d, {"w": np.ones(4, np.float32)}, step=100)
    (d / "eval_results.json").write_text('{"acc": 0.91}')
    before = sorted(os.listdir(d))
    with pytest.raises(FileExistsError, match=r"not a checkpoint's \(\['eval_results.json'\]\)"):
        ucp.save(d, {"w": np.zeros(4, np.float32)}, step=100, overwrite=True)
    assert sorted(os.listdir(d)) == before
    np.testing.assert_array_equal(ucp.restore(d, {"w": np.zeros(4, np.float32)})[0]["w"], 1.0)
    q = tmp_path / "thesis"
    q.mkdir()
    (q / "COMMIT").write_text("not a checkpoint's")
    (q / "thesis.tex").write_text("precious")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=r"not a checkpoint's \(\['thesis.tex'\]\)"):
            ucp.save(q, {"w": np.ones(4, np.float32)}, overwrite=overwrite)
    assert (q / "thesis.tex").read_text() == "precious"
    assert sorted(os.listdir(tmp_path)) == ["step_100", "thesis"]  # no staging folder left


def test_a_file_at_the_path_is_refused_before_writing(tmp_path) -> None:
    f = tmp_path / "ck"
    f.write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        ucp.save(f, {"w": np.ones(4, np.float32)}, overwrite=True)
    assert f.read_text() == "x" and sorted(os.listdir(tmp_path)) == ["ck"]


def test_an_unfinished_checkpoint_is_replaced_only_with_overwrite(tmp_path) -> None:
    d = tmp_path / "ck"
    ucp.save(d, {"w": np.zeros(4, np.float32)}, step=1)
    os.remove(d / "COMMIT")  # what a save stopped before its commit leaves in place
    x = {"w": np.ones(4, np.float32)}
    with pytest.raises(FileExistsError, match="unfinished checkpoint"):
        ucp.save(d, x, step=2)
    ucp.save(d, x, step=2, overwrite=True)
    assert ucp.open(d).step == 2
    np.testing.assert_array_equal(ucp.restore(d, x)[0]["w"], x["w"])


def test_a_bare_array_is_refused_with_the_fix(tmp_path, mesh) -> None:
    a = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ucp.UnsafePathError, match="single array") as e:
        ucp.save(tmp_path / "a", a)
    assert "Renamed" in str(e.value) and not (tmp_path / "a").exists()
    ucp.save(tmp_path / "b", a, rules=[(r"", ucp.Renamed("x"))])
    got, _ = ucp.restore(tmp_path / "b", np.zeros(8, np.float32), rules=[(r"", ucp.Renamed("x"))])
    np.testing.assert_array_equal(got, np.arange(8, dtype=np.float32))
    # a dict key '' names a leaf '' too: the message says so, and its rule renames it
    tree = {"": np.ones(2, np.float32), "b": np.zeros(2, np.float32)}
    with pytest.raises(ucp.UnsafePathError, match="a dict key at its top is ''"):
        ucp.save(tmp_path / "c", tree)
    ucp.save(tmp_path / "c", tree, rules=[(r"^$", ucp.Renamed("empty"))])
    assert sorted(ucp.open(tmp_path / "c").atoms) == ["b", "empty"]


def test_traced_and_donated_leaves_are_named(tmp_path) -> None:
    @jax.jit
    def inside(x):
        ucp.save(tmp_path / "jit", {"a": x})
        return x

    with pytest.raises(TypeError, match=r"\['a'\] is a traced value"):
        inside(jnp.ones(4))
    y = jnp.ones(4)
    jax.jit(lambda v: v + 1, donate_argnums=0)(y)
    if not y.is_deleted():  # the backend may keep a buffer it cannot reuse
        y.delete()
    with pytest.raises(ValueError, match=r"\['y'\] was deleted \(donated"):
        ucp.save(tmp_path / "don", {"y": y})
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize(
    "step", [1.5, "10", 2.0, np.float32(3), True, np.array([1, 2]), np.zeros((0,), np.int32)]
)
def test_a_step_that_is_not_an_integer_is_refused(tmp_path, step: object) -> None:
    with pytest.raises(TypeError, match="step must be an integer"):
        ucp.save(tmp_path / "ck", {"w": np.ones(2, np.float32)}, step=step)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "step", [jnp.asarray(7, jnp.int32), np.array([7]), jnp.asarray([[7]], jnp.uint32)]
)
def test_a_step_array_of_one_integer_is_taken(tmp_path, step: object) -> None:
    ucp.save(tmp_path / "ck", {"w": np.ones(2, np.float32)}, step=step)
    assert ucp.open(tmp_path / "ck").step == 7


# ----------------------------------------------------------------------------- restoring


def test_python_numbers_come_back_as_python_numbers(tmp_path, mesh) -> None:
    flax_ts = pytest.importorskip("flax.training.train_state")
    import optax

    params = {"w": jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("data")))}
    ts = flax_ts.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    ts = ts.replace(step=12)
    state = {"ts": ts, "lr": 0.25, "flag": True, "n": 3}
    ucp.save(tmp_path / "ck", state, step=12)
    target, _ = ucp.targets(state, mesh, P())  # Linen's step=0 is an int: no crash
    got, _ = ucp.restore(tmp_path / "ck", target)
    assert got["ts"].step == 12 and type(got["ts"].step) is int
    assert (got["lr"], got["flag"], got["n"]) == (0.25, True, 3)
    assert [type(got[k]) for k in ("lr", "flag", "n")] == [float, bool, int]
    np.testing.assert_array_equal(got["ts"].params["w"], params["w"])
    # a complex number is a Python number too; an int beyond 64 bits is named, not 'dtype object'
    ucp.save(tmp_path / "c", {"z": 1.5 - 2j})
    got, _ = ucp.restore(tmp_path / "c", {"z": 0j})
    assert got["z"] == 1.5 - 2j and type(got["z"]) is complex
    with pytest.raises(TypeError, match="leaf 'big' is a Python int of 71 bits, beyond"):
        ucp.save(tmp_path / "b", {"big": 2**70})


def test_64_bit_leaves_are_not_narrowed_silently(tmp_path, mesh) -> None:
    assert not jax.config.jax_enable_x64
    x = {"i": np.array([2**40, 3], np.int64), "d": np.array([1e300, 0.5], np.float64)}
    ucp.save(tmp_path / "ck", x)
    target, _ = ucp.targets(x, mesh, P())
    with pytest.raises(ucp.RestorePlanError, match="64-bit types are off") as e:
        ucp.restore(tmp_path / "ck", target)
    assert "'i'" in str(e.value) and "'d'" in str(e.value)
    got, _ = ucp.restore(tmp_path / "ck", {k: np.zeros_like(v) for k, v in x.items()})
    for k in x:  # numpy targets keep every bit
        np.testing.assert_array_equal(got[k], x[k])


def test_a_sharding_that_does_not_divide_is_one_planned_problem(tmp_path, mesh) -> None:
    ucp.save(tmp_path / "ck", {"w": np.ones((5, 4), np.float32), "v": np.ones(8, np.float32)})
    bad = {
        "w": jax.ShapeDtypeStruct((5, 4), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
        "v": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
    }
    report = ucp.plan(tmp_path / "ck", bad)  # reported, not raised
    assert [(p.leaf, p.kind) for p in report.problems] == [("w", "sharding")]
    with pytest.raises(ucp.RestorePlanError, match=r"'w' of shape \(5, 4\) cannot take"):
        ucp.restore(tmp_path / "ck", bad)


def test_specs_per_subtree_and_a_spec_that_does_not_fit(mesh) -> None:
    params = {"enc": {"w": np.ones((8, 4)), "b": np.ones(8)}, "dec": {"w": np.ones((4, 8))}}
    t, _ = ucp.targets(params, mesh, {"enc": P("data"), "dec": P(None, "tensor")})
    assert t["enc"]["w"].sharding.spec == t["enc"]["b"].sharding.spec == P("data")
    assert t["dec"]["w"].sharding.spec == P(None, "tensor")
    with pytest.raises(ValueError, match="does not match params"):
        ucp.targets(params, mesh, {"enc": P("data")})
    with pytest.raises(ValueError, match=r"leaf 'enc.b' of shape \(8,\) cannot take"):
        ucp.targets(params, mesh, P("data", "tensor"))


INDICES = {
    "neg": np.s_[-1], "neg-slice": np.s_[-3:], "neg-col": np.s_[:, -1], "past-end": np.s_[6:20],
    "reverse": np.s_[::-1], "reverse-step": np.s_[-2::-3, 1], "step": np.s_[1::2, ::3],
    "ellipsis": np.s_[..., 2], "newaxis": np.s_[None, 2, :], "empty": np.s_[8:], "int": np.s_[3],
    "neg-empty": np.s_[5:2], "all": np.s_[...],
}  # fmt: skip


@pytest.mark.parametrize("which", list(INDICES))
def test_read_takes_numpy_indices_as_numpy_does(tmp_path, mesh, which: str) -> None:
    w = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    ucp.save(tmp_path / "ck", {"w": jax.device_put(w, NamedSharding(mesh, P("data", "tensor")))})
    got = ucp.open(tmp_path / "ck").read("w", "fp32", INDICES[which])
    want = w[INDICES[which]]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("index", [np.s_[8], np.s_[-9], np.s_[0, 6], np.s_[1, 2, 3], np.s_[[1, 2]]])
def test_read_out_of_range_is_an_index_error_not_damage(tmp_path, index: object) -> None:
    w = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    ucp.save(tmp_path / "ck", {"w": w})
    with pytest.raises(IndexError) as e:
        ucp.open(tmp_path / "ck").read("w", "fp32", index)
    assert not isinstance(e.value, ucp.ChecksumError) and "'w'" in str(e.value)
    if isinstance(index, list):  # a fancy index: numpy takes it, a region read does not
        assert "only basic indices" in str(e.value)
        return
    with pytest.raises(IndexError):
        w[index]  # numpy refuses them too


# ----------------------------------------------------------------------------- paths


def test_checkpoints_are_listed_in_step_order(tmp_path) -> None:
    for s in (1, 2, 9, 10, 100, 11):
        ucp.save(tmp_path / f"step_{s}", {"w": np.ones(2, np.float32)}, step=s)
    names = [os.path.basename(p) for p in ucp.list_checkpoints(tmp_path)]
    assert names == ["step_1", "step_2", "step_9", "step_10", "step_11", "step_100"]
    for old in ucp.list_checkpoints(tmp_path)[:-2]:  # keep the latest two
        ucp.delete_checkpoint(old)
    assert [ucp.open(p).step for p in ucp.list_checkpoints(tmp_path)] == [11, 100]


def test_a_tilde_is_the_home_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    ucp.save("~/ck", {"w": np.ones(2, np.float32)}, step=4)
    assert (tmp_path / "ck" / "COMMIT").exists() and not (tmp_path / "~").exists()
    assert ucp.open("~/ck").step == 4


def test_errors_say_what_an_async_save_left_undone(tmp_path, monkeypatch) -> None:
    """A restore while this process's async save of the path is still writing says so; the next
    save that finds the previous one failed says it was not started itself."""
    from ucp_jax._src import save as save_mod

    release = threading.Event()
    write = save_mod.SaveJob.write

    def slow_write(self, host):  # type: ignore[no-untyped-def]
        release.wait(30)
        return write(self, host)

    monkeypatch.setattr(save_mod.SaveJob, "write", slow_write)
    x = {"w": np.ones(4, np.float32)}
    h = ucp.async_save(tmp_path / "ck", x, step=1)
    with pytest.raises(ucp.NotACheckpointError, match=r"has not committed yet: call its handle"):
        ucp.restore(tmp_path / "ck", x)
    release.set()
    h.wait()
    (tmp_path / "file").write_text("x")
    ucp.async_save(tmp_path / "file" / "ck", x)  # its parent is a file: it fails in the background
    with pytest.raises(Exception, match=r"the save to .*ck2 was not started: the background save"):
        ucp.save(tmp_path / "ck2", x)
    assert not (tmp_path / "ck2").exists()


def test_a_partial_restore_says_which_atoms_it_left(tmp_path, caplog) -> None:
    # a target without a saved leaf (a backbone restored alone, or a head left out by mistake)
    # restores what it names, and the log says which atoms nothing read
    import logging

    d = tmp_path / "ck"
    ucp.save(d, {"body": np.ones(4, np.float32), "head": np.full(3, 2.0, np.float32)})
    with caplog.at_level(logging.INFO, logger="ucp_jax"):
        got, _ = ucp.restore(d, {"body": np.zeros(4, np.float32)})
    np.testing.assert_array_equal(got["body"], 1.0)
    said = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert said == [f"restore {d}: 1 atom(s) of the checkpoint not read, no target leaf takes "
                    "them: head"], said  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ucp_jax"):
        ucp.restore(d, {"body": np.zeros(4, np.float32), "head": np.zeros(3, np.float32)})
    assert not [r for r in caplog.records if "not read" in r.getMessage()]


def test_the_public_names_type_check_as_documented(tmp_path):
    """A user's script under `mypy --strict`: `ucp.open` is exported (it is imported under
    another name: mypy said 'does not explicitly export'), the submodules and errors are typed,
    and a misspelt name is an error (the untyped module `__getattr__` made it `Any`)."""
    api = pytest.importorskip("mypy.api")
    user = tmp_path / "user.py"
    user.write_text(
        "import numpy as np\nimport ucp_jax as ucp\n\n"
        'ck: ucp.Checkpoint = ucp.open("/tmp/x")\n'
        'h: ucp.SaveHandle = ucp.async_save("/tmp/y", {"w": np.zeros(3)}, step=1)\n'
        "e: type[ucp.UcpError] = ucp.DestinationExistsError\n"
        "a: type[ucp.UcpError] = ucp.ArgumentError\n"
        "f = ucp.torch.export_hf\n"
        "x: int = ucp.this_name_does_not_exist(3)\n"
    )
    config = tmp_path / "mypy.ini"  # the libraries below are not checked (17 s instead of 53)
    config.write_text(
        "[mypy]\nstrict = True\n[mypy-jax.*,jaxlib.*,numpy.*,tensorstore.*,optax.*,orbax.*,"
        "flax.*,torch.*,ml_dtypes.*,chex.*]\nfollow_imports = skip\n"
    )
    out, _, _ = api.run(
        ["--config-file", str(config), "--cache-dir", str(tmp_path / "cache"), str(user)]
    )
    mine = [line for line in out.splitlines() if line.startswith(str(user))]
    assert len(mine) == 1 and 'no attribute "this_name_does_not_exist"' in mine[0], out
    import ucp_jax

    assert all(hasattr(ucp_jax, n) for n in ucp_jax.__all__)
    import types

    public = {n for n in dir(ucp_jax) if not n.startswith("_")}  # (TYPE_CHECKING was one)
    subpackages = {n for n in public if isinstance(getattr(ucp_jax, n), types.ModuleType)}
    assert set(ucp_jax.__all__) - {"__version__"} <= public
    assert public - set(ucp_jax.__all__) <= subpackages, public - set(ucp_jax.__all__)


def test_a_save_over_a_checkpoint_is_a_ucp_error(tmp_path):
    """docs/faults.md: every error it names is a UcpError; the refusal to replace a checkpoint
    was a plain FileExistsError (still one, for callers that catch that)."""
    ucp.save(tmp_path / "a", {"w": np.ones(3, np.float32)}, step=1)
    with pytest.raises(ucp.DestinationExistsError, match="pass overwrite=True") as e:
        ucp.save(tmp_path / "a", {"w": np.ones(3, np.float32)}, step=1)
    assert isinstance(e.value, ucp.UcpError) and isinstance(e.value, FileExistsError)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "1GiB", True])
def test_max_inflight_bytes_must_be_a_positive_int(tmp_path, bad):
    """0, -5 and 2.5 were accepted as a bound (max(int(x), 1)); "1GiB" was a bare ValueError
    of int() naming neither the argument nor the fix."""
    tree = {"w": np.ones(3, np.float32)}
    with pytest.raises(ucp.ArgumentError, match=r"save\(max_inflight_bytes="):
        ucp.save(tmp_path / "a", tree, max_inflight_bytes=bad)
    assert not (tmp_path / "a").exists()
    ucp.save(tmp_path / "b", tree, max_inflight_bytes=1)
    target = {"w": jax.ShapeDtypeStruct((3,), np.float32)}
    with pytest.raises(ucp.ArgumentError, match=r"restore\(max_inflight_bytes=.*positive number"):
        ucp.restore(tmp_path / "b", target, max_inflight_bytes=bad)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_the_inflight_environment_variable_must_be_positive(monkeypatch, value):
    from ucp_jax._src.util import config

    monkeypatch.setenv("UCP_INFLIGHT_BYTES", value)
    with pytest.raises(ValueError, match=f"UCP_INFLIGHT_BYTES={value}: .*at least 1"):
        config.inflight_bytes()
    monkeypatch.setenv("UCP_SNAPSHOT_DEVICE_COPIES", "false")  # off, as every switch's
    assert config.snapshot_device_copies() is False


def test_direct_reads_and_save_arguments_say_what_to_pass(tmp_path) -> None:
    # a step beyond int64 was called "not an integer"; a circular extra was a bare ValueError;
    # read(3) a bare TypeError; a direct read of a missing atom or slot gave a restore's advice
    w = {"w": np.ones(2, np.float32)}
    with pytest.raises(TypeError, match=r"step 1180591620717411303424 is beyond int64"):
        ucp.save(tmp_path / "big", w, step=2**70)
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(TypeError, match=r"extra must be JSON-serialisable \(Circular reference"):
        ucp.save(tmp_path / "loop", w, extra=loop)
    assert sorted(os.listdir(tmp_path)) == []
    ucp.save(tmp_path / "ck", w, step=1)
    ck = ucp.open(tmp_path / "ck")
    with pytest.raises(TypeError, match=r"an atom name is a string, not a int \(3\).*'w'"):
        ck.read(3)
    with pytest.raises(ucp.MismatchError, match=r"atom 'x', which the checkpoint does not have; "
                       r"pass one of its 1 atoms \(.atoms; `ucp inspect` lists them\)"):  # fmt: skip
        ck.read("x")
    with pytest.raises(ucp.MismatchError, match=r"wanted slot 'exp_avg' of atom 'w', but it has "
                       r"slots \['fp32'\]; pass one of those as the slot"):  # fmt: skip
        ck.read("w", "exp_avg")
