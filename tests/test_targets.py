"""make_mesh and targets: "resume on another mesh" in two lines."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from conftest import assert_tree_bitexact
from helpers import float_params, mesh_of, place, trained_state
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp


def test_make_mesh_sizes():
    m = ucp.make_mesh(data=2, fsdp=1, tensor=4)
    assert dict(m.shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    assert dict(ucp.make_mesh(data=-1, tensor=2).shape) == {"data": 4, "tensor": 2}
    with pytest.raises(ValueError, match="make 6 devices but 8"):
        ucp.make_mesh(data=3, tensor=2)
    with pytest.raises(ValueError, match="only one axis"):
        ucp.make_mesh(data=-1, tensor=-1)


def test_a_mesh_beyond_the_devices_is_a_device_count_error():
    """More devices than there are: DeviceCountError names both counts and the platform, from
    `ucp.make_mesh` and from a model layout's mesh alike (a ValueError, as before)."""
    from ucp_jax.models.llama import Layout, MoELayout, make_mesh

    have = jax.device_count()
    with pytest.raises(
        ucp.DeviceCountError, match=f"needs {4 * have} devices, {have} available"
    ) as e:
        ucp.make_mesh(data=4 * have // 2, tensor=2)
    assert (e.value.needed, e.value.available) == (4 * have, have)
    assert isinstance(e.value, ValueError) and jax.default_backend() in str(e.value)
    for layout in (Layout(data=2 * have), MoELayout(expert=2 * have)):
        with pytest.raises(ucp.DeviceCountError, match=f"layout .* needs {2 * have} devices"):
            make_mesh(layout)


def test_targets_mirror_param_shardings(tmp_path):
    opt = optax.adamw(1e-2)
    params, state = trained_state(opt, float_params())
    params, state = place(params, mesh_of((2, 4))), place(state, mesh_of((2, 4)))
    ucp.save(tmp_path / "ck", params, state)
    mesh = ucp.make_mesh(data=4, tensor=2)

    def spec(name, leaf):
        return P(None, "tensor") if name == "dense.kernel" else P()

    pt, st = ucp.targets(params, mesh, spec, opt_state=jax.eval_shape(opt.init, params))
    assert pt["dense"]["kernel"].sharding.spec == P(None, "tensor")
    assert st[0].mu["dense"]["kernel"].sharding == pt["dense"]["kernel"].sharding
    assert st[0].count.sharding.spec == P()
    p2, s2 = ucp.restore(tmp_path / "ck", pt, st)
    assert_tree_bitexact(params, p2)
    assert_tree_bitexact(state, s2)


def test_targets_spec_tree_and_single_spec():
    mesh = ucp.make_mesh(data=-1)
    tree = {"a": np.zeros((8, 2)), "b": {"c": np.zeros(3)}}
    pt, _ = ucp.targets(tree, mesh, {"a": P("data"), "b": {"c": None}})
    assert pt["a"].sharding.spec == P("data") and pt["b"]["c"].sharding.spec == P()
    pt, _ = ucp.targets(tree, mesh)
    assert pt["a"].shape == (8, 2) and pt["a"].sharding.spec == P()


def test_64_bit_host_scalars_get_host_targets_while_x64_is_off(tmp_path):
    # With JAX's 64-bit types off, a device target of an int64/uint64/float64 numpy scalar (a
    # step or a seed kept on the host) would be narrowed, and restore refuses it; targets gives
    # such leaves numpy targets of their type, restored on the host bit-exact, in the optax
    # state too. Arrays stay device templates (np.zeros shapes are float64).
    assert not jax.config.jax_enable_x64
    state = {"i": np.int64(2**40), "u": np.uint64(2**64 - 1), "d": np.array(1e300),
             "w": np.ones((8, 4), np.float32)}  # fmt: skip
    opt = optax.sgd(0.1, momentum=0.9)
    ucp.save(tmp_path / "ck", state, opt.init(state))
    pt, ot = ucp.targets(state, mesh_of((2, 4)), P(), opt_state=opt.init(state))
    assert isinstance(pt["i"], np.int64) and isinstance(pt["u"], np.uint64)
    assert isinstance(pt["d"], np.ndarray) and isinstance(pt["w"], jax.ShapeDtypeStruct)
    params, opt_state = ucp.restore(tmp_path / "ck", pt, ot)
    assert_tree_bitexact(params, state)
    assert isinstance(params["u"], np.uint64) and params["d"].dtype == np.float64
    assert_tree_bitexact(opt_state, opt.init(state))
    assert isinstance(ucp.targets({"a": np.zeros((8, 2))}, mesh_of((8,)), P("a"))[0]["a"],
                      jax.ShapeDtypeStruct)  # fmt: skip


def test_make_mesh_says_the_sizes_must_use_every_device():
    """Too many devices asked for: the fix said 'a product at most 8', and make_mesh then
    refused data=2, tensor=2 (4 of 8); both errors now say the product must be the count."""
    n = len(jax.devices())
    with pytest.raises(ucp.DeviceCountError, match=f"choose sizes whose product is {n} "):
        ucp.make_mesh(data=2 * n)
    with pytest.raises(ValueError, match=f"choose sizes whose product is {n} .*devices= a subset"):
        ucp.make_mesh(data=2, tensor=n // 4)
    assert ucp.make_mesh(devices=jax.devices()[:2], data=2).size == 2


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: ucp.targets({"w": np.zeros((8, 2))}, "mesh"), TypeError,
         "targets: mesh is a str ('mesh'); expected a jax.sharding.Mesh"),
        (lambda m: ucp.targets({"w": np.zeros((8, 2))}, m, "data"), ValueError,
         "the spec for leaf 'w' is a str ('data'); expected a PartitionSpec"),
        (lambda m: ucp.targets({"w": np.zeros((8, 2))}, m, lambda n, x: None), ValueError,
         "the spec for leaf 'w' is a NoneType"),
        (lambda m: ucp.targets({"w": np.zeros((8, 2))}, m, P("data", "data")), ValueError,
         "targets: leaf 'w' of shape (8, 2) cannot take P('data', 'data') on mesh"),
        (lambda m: ucp.targets({"w": np.zeros(2), "s": "text"}, m), TypeError,
         "targets: leaf 's' is a str ('text'); expected an array"),
        (lambda m: ucp.targets({"w": np.zeros(2)}, m, opt_state={"mu": {"w": "x"}}), TypeError,
         "targets: leaf 'opt_state.mu.w' is a str"),
    ],
)  # fmt: skip
def test_targets_name_the_leaf_whatever_is_wrong(call, error, message):
    # these were JAX's DuplicateSpecError, AttributeError ('str' object has no attribute
    # 'partitions' / 'dtype' / 'size') or a pybind TypeError, naming no leaf
    with pytest.raises(error, match=re.escape(message)):
        call(ucp.make_mesh(data=-1))
