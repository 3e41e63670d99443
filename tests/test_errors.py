"""Errors, not surprises: every bad input raises a clear error naming the leaf and the fix."""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from conftest import assert_tree_bitexact
from helpers import mesh_of, mixed_params, place, targets
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp
from ucp_jax._src.util.dtypes import cast_loss


@pytest.fixture
def saved(tmp_path):
    params = place({"w": np.arange(64, dtype=np.float32).reshape(8, 8), "b": np.ones(8, np.float32)},
                   mesh_of((2, 4)))  # fmt: skip
    ucp.save(tmp_path / "ck", params, step=3)
    return tmp_path / "ck", params


def test_wrong_target_shape(saved):
    path, params = saved
    tgt = targets(params, mesh_of((8,)))
    tgt["w"] = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=tgt["w"].sharding)
    with pytest.raises(ucp.MismatchError, match=r"leaf 'w'.*\(8, 4\).*\(8, 8\)"):
        ucp.restore(path, tgt)


def test_wrong_dtype_needs_cast(saved):
    path, params = saved
    tgt = jax.tree.map(
        lambda t: jax.ShapeDtypeStruct(t.shape, jnp.bfloat16, sharding=t.sharding),
        targets(params, mesh_of((4, 2))),
    )
    with pytest.raises(ucp.MismatchError, match=r"leaf 'b' wants dtype bfloat16.*cast=True"):
        ucp.restore(path, tgt)
    out, _ = ucp.restore(path, tgt, cast=True)
    assert out["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(out["w"]), np.asarray(params["w"]).astype(jnp.bfloat16)
    )


@pytest.mark.parametrize(
    "stored, target, bad",
    [
        (np.array([2**40, 3], np.int64), np.int32, "holds 1099511627776, outside int32"),
        (np.array([2**64 - 1, 5], np.uint64), np.int32, "holds 18446744073709551615, outside"),
        (np.array([-1, 7], np.int32), np.uint8, "holds -1, outside uint8 [0, 255]"),
        (np.array([1e300, 0.1], np.float64), np.float32, "holds 1e+300, beyond float32's range"),
        (np.array([70000.0, 1.0], np.float32), np.float16, "holds 70000.0, beyond float16's"),
        (np.array([-522.5, 1.0], np.float32), np.int8, "holds -522.5, outside int8"),
        (np.array([np.nan, 1.0], np.float32), np.int32, "holds nan, outside int32"),
        (np.array([1 + 2j, 3], np.complex64), np.float32, "holds (1+2j), whose imaginary part"),
        # types without an infinity saturate (float4) or give NaN (float8 e4m3fn): still a loss
        (
            np.array([1e30, 6.0], np.float32),
            ml_dtypes.float4_e2m1fn,
            "holds 1e+30, beyond float4_e2m1fn's range (it would become 6.0)",
        ),
        (
            np.array([np.nan, 1.0], np.float32),
            ml_dtypes.float4_e2m1fn,
            "holds nan, which float4_e2m1fn cannot hold (it would become -0.0)",
        ),
        (np.array([-np.inf, 1.0], np.float32), ml_dtypes.float4_e2m1fn, "holds -inf, which"),
        (
            np.array([np.inf, 1.0], np.float32),
            ml_dtypes.float8_e4m3fn,
            "holds inf, which float8_e4m3fn cannot hold (it would become nan)",
        ),
        (np.array([500.0, 1.0], np.float32), ml_dtypes.float8_e4m3fn, "holds 500.0, beyond"),
        # a complex type: each part against its float type
        (
            np.array([1e300 + 0j, 1], np.complex128),
            np.complex64,
            "holds 1e+300, beyond complex64's range (it would become inf)",
        ),
        (np.array([1 + 1e300j, 1], np.complex128), np.complex64, "holds 1e+300, beyond complex64"),
        (np.array([1e300, 1.0], np.float64), np.complex64, "holds 1e+300, beyond complex64's"),
        # bool: a mask, 0 and 1 only (anything else became True)
        (np.array([2, 1], np.int32), np.bool_, "holds 2, which bool cannot hold (only 0 and 1"),
        (np.array([0.5, 0.0], np.float32), np.bool_, "holds 0.5, which bool cannot hold"),
        (np.array([np.nan, 1.0], np.float32), np.bool_, "holds nan, which bool cannot hold"),
    ],
)
def test_a_cast_that_loses_values_is_refused(tmp_path, stored, target, bad):
    # cast=True rounds (fp32 -> bf16); it never wraps an integer, overflows to inf or drops an
    # imaginary part: that is an error naming the leaf, the value and the fix. The same cast of
    # values that fit (the last one, repeated) restores them.
    ucp.save(tmp_path / "ck", {"v": stored})
    tgt = {"v": jax.ShapeDtypeStruct(stored.shape, target,
                                     sharding=NamedSharding(mesh_of((1,)), P()))}  # fmt: skip
    with pytest.raises(ucp.MismatchError, match=re.escape(
            f"leaf 'v': atom 'v' slot 'fp32', stored as {stored.dtype.name}, {bad}")):  # fmt: skip
        ucp.restore(tmp_path / "ck", tgt, cast=True)
    fits = np.repeat(stored[-1:], len(stored))
    ucp.save(tmp_path / "ok", {"v": fits})
    out, _ = ucp.restore(tmp_path / "ok", tgt, cast=True)
    np.testing.assert_array_equal(np.asarray(out["v"]), np.real(fits).astype(target))


@pytest.mark.parametrize(
    "target, fits, beyond",
    [
        # round to nearest: up to halfway to the next step past the largest value is rounding
        (np.float16, 65519.0, 65520.0),
        (ml_dtypes.float4_e2m1fn, 6.99, 7.0),  # largest 6, the step below it 2
        (ml_dtypes.float8_e4m3fn, 463.0, 464.0),  # largest 448, step 32
        (ml_dtypes.float8_e5m2, 61439.0, 61440.0),  # largest 57344, step 8192
        (ml_dtypes.bfloat16, 3.396e38, 3.3962e38),  # largest 3.3895e38, step 2**120
    ],
)
def test_a_cast_rounds_up_to_halfway_past_the_largest_value(target, fits, beyond):
    # what rounds to the type's largest value is the cast; from halfway to the next step on, a
    # value is beyond the range whether the type overflows to inf, to NaN or saturates
    assert cast_loss(np.array([fits, -fits]), target) is None
    assert np.abs(np.array([fits, -fits]).astype(target).astype(float)).max() == float(
        ml_dtypes.finfo(target).max
    )
    for x in (beyond, -beyond):
        assert "beyond" in cast_loss(np.array([1.0, x]), target)


@pytest.mark.parametrize("target", [np.int64, np.uint64, np.int32, np.uint32, np.int8])
@pytest.mark.parametrize("source", [np.float64, np.float32])
def test_a_float_one_past_an_integer_types_top_is_refused(target, source):
    # the first integer past the top (int64: 2**63) must not pass for the top itself, which
    # float64 cannot hold (2**63 - 1 rounds to 2**63): the cast would wrap it to -2**63
    info = np.iinfo(target)
    past = np.array([1.0, float(int(info.max) + 1)], source)
    assert (
        cast_loss(past, target)
        == f"holds {past[1]}, outside {np.dtype(target).name} [{info.min}, {info.max}]"
    )
    below = np.nextafter(past[1:], source(0))  # the largest float of `source` under it fits
    assert cast_loss(below, target) is None
    assert below.astype(target)[0] == int(below[0])
    low = np.array([float(info.min)], source)  # the bottom is a power of two (or 0): it fits
    assert cast_loss(low, target) is None
    under = np.array([float(int(info.min) - 1)], source)  # the first integer under the bottom,
    if int(under[0]) > int(info.min) - 1:  # or the float under it where `source` rounds it up
        under = np.nextafter(under, source(-np.inf))
    assert "outside" in cast_loss(under, target)


def test_missing_atom_names_close_matches(saved):
    path, params = saved
    tgt = targets({"weight": params["w"], "b": params["b"]}, mesh_of((8,)))
    with pytest.raises(ucp.MismatchError, match=r"leaf 'weight' needs atom 'weight'"):
        ucp.restore(path, tgt)


def test_missing_slot(saved):
    path, params = saved
    tgt = targets(params, mesh_of((8,)))
    opt = jax.eval_shape(optax.adam(1e-3).init, params)
    opt = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=NamedSharding(mesh_of((8,)), P())
        ),
        opt,
    )
    with pytest.raises(ucp.MismatchError, match=r"opt_state.0.count.*restore params only"):
        ucp.restore(path, tgt, opt)
    sgd = jax.eval_shape(optax.sgd(1e-3, momentum=0.9).init, params)
    sgd = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=NamedSharding(mesh_of((8,)), P())
        ),
        sgd,
    )
    with pytest.raises(ucp.MismatchError, match=r"slot 'trace' of atom '[wb]'.*slots \['fp32'\]"):
        ucp.restore(path, tgt, sgd)


def test_target_without_sharding(saved):
    path, _params = saved
    tgt = {
        "w": jax.ShapeDtypeStruct((8, 8), jnp.float32),
        "b": jax.ShapeDtypeStruct((8,), jnp.float32),
    }
    with pytest.raises(ucp.MismatchError, match="without a sharding"):
        ucp.restore(path, tgt)


def test_numpy_targets_restore_on_host(saved):
    path, params = saved
    out, _ = ucp.restore(path, {"w": np.zeros((8, 8), np.float32), "b": np.zeros(8, np.float32)})
    assert isinstance(out["w"], np.ndarray)
    np.testing.assert_array_equal(out["w"], np.asarray(params["w"]))


def test_newer_format_version(saved):
    path, _ = saved
    m = json.loads((path / "manifest.json").read_text())
    m["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ucp.FormatVersionError, match="upgrade ucp_jax"):
        ucp.open(path)


def test_uncommitted_directory_is_not_a_checkpoint(saved, tmp_path):
    path, params = saved
    os.remove(path / "COMMIT")
    with pytest.raises(ucp.NotACheckpointError, match="did not finish"):
        ucp.open(path)
    with pytest.raises(ucp.NotACheckpointError):
        ucp.restore(path, targets(params, mesh_of((8,))))
    with pytest.raises(ucp.NotACheckpointError, match="no such checkpoint"):
        ucp.open(tmp_path / "nothing_here")
    assert ucp.list_checkpoints(tmp_path) == []


def test_refuses_to_overwrite(saved):
    path, params = saved
    with pytest.raises(FileExistsError, match="overwrite=True"):
        ucp.save(path, params)
    new = jax.tree.map(lambda x: x + 1, params)
    ucp.save(path, new, step=4, overwrite=True)
    assert ucp.open(path).step == 4
    out, _ = ucp.restore(path, targets(params, mesh_of((8,))))
    assert_tree_bitexact(new, out)


def test_rule_matching_nothing(tmp_path):
    params = {"w": jnp.ones((4, 4))}
    with pytest.raises(ucp.PatternError, match=r"matched no leaf.*'w'"):
        ucp.save(tmp_path / "ck", params, rules=[(r"layers\..*", ucp.Transposed((1, 0)))])


def test_extra_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="JSON"):
        ucp.save(tmp_path / "ck", {"w": jnp.ones(3)}, extra={"f": object()})


def test_background_error_is_raised_on_next_call(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    h = ucp.async_save(blocker / "ck", {"w": jnp.ones(3)})
    with pytest.raises(Exception, match="background save"):
        ucp.save(tmp_path / "other", {"w": jnp.ones(3)})
    h.wait()  # already reported by the call above: not raised twice
    ucp.save(tmp_path / "other", {"w": jnp.ones(3)})  # the queue is clear again
    assert ucp.list_checkpoints(tmp_path) == [str(tmp_path / "other")]


@pytest.mark.parametrize("url", ["memory://ucp-test/ck", "file://{tmp}/ck"])
def test_kvstore_urls(tmp_path, url):
    url = url.format(tmp=tmp_path)
    params = place(mixed_params(), mesh_of((2, 4)))
    ucp.save(url, params, step=9)
    ck = ucp.open(url)
    assert ck.step == 9
    out, _ = ucp.restore(url, targets(params, mesh_of((4, 2))))
    assert_tree_bitexact(params, out)


def test_open_reads_any_slice(saved):
    path, params = saved
    ck = ucp.open(path)
    w = np.asarray(params["w"])
    assert ck.atoms["w"].shape == (8, 8) and ck.atoms["w"].dtype == "float32"
    np.testing.assert_array_equal(ck.read("w", "fp32", np.s_[2:5, 3]), w[2:5, 3])
    np.testing.assert_array_equal(ck.read("w"), w)
    with pytest.raises(ucp.MismatchError, match="slots"):
        ck.read("w", "exp_avg")


def test_failed_save_lets_issued_writes_land_first(tmp_path, monkeypatch):
    """A save failing mid-write waits for the writes it issued before raising (regression).

    The per-array layout's write futures; the aggregated layout writes in transactions that it
    waits for or aborts (test_aggregated.py::test_failed_save_leaves_nothing_and_next_save_succeeds).
    """
    from ucp_jax._src import save as save_mod

    monkeypatch.setenv("UCP_LAYOUT", "per-array")
    from ucp_jax._src.mapping.patterns import Piece

    drained: list[list] = []
    real_wait = save_mod._wait_all

    def recording_wait(futs, *, raise_first=True):
        if not raise_first:
            drained.append(list(futs))
        real_wait(futs, raise_first=raise_first)

    calls = {"n": 0}
    real_l2a = Piece.leaf_to_atom

    def failing_l2a(self, data):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")
        return real_l2a(self, data)

    monkeypatch.setattr(save_mod, "_wait_all", recording_wait)
    monkeypatch.setattr(Piece, "leaf_to_atom", failing_l2a)
    params = place({f"w{i}": np.full((64, 64), i, np.float32) for i in range(6)}, mesh_of((8,)))
    with pytest.raises(RuntimeError, match="injected failure"):
        ucp.save(tmp_path / "ck", params)
    assert drained and sum(len(fs) for fs in drained) == 3  # the three writes issued before
    assert all(f.commit.done() for fs in drained for f in fs)
    assert ucp.list_checkpoints(tmp_path) == []


def test_a_leaf_whose_atom_name_cannot_be_stored_is_named_with_the_rule_that_fixes_it(tmp_path):
    """A leaf path longer than a file name (nested module names add up) is refused before
    anything is written, naming the leaf and a rule; that rule then saves and restores it."""
    long = "blocks." + "a" * 150 + ".mlp." + "b" * 150
    params = {long: jnp.arange(4.0), "b": jnp.ones(3)}
    with pytest.raises(ucp.UnsafePathError, match=r"save: leaf 'blocks\.aaa.*ucp\.Renamed"):
        ucp.save(tmp_path / "ck", params, step=1)
    assert not (tmp_path / "ck").exists()
    ucp.save(tmp_path / "ck", params, step=1, rules=[(r"blocks\..*", ucp.Renamed("mlp"))])
    assert sorted(ucp.open(tmp_path / "ck").atoms) == ["b", "mlp"]
    want = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in params.items()
    }
    got, _ = ucp.restore(tmp_path / "ck", want)
    assert_tree_bitexact(jax.device_get(got), jax.device_get(params))


def test_a_lone_params_target_with_both_names_saved_is_ambiguous(tmp_path):
    # A tree with 'params' beside a top-level 'w' stores atoms 'params.w' and 'w'; a target
    # holding 'params' alone names its leaf 'w' (the lone collection is left out), which would
    # take the other leaf's values: refused, naming both; the saved tree's own keys restore.
    saved = {"params": {"w": np.full(4, 1.0, np.float32)}, "w": np.full(4, 2.0, np.float32)}
    ucp.save(tmp_path / "ck", saved, step=1)
    lone = {"params": {"w": np.zeros(4, np.float32)}}
    with pytest.raises(ucp.MismatchError, match=re.escape(
            "is atom 'w', but the checkpoint also holds 'params.w'")):  # fmt: skip
        ucp.restore(tmp_path / "ck", lone)
    assert "also holds 'params.w'" in str(ucp.plan(tmp_path / "ck", lone))
    out, _ = ucp.restore(tmp_path / "ck", jax.tree.map(np.zeros_like, saved))
    assert_tree_bitexact(out, saved)


def test_an_optax_target_built_for_other_params_is_named_first(tmp_path):
    # Restoring a subset of the params with an optax target built from all of them: the first
    # problem says so and how to build it; the right target restores the subset.
    params = {"enc": {"kernel": np.ones((16, 8), np.float32), "bias": np.ones(8, np.float32)},
              "dec": {"kernel": np.ones((8, 16), np.float32)}}  # fmt: skip
    opt = optax.adam(1e-2)
    ucp.save(tmp_path / "ck", params, opt.init(params), step=1)
    mesh = mesh_of((4, 2))
    sub = {"enc": params["enc"]}
    pt, _ = ucp.targets(sub, mesh, P())
    _, wrong = ucp.targets(params, mesh, P(), opt_state=jax.eval_shape(opt.init, params))
    with pytest.raises(ucp.RestorePlanError) as e:
        ucp.restore(tmp_path / "ck", pt, wrong)
    first = e.value.plan.problems[0]
    assert (
        first.kind == "tree"
        and "state of parameter(s) ['dec.kernel'], which the params target does not have"
        in first.message
        and "jax.eval_shape(optimizer.init" in first.message
    )
    _, right = ucp.targets(sub, mesh, P(), opt_state=jax.eval_shape(opt.init, sub))
    p, o = ucp.restore(tmp_path / "ck", pt, right)
    assert_tree_bitexact((p, o), (sub, opt.init(sub)))


def test_moments_of_another_optimizer_are_named(tmp_path, caplog):
    # Slots match by name (adam's mu/nu are exp_avg/exp_avg_sq), so adam's state restores into
    # adabelief, whose nu is another statistic: the log says whose state went where. The same
    # optimizer in another structure (adam -> chain(clip, adamw)) says nothing.
    import logging

    params = {"w": np.ones((8, 4), np.float32)}
    adam = optax.adam(1e-2)
    ucp.save(tmp_path / "ck", params, adam.init(params), step=1)
    for opt, warned in ((optax.adabelief(1e-2), True),
                        (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), False)):  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ucp_jax"):
            _, got = ucp.restore(tmp_path / "ck", params, opt.init(params))
        assert (
            "slot 'exp_avg_sq': saved from ScaleByAdamState.nu, restored into "
            "ScaleByBeliefState.nu" in caplog.text
        ) is warned, caplog.text
        assert ("saved by another optax state" in caplog.text) is warned
        assert_tree_bitexact(jax.tree.leaves(got), jax.tree.leaves(adam.init(params)))
