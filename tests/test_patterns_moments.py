"""Optimizer moments follow their parameter's patterns, and no rule may collapse parts of a leaf.

The referee is numpy: the fused layouts are built by hand (per tensor-parallel shard, the
sub-parameters' chunks side by side), never by ucp_jax.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp

SIZES = (8, 4, 4)  # q, k, v columns (GQA: k and v narrower)


def fuse(subs: list[np.ndarray], n: int) -> np.ndarray:
    """The fused [q|k|v] kernel as n tensor-parallel shards hold it, side by side."""
    return np.concatenate(
        [s[:, r * s.shape[1] // n : (r + 1) * s.shape[1] // n] for r in range(n) for s in subs], 1
    )


@pytest.mark.parametrize("moment_on", ["host", "other_mesh", "same_mesh"])
def test_a_moment_is_unfused_with_its_parameters_tensor_parallel_degree(tmp_path, moment_on):
    """A momentum trace held on the host (after jax.device_get) or on another mesh of the same
    devices mirrors its parameter element for element: the TP-4 fused layout is the parameter's,
    so its slot is stored in the canonical [q|k|v] order like the parameter's, and comes back in
    TP-2 order on a TP-2 target."""
    rng = np.random.default_rng(0)
    subs = [rng.standard_normal((8, n)).astype(np.float32) for n in SIZES]
    msub = [rng.standard_normal((8, n)).astype(np.float32) for n in SIZES]
    rules = [("w", ucp.Fused(SIZES, axis=1, shard_axis="tensor"))]
    tp4 = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    params = {"w": jax.device_put(fuse(subs, 4), NamedSharding(tp4, P(None, "tensor")))}
    place = {
        "host": lambda a: a,
        "other_mesh": lambda a: jax.device_put(
            a, NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
        ),
        "same_mesh": lambda a: jax.device_put(a, NamedSharding(tp4, P(None, "tensor"))),
    }[moment_on]
    opt = optax.sgd(0.1, momentum=0.9)
    state = jax.tree.map(lambda x: place(fuse(msub, 4)) if x.shape == (8, 16) else x,
                         opt.init(params))  # fmt: skip
    ucp.save(tmp_path / "ck", params, state, step=1, rules=rules)
    ck = ucp.open(tmp_path / "ck")
    np.testing.assert_array_equal(ck.read("w", "fp32"), np.concatenate(subs, 1))
    np.testing.assert_array_equal(ck.read("w", "trace"), np.concatenate(msub, 1))
    tp2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    t = jax.ShapeDtypeStruct((8, 16), np.float32, sharding=NamedSharding(tp2, P(None, "tensor")))
    _, got = ucp.restore(tmp_path / "ck", {"w": t}, jax.tree.map(lambda _: t, state,
                         is_leaf=lambda x: hasattr(x, "shape") and x.shape == (8, 16)))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got[0].trace["w"]), fuse(msub, 2))


def test_a_stacked_template_without_its_index_is_refused(tmp_path):
    """`Stacked` whose template forgot '{i}' would write every layer into one atom (only the last
    survived, and the save succeeded): refused, naming the leaf and the fix; nothing written."""
    layers = np.random.default_rng(0).standard_normal((4, 4, 8)).astype(np.float32)
    rules = [(r"layers\.(.*)", ucp.Stacked(r"blocks.\1", axes=0))]
    with pytest.raises(ucp.PatternError, match=r"layers\.w: .* same elements of atom 'blocks\.w'"
                       r".*Stacked template needs '\{i\}'"):  # fmt: skip
        ucp.save(tmp_path / "ck", {"layers": {"w": layers}}, step=1, rules=rules)
    assert not (tmp_path / "ck").exists()


def test_a_fused_atom_named_twice_is_refused(tmp_path):
    qkv = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    rules = [("qkv", ucp.Fused(SIZES, 1, None, atoms=("q", "kv", "kv")))]
    with pytest.raises(ucp.PatternError, match="same elements of atom 'kv'"):
        ucp.save(tmp_path / "ck", {"qkv": qkv}, step=1, rules=rules)


@pytest.mark.parametrize("optimizer", ["multi_transform", "masked", "adam"])
def test_masked_optimizer_states_are_slots_of_their_parameters(tmp_path, optimizer):
    """optax.multi_transform / optax.masked hold their inner states with `MaskedNode`s where a
    parameter is left out: those moments mirror the parameters they cover, are slots of their
    atoms (they were plain leaves, restored in the saved TP order), and come back in TP-2 order
    from a TP-4 save, as plain adam's do (the control)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    subs = [rng.standard_normal((8, n)).astype(np.float32) for n in SIZES]
    msub = [rng.standard_normal((8, n)).astype(np.float32) for n in SIZES]
    rules = [("qkv", ucp.Fused(SIZES, axis=1, shard_axis="tensor"))]
    opt = {
        "multi_transform": lambda: optax.multi_transform(
            {"a": optax.adam(1e-3), "b": optax.sgd(1e-2)}, {"qkv": "a", "bias": "b"}
        ),
        "masked": lambda: optax.masked(optax.adam(1e-3), {"qkv": True, "bias": False}),
        "adam": lambda: optax.adam(1e-3),
    }[optimizer]()
    tp4 = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    tp2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))
    params = {"qkv": jax.device_put(fuse(subs, 4), NamedSharding(tp4, P(None, "tensor"))),
              "bias": jax.device_put(np.zeros(4, np.float32), NamedSharding(tp4, P()))}  # fmt: skip
    moment = jax.device_put(fuse(msub, 4), NamedSharding(tp4, P(None, "tensor")))
    state = jax.tree.map(lambda x: moment if x.shape == (8, 16) else x, opt.init(params))
    ucp.save(tmp_path / "ck", params, state, step=1, rules=rules)
    ck = ucp.open(tmp_path / "ck")
    assert {"exp_avg", "exp_avg_sq"} <= set(ck.atoms["qkv"].slots)
    np.testing.assert_array_equal(ck.read("qkv", "exp_avg"), np.concatenate(msub, 1))
    pt = {"qkv": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(tp2, P(None, "tensor"))),
          "bias": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(tp2, P()))}  # fmt: skip
    _, ot = ucp.targets(pt, tp2, {"qkv": P(None, "tensor"), "bias": P()},
                        opt_state=jax.eval_shape(opt.init, pt))  # fmt: skip
    got_p, got = ucp.restore(tmp_path / "ck", pt, ot, rules=rules)
    np.testing.assert_array_equal(np.asarray(got_p["qkv"]), fuse(subs, 2))
    moments = [np.asarray(x) for x in jax.tree.leaves(got) if x.shape == (8, 16)]
    assert len(moments) == 2
    for m in moments:
        np.testing.assert_array_equal(m, fuse(msub, 2))


@pytest.mark.parametrize("optimizer", ["prefix_mask", "prefix_labels", "lookahead"])
def test_moments_of_part_of_the_params_follow_their_parameters(tmp_path, optimizer):
    """A prefix mask (one MaskedNode for a whole subtree), prefix labels of multi_transform, and
    lookahead's fast_state (the state of params.fast only) mirror the parameters they cover by
    name: their moments are slots of those atoms, back in TP-2 order from a TP-4 save."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    subs = [rng.standard_normal((8, n)).astype(np.float32) for n in SIZES]
    msub = [rng.standard_normal((8, n)).astype(np.float32) for n in SIZES]
    tp4 = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    tp2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tensor"))

    def tree(qkv, mesh):
        spec = NamedSharding(mesh, P(None, "tensor"))
        rep = NamedSharding(mesh, P())
        if isinstance(qkv, np.ndarray):
            put = jax.device_put
        else:
            put = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
        mlp = np.ones((4, 4), np.float32)
        t = {"attn": {"qkv": put(qkv, spec)}, "mlp": {"kernel": put(mlp, rep)}}
        return optax.LookaheadParams(t, t) if optimizer == "lookahead" else t

    if optimizer == "prefix_mask":
        opt = optax.masked(optax.adam(1e-3), {"attn": True, "mlp": False})
    elif optimizer == "prefix_labels":
        opt = optax.multi_transform({"a": optax.adam(1e-3), "z": optax.set_to_zero()},
                                    {"attn": "a", "mlp": "z"})  # fmt: skip
    else:
        opt = optax.lookahead(optax.adam(1e-3), sync_period=5, slow_step_size=0.5)
    names = r"(fast\.|slow\.)?attn\.qkv" if optimizer == "lookahead" else r"attn\.qkv"
    rules = [(names, ucp.Fused(SIZES, axis=1, shard_axis="tensor"))]
    params = tree(fuse(subs, 4), tp4)
    moment = jax.device_put(fuse(msub, 4), NamedSharding(tp4, P(None, "tensor")))
    state = jax.tree.map(lambda x: moment if x.shape == (8, 16) else x, opt.init(params))
    ucp.save(tmp_path / "ck", params, state, step=1, rules=rules)
    ck = ucp.open(tmp_path / "ck")
    atom = "fast.attn.qkv" if optimizer == "lookahead" else "attn.qkv"
    np.testing.assert_array_equal(ck.read(atom, "exp_avg"), np.concatenate(msub, 1))
    pt = tree(jnp.zeros((8, 16), jnp.float32), tp2)
    rep = NamedSharding(tp2, P())
    ot = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                      jax.eval_shape(opt.init, pt))  # fmt: skip
    _, got = ucp.restore(tmp_path / "ck", pt, ot, rules=rules)
    moments = [np.asarray(x) for x in jax.tree.leaves(got) if x.shape == (8, 16)]
    assert len(moments) == 2
    for m in moments:
        np.testing.assert_array_equal(m, fuse(msub, 2))


@pytest.mark.parametrize("stacked", [False, True])
def test_an_atom_is_described_by_its_parameter_not_its_last_moment(tmp_path, stacked):
    # the manifest's leaf of an atom (`ucp inspect --json`) is the parameter's; an unpatterned
    # parameter's leaf was overwritten by each moment's ('opt_state.0.nu.w')
    params = {"w": np.ones((4, 4), np.float32), "layers": {"k": np.ones((2, 4), np.float32)}}
    rules = [(r"layers\.k", ucp.Stacked("layer.{i}.k", axes=0))] if stacked else []
    ucp.save(tmp_path / "ck", params, optax.adam(1e-3).init(params), step=1, rules=rules)
    atoms = ucp.open(tmp_path / "ck").atoms
    assert atoms["w"].leaf == "w"
    for name in ["layer.0.k", "layer.1.k"] if stacked else ["layers.k"]:
        assert atoms[name].leaf == "layers.k", (name, atoms[name].leaf)
    assert atoms["opt_state.0.count"].leaf == "opt_state.0.count"
