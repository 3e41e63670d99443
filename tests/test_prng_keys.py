"""Every leaf a JAX train state holds: typed PRNG keys (any impl) and legacy uint32[2] keys.

An NNX model with `nnx.Rngs` and dropout, its `nnx.Optimizer`, a Linen TrainState with a key
field, and the Flax guide's recipe with `ucp.orbax`: saved on one mesh, restored onto another,
keys equal (same impl, same key data); the in-memory tier too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import fit_shape, mesh_of, place, targets

import ucp_jax as ucp
from ucp_jax._src.mapping.names import named_leaves


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.down = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.drop(self.up(x)))


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _flat(tree: Any) -> dict[str, Any]:
    return {n: x for n, _, x in named_leaves(tree)}


def _assert_equal(got: Any, want: Any) -> None:
    g, w = _flat(got), _flat(want)
    assert sorted(g) == sorted(w)
    for n in w:
        assert _is_key(g[n]) == _is_key(w[n]), n
        if _is_key(w[n]):
            assert jax.random.key_impl(g[n]) == jax.random.key_impl(w[n]), n
            a, b = jax.random.key_data(g[n]), jax.random.key_data(w[n])
        else:
            a, b = g[n], w[n]
        assert a.dtype == b.dtype and a.shape == b.shape, n
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=n)


def _put(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """`place` for arrays; typed keys replicated on `mesh` (key data cannot be `jnp.asarray`ed)."""
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    keys = jax.tree.map(lambda x: jax.device_put(x, rep) if _is_key(x) else None, tree)
    rest = place(jax.tree.map(lambda x: jnp.zeros(()) if _is_key(x) else x, tree), mesh)
    return jax.tree.map(lambda k, x: x if k is None else k, keys, rest,
                        is_leaf=lambda x: x is None)  # fmt: skip


def _trained() -> tuple[Net, nnx.Optimizer]:
    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model: Net, optimizer: nnx.Optimizer, x: jax.Array) -> None:
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)

    for _ in range(2):  # the dropout key and count advance; moments are non-trivial
        step(model, optimizer, jnp.ones((4, 8)))
    return model, optimizer


def test_nnx_model_with_dropout_and_optimizer_onto_another_mesh(tmp_path):
    a, b = mesh_of((2, 4)), mesh_of((4, 2))
    model, optimizer = _trained()
    state, ostate = _put(nnx.state(model), a), _put(nnx.state(optimizer), a)
    names = _flat(state)
    assert _is_key(names["drop.rngs.key"]) and not _is_key(names["drop.rngs.count"])
    ucp.save(tmp_path / "ck", state, ostate, step=2)
    leaf = ucp.open(tmp_path / "ck").manifest.leaves["drop.rngs.key"]
    assert leaf["key_impl"] == "threefry2x32" and leaf["shape"] == [2]

    fresh = Net(nnx.Rngs(5, dropout=6))  # another model: its keys and weights differ
    fresh_opt = nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param)
    got, got_opt = ucp.restore(
        tmp_path / "ck", targets(nnx.state(fresh), b), targets(nnx.state(fresh_opt), b)
    )
    _assert_equal(got, state)
    _assert_equal(got_opt, ostate)
    assert got["up"]["kernel"][...].sharding.mesh.devices.shape == fit_shape((4, 2))
    nnx.update(fresh, got)  # drops into the live model: its dropout draws the same mask
    x = jnp.ones((4, 8))
    y, want = np.asarray(fresh(x)), np.asarray(model(x))
    np.testing.assert_array_equal(y == 0, want == 0)  # the same units dropped
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)  # another mesh, another sum order


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_key_impls_and_sharded_key_arrays(tmp_path, impl):
    a, b = mesh_of((8,)), mesh_of((2, 4))
    keys = jax.random.split(jax.random.key(3, impl=impl), 8)
    keys = jax.device_put(keys, jax.sharding.NamedSharding(a, jax.sharding.PartitionSpec("a")))
    state = {"keys": keys, "one": jax.random.key(4, impl=impl), "w": jnp.arange(8.0)}
    ucp.save(tmp_path / "ck", state)
    spec = jax.sharding.PartitionSpec("b")
    target = {
        "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype,
                                     sharding=jax.sharding.NamedSharding(b, spec)),
        "one": jax.ShapeDtypeStruct((), state["one"].dtype,
                                    sharding=jax.sharding.NamedSharding(b, jax.sharding.PartitionSpec())),
        "w": jax.ShapeDtypeStruct((8,), jnp.float32,
                                  sharding=jax.sharding.NamedSharding(b, spec)),
    }  # fmt: skip
    got, _ = ucp.restore(tmp_path / "ck", target)
    _assert_equal(got, state)
    assert got["keys"].sharding.is_equivalent_to(target["keys"].sharding, keys.ndim)
    other = "rbg" if impl == "threefry2x32" else "threefry2x32"
    wrong = dict(target, one=jax.ShapeDtypeStruct((), jax.random.key(0, impl=other).dtype,
                                                  sharding=target["one"].sharding))  # fmt: skip
    with pytest.raises(ucp.MismatchError, match="impl"):
        ucp.restore(tmp_path / "ck", wrong)


def test_legacy_uint32_keys_and_typed_keys_interchange(tmp_path):
    raw = jax.random.PRNGKey(7)  # uint32[2], the legacy key
    assert raw.dtype == jnp.uint32
    ucp.save(tmp_path / "raw", {"rng": raw})
    got, _ = ucp.restore(tmp_path / "raw", {"rng": raw})
    np.testing.assert_array_equal(got["rng"], raw)
    typed, _ = ucp.restore(tmp_path / "raw", {"rng": jax.random.key(0)})  # legacy -> typed
    assert _is_key(typed["rng"])
    np.testing.assert_array_equal(jax.random.key_data(typed["rng"]), raw)
    ucp.save(tmp_path / "typed", {"rng": jax.random.wrap_key_data(raw)})
    back, _ = ucp.restore(tmp_path / "typed", {"rng": raw})  # typed -> legacy
    np.testing.assert_array_equal(back["rng"], raw)


class KeyedTrainState(train_state.TrainState):
    key: jax.Array


def test_linen_train_state_with_a_key(tmp_path):
    from flax import linen as nn

    a, b = mesh_of((2, 4)), mesh_of((4, 2))
    model = nn.Sequential([nn.Dense(16), nn.Dropout(0.5, deterministic=False), nn.Dense(4)])
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                        jnp.ones((2, 8)))["params"]  # fmt: skip
    st = KeyedTrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3),
                                key=jax.random.key(5))  # fmt: skip
    st = st.apply_gradients(grads=jax.tree.map(jnp.ones_like, st.params))
    st = _put(st.replace(step=jnp.asarray(st.step)), a)
    ucp.save(tmp_path / "ck", st, step=int(st.step))
    abstract = KeyedTrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3),
                                      key=jax.random.key(0))  # fmt: skip
    abstract = abstract.replace(step=jnp.asarray(0))
    got, _ = ucp.restore(tmp_path / "ck", targets(abstract, b))
    _assert_equal(got, st)
    assert int(got.step) == 1 and got.apply_fn == model.apply


def test_flax_guide_recipe_with_ucp_and_ucp_orbax(tmp_path):
    """Flax's checkpointing guide (nnx.split / eval_shape / merge), with `ucp` and `ucp.orbax`.

    The one change from the guide: the abstract state gets shardings (`ucp.targets`), which is
    what says the mesh to restore onto.
    """
    ocp = pytest.importorskip("orbax.checkpoint")
    import ucp_jax.orbax as uo

    model, _ = _trained()
    _, state = nnx.split(model)
    abstract = nnx.eval_shape(lambda: Net(nnx.Rngs(0, dropout=1)))
    graphdef, abstract_state = nnx.split(abstract)
    target, _ = ucp.targets(abstract_state, mesh_of((4, 2)))

    ucp.save(tmp_path / "ucp", state)
    got, _ = ucp.restore(tmp_path / "ucp", target)
    _assert_equal(nnx.state(nnx.merge(graphdef, got)), state)

    checkpointer = ocp.Checkpointer(uo.UniversalCheckpointHandler())
    checkpointer.save(tmp_path / "orbax" / "state", args=uo.UniversalSave(state))
    restored = checkpointer.restore(tmp_path / "orbax" / "state", args=uo.UniversalRestore(target))
    _assert_equal(nnx.state(nnx.merge(graphdef, restored.params)), state)


def test_in_memory_tier_with_keys(tmp_path):
    from ucp_jax.memory import SnapshotManager

    a, b = mesh_of((2, 4)), mesh_of((4, 2))
    model, optimizer = _trained()
    state, ostate = _put(nnx.state(model), a), _put(nnx.state(optimizer), a)
    mgr = SnapshotManager(tmp_path / "persist", persist_every=1, redundancy=None,
                          namespace=f"keys-{tmp_path.name}")  # fmt: skip
    try:
        assert mgr.snapshot(1, state, ostate)
        mgr.wait()
        got, got_opt = mgr.restore(targets(state, b), targets(ostate, b))
        assert mgr.restored is not None and mgr.restored.source == "memory"
        _assert_equal(got, state)
        _assert_equal(got_opt, ostate)
        got, _ = ucp.restore(tmp_path / "persist" / "step_1", targets(state, b))
        _assert_equal(got, state)
    finally:
        mgr.free(all_nodes=True)
