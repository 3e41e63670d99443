"""One model, one set of atom names: Linen and NNX restore each other's checkpoints with no rules.

The same network is written twice, in Flax Linen and in Flax NNX (dense layers, and a stack of
scanned/vmapped layers whose parameters carry a leading layer axis). A checkpoint saved from one
API on a (2, 4) mesh is restored into the other on a (4, 2) mesh, with no rules, and the values
are bit-identical. Checkpoints written with the older names (`....value`, `params.` prefixes) still
restore.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from helpers import fit_shape, mesh_of, place, targets

import ucp_jax as ucp
from ucp_jax._src.mapping.names import named_leaves

D, L, IN = 16, 4, 8


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return nn.Dense(D, name="mlp")(x), None


class LinenModel(nn.Module):
    scanned: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(D, name="up")(x)
        if self.scanned:
            stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=L)  # fmt: skip
            x, _ = stack(name="blocks")(x, None)
        return nn.Dense(IN, name="down")(x)


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.mlp = nnx.Linear(D, D, rngs=rngs)


class NnxModel(nnx.Module):
    def __init__(self, scanned: bool, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(IN, D, rngs=rngs)
        if scanned:

            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r: nnx.Rngs) -> NnxBlock:
                return NnxBlock(r)

            self.blocks = make(rngs)
        self.down = nnx.Linear(D, IN, rngs=rngs)


def _by_name(tree: object) -> dict[str, np.ndarray]:
    return {n: np.asarray(x) for n, _, x in named_leaves(tree)}


def _assert_same(a: object, b: object) -> None:
    da, db = _by_name(a), _by_name(b)
    assert sorted(da) == sorted(db)
    for n in da:
        assert da[n].shape == db[n].shape and da[n].dtype == db[n].dtype, n
        assert da[n].tobytes() == db[n].tobytes(), n


def _linen(scanned: bool, seed: int) -> tuple[nn.Module, dict]:
    model = LinenModel(scanned)
    return model, model.init(jax.random.key(seed), jnp.zeros((2, IN)))


def _nnx_state(scanned: bool, seed: int) -> nnx.State:
    return nnx.state(NnxModel(scanned, nnx.Rngs(seed)), nnx.Param)


@pytest.mark.parametrize("scanned", [False, True], ids=["dense", "scanned"])
def test_linen_to_nnx_and_back(tmp_path, scanned):
    a, b = mesh_of((2, 4)), mesh_of((4, 2))
    _, variables = _linen(scanned, seed=1)
    variables = place(variables, a)
    names = sorted(_by_name(variables))
    assert "up.kernel" in names and all(not n.endswith(".value") for n in names), names
    assert ("blocks.mlp.kernel" in names) == scanned
    ucp.save(tmp_path / "linen", variables, step=1)
    assert sorted(ucp.open(tmp_path / "linen").atoms) == names

    # Linen -> NNX: the NNX state of the same network (other init), restored with no rules
    state = _nnx_state(scanned, seed=2)
    got, _ = ucp.restore(tmp_path / "linen", targets(state, b))
    assert isinstance(got, nnx.State)
    _assert_same(got, variables)
    for x in jax.tree.leaves(got):
        assert x.sharding.mesh.devices.shape == fit_shape((4, 2))
    model = NnxModel(scanned, nnx.Rngs(3))
    nnx.update(model, got)  # the restored state drops into a live NNX model
    np.testing.assert_array_equal(model.up.kernel[...], variables["params"]["up"]["kernel"])

    # NNX -> Linen
    ucp.save(tmp_path / "nnx", place(got, b), step=2)
    assert sorted(ucp.open(tmp_path / "nnx").atoms) == names
    back, _ = ucp.restore(tmp_path / "nnx", targets(variables, a))
    _assert_same(back, variables)
    # the inner Linen params dict (what TrainState.params holds) has the same names too
    inner, _ = ucp.restore(tmp_path / "nnx", targets(variables["params"], b))
    _assert_same(inner, variables)


def test_linen_optax_state_restores_into_nnx_optimizer_state(tmp_path):
    """Adam moments saved from optax over Linen params land in an NNX Optimizer's moments."""
    a, b = mesh_of((2, 4)), mesh_of((4, 2))
    _, variables = _linen(False, seed=1)
    params = place(variables["params"], a)
    opt = optax.adam(1e-2).init(params)
    opt = opt[:1] + opt[1:]  # a tuple, as optax gives it
    opt = jax.tree.map(lambda x: x + 1, opt)  # moments and count differ from a fresh init
    ucp.save(tmp_path / "ck", params, opt, step=3)
    atoms = ucp.open(tmp_path / "ck").atoms
    assert set(atoms["up.kernel"].slots) == {"fp32", "exp_avg", "exp_avg_sq"}

    model = NnxModel(False, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    p_t = targets(nnx.state(model, nnx.Param), b)
    o_t = targets(nnx.state(optimizer)["opt_state"], b)
    p2, o2 = ucp.restore(tmp_path / "ck", p_t, o_t)
    _assert_same(p2, params)
    want = _by_name(opt)
    got = _by_name(o2)
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].tobytes() == want[n].tobytes(), n


def test_checkpoints_with_older_names_still_restore(tmp_path):
    """Atoms named `x.value` (NNX before) or `params.x` (Linen variables before) are found."""
    b = mesh_of((4, 2))
    state = _nnx_state(False, seed=0)
    plain = nnx.to_pure_dict(state)
    old_nnx = jax.tree.map(lambda x: {"value": x}, plain)  # what jax's raw path used to give
    ucp.save(tmp_path / "old_nnx", old_nnx)
    assert "up.kernel.value" in ucp.open(tmp_path / "old_nnx").atoms
    got, _ = ucp.restore(tmp_path / "old_nnx", targets(state, b))
    _assert_same(got, plain)

    _, variables = _linen(False, seed=4)
    ucp.save(tmp_path / "old_linen", {"params": variables})  # atoms 'params.up.kernel', ...
    assert "params.up.kernel" in ucp.open(tmp_path / "old_linen").atoms
    got, _ = ucp.restore(tmp_path / "old_linen", targets(variables, b))
    _assert_same(got, variables)
