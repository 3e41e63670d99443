"""Patterns alone and composed: index maps checked against numpy references, then save -> restore
across meshes where the TP degree and the number of stages change."""

from __future__ import annotations

import itertools
import re

import jax
import numpy as np
import optax
import pytest
from conftest import assert_tree_bitexact
from helpers import mesh_of, need_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp
from ucp_jax._src.mapping.boxes import full_box, to_slices
from ucp_jax._src.mapping.patterns import LeafContext, as_chain, chain_pieces
from ucp_jax._src.mapping.rules import CompiledRules

RNG = np.random.default_rng(0)


# ------------------------------------------------------------------------- numpy references


def ref_fuse(subs, n, axis):
    """concat over shards r of concat_k(sub_k[r-th of n chunks])."""
    parts = [np.split(s, n, axis=axis) for s in subs]
    return np.concatenate([np.concatenate([p[r] for p in parts], axis) for r in range(n)], axis)


def ref_pad(atom, padded, axis):
    width = [(0, 0)] * atom.ndim
    width[axis] = (0, padded - atom.shape[axis])
    return np.pad(atom, width)


def ref_stack(atoms, lead_shape):
    s = np.stack(atoms)
    return s.reshape(tuple(lead_shape) + s.shape[1:])


def build_leaf(rules, name, shape, atoms, mesh_axes, box=None):
    """Assemble a leaf region from atom arrays through the index maps (the code under test)."""
    _idx, m, chain = CompiledRules(rules).match(name)
    ctx = LeafContext(name, m, mesh_axes)
    box = box or full_box(shape)
    out = np.full(tuple(b - a for a, b in box), np.nan, np.float32)
    for p in chain_pieces(chain, ctx, shape, box):
        rel = tuple(slice(a - o, z - o) for (a, z), (o, _) in zip(p.leaf_box, box))
        assert np.isnan(out[rel]).all(), "a leaf element covered twice"
        out[rel] = 0 if p.atom is None else p.atom_to_leaf(atoms[p.atom][to_slices(p.atom_box)])
    assert not np.isnan(out).any(), "a leaf element not covered"
    return out


def random_boxes(shape, n=12):
    for _ in range(n):
        box = []
        for d in shape:
            a = int(RNG.integers(0, d))
            box.append((a, int(RNG.integers(a + 1, d + 1))))
        yield tuple(box)


def check_all_boxes(rules, name, leaf, atoms, mesh_axes):
    np.testing.assert_array_equal(build_leaf(rules, name, leaf.shape, atoms, mesh_axes), leaf)
    for box in random_boxes(leaf.shape):
        got = build_leaf(rules, name, leaf.shape, atoms, mesh_axes, box)
        np.testing.assert_array_equal(got, leaf[to_slices(box)])
    # and the inverse: leaf regions scatter back onto the atoms exactly
    _idx, m, chain = CompiledRules(rules).match(name)
    back = {k: np.full(v.shape, np.nan, np.float32) for k, v in atoms.items()}
    for p in chain_pieces(chain, LeafContext(name, m, mesh_axes), leaf.shape, full_box(leaf.shape)):
        if p.atom is not None:
            back[p.atom][to_slices(p.atom_box)] = p.leaf_to_atom(leaf[to_slices(p.leaf_box)])
    for k in atoms:
        np.testing.assert_array_equal(back[k], atoms[k])


def f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ each pattern, index maps


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("sizes", [(8, 8, 8), (8, 4, 4)], ids=["mha", "gqa"])
def test_fused_index_map(n, sizes):
    subs = [f32(6, s) for s in sizes]
    atoms = {"qkv": np.concatenate(subs, 1)}
    rules = [("qkv", ucp.Fused(sizes, axis=1, shard_axis="tensor"))]
    check_all_boxes(rules, "qkv", ref_fuse(subs, n, 1), atoms, {"tensor": n})


def test_fused_separate_atoms():
    subs = [f32(6, 8), f32(6, 4), f32(6, 4)]
    atoms = {"attn.q": subs[0], "attn.k": subs[1], "attn.v": subs[2]}
    rules = [(r"(.*)\.qkv", ucp.Fused((8, 4, 4), 1, "tensor", atoms=(r"\1.q", r"\1.k", r"\1.v")))]
    check_all_boxes(rules, "attn.qkv", ref_fuse(subs, 2, 1), atoms, {"tensor": 2})


def test_vocab_padded_index_map():
    atom = f32(10, 4)
    rules = [("emb", ucp.VocabPadded(10, axis=0))]
    check_all_boxes(rules, "emb", ref_pad(atom, 16, 0), {"emb": atom}, {})


@pytest.mark.parametrize("lead", [(4,), (2, 2)])
def test_stacked_index_map(lead):
    atoms = {f"blocks.{i}.w": f32(3, 5) for i in range(4)}
    axes = tuple(range(len(lead)))
    rules = [(r"layers\.(.*)", ucp.Stacked(r"blocks.{i}.\1", axes=axes))]
    leaf = ref_stack([atoms[f"blocks.{i}.w"] for i in range(4)], lead)
    check_all_boxes(rules, "layers.w", leaf, atoms, {})


def test_transposed_index_map():
    atom = f32(5, 3, 2)
    rules = [("w", ucp.Transposed((2, 0, 1)))]
    check_all_boxes(rules, "w", atom.transpose(2, 0, 1), {"w": atom}, {})


def test_fused_stacked_composed():
    subs = {i: [f32(6, 8), f32(6, 4), f32(6, 4)] for i in range(4)}
    atoms = {f"blocks.{i}.qkv": np.concatenate(subs[i], 1) for i in range(4)}
    rules = [
        (
            r"layers\.(.*)",
            (ucp.Fused((8, 4, 4), 1, "tensor"), ucp.Stacked(r"blocks.{i}.\1", (0, 1))),
        )
    ]
    leaf = ref_stack([ref_fuse(subs[i], 2, 1) for i in range(4)], (2, 2))
    check_all_boxes(rules, "layers.qkv", leaf, atoms, {"tensor": 2})


def test_vocab_transposed_composed():
    atom = f32(10, 4)  # torch-style unembedding [vocab, d]
    rules = [("unembed", (ucp.VocabPadded(10, axis=0), ucp.Transposed((1, 0))))]
    check_all_boxes(rules, "unembed", ref_pad(atom, 16, 0).T, {"unembed": atom}, {})


# ------------------------------------------------------------ save -> restore, layouts change

D, L = 8, 4
SIZES = (16, 8, 8)  # GQA: q, k, v columns
V, VOCAB_MULT = 50, 8


def canonical():
    rng = np.random.default_rng(3)
    return {
        "emb": rng.standard_normal((V, D)).astype(np.float32),
        **{
            f"blocks.{i}.qkv": rng.standard_normal((D, sum(SIZES))).astype(np.float32)
            for i in range(L)
        },
        **{
            f"blocks.{i}.out": rng.standard_normal((SIZES[0], D)).astype(np.float32)
            for i in range(L)
        },
    }


def layout_rules(stages):
    axes = (0, 1) if stages > 1 else 0
    return [
        ("emb", (ucp.VocabPadded(V, axis=0), ucp.Transposed((1, 0)))),
        (
            r"layers\.(qkv)",
            (ucp.Fused(SIZES, axis=1, shard_axis="tensor"), ucp.Stacked(r"blocks.{i}.\1", axes)),
        ),
        (r"layers\.(out)", ucp.Stacked(r"blocks.{i}.\1", axes)),
    ]


def layout_leaves(c, tensor, stages):
    """numpy reference of the training layout for a TP degree and a number of stages."""
    vpad = -(-V // (VOCAB_MULT * tensor)) * VOCAB_MULT * tensor
    lead = (stages, L // stages) if stages > 1 else (L,)
    qkv = [np.split(c[f"blocks.{i}.qkv"], np.cumsum(SIZES)[:-1], axis=1) for i in range(L)]
    return {
        "emb": ref_pad(c["emb"], vpad, 0).T,  # [D, vocab_padded]
        "layers": {
            "qkv": ref_stack([ref_fuse(q, tensor, 1) for q in qkv], lead),
            "out": ref_stack([c[f"blocks.{i}.out"] for i in range(L)], lead),
        },
    }


def layout_specs(stages):
    st = ("stage",) if stages > 1 else ()
    return {
        "emb": P(None, "tensor"),
        "layers": {"qkv": P(*st, None, None, "tensor"), "out": P(*st, None, "tensor", None)},
    }


def make_mesh(data, tensor, stages):
    need_devices(data * tensor * stages)  # the stored layout is that of these sizes
    return mesh_of((stages, data, tensor), ("stage", "data", "tensor"))


LAYOUTS = [  # (data, tensor, stages): 8 devices each
    (2, 4, 1), (4, 2, 1), (8, 1, 1), (2, 2, 2), (1, 4, 2), (4, 1, 2),
]  # fmt: skip


@pytest.mark.parametrize("dst", LAYOUTS, ids=lambda t: f"dp{t[0]}-tp{t[1]}-pp{t[2]}")
@pytest.mark.parametrize("src", [(2, 4, 1), (2, 2, 2)], ids=lambda t: f"dp{t[0]}-tp{t[1]}-pp{t[2]}")
def test_relayout_roundtrip(tmp_path, src, dst):
    c = canonical()
    mesh = make_mesh(*src)
    leaves = layout_leaves(c, src[1], src[2])
    specs = layout_specs(src[2])
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), leaves, specs)
    ucp.save(tmp_path / "ck", params, step=1, rules=layout_rules(src[2]))
    ck = ucp.open(tmp_path / "ck")
    assert sorted(ck.atoms) == sorted(c)
    for name, value in c.items():  # the atoms are the canonical (TP=PP=1, unpadded) tensors
        np.testing.assert_array_equal(ck.read(name), value)
    dmesh = make_mesh(*dst)
    want = layout_leaves(c, dst[1], dst[2])
    tgt = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(dmesh, s)),
        want, layout_specs(dst[2]),
    )  # fmt: skip
    out, _ = ucp.restore(tmp_path / "ck", tgt, rules=layout_rules(dst[2]))
    assert_tree_bitexact(want, out)
    from ucp_jax._src.read_stats import last_read_stats

    assert last_read_stats().amplification == 1.0


def test_recorded_rules_used_when_none_given(tmp_path):
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    c = canonical()
    mesh = make_mesh(2, 4, 1)
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                          layout_leaves(c, 4, 1), layout_specs(1))  # fmt: skip
    ucp.save(tmp_path / "ck", params, rules=layout_rules(1))
    dmesh = make_mesh(4, 2, 1)  # TP changes: Fused's n comes from the target's mesh
    want = layout_leaves(c, 2, 1)
    tgt = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(dmesh, s)),
        want, layout_specs(1),
    )  # fmt: skip
    out, _ = ucp.restore(tmp_path / "ck", tgt)
    assert_tree_bitexact(want, out)


def test_opt_state_follows_patterns(tmp_path):
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    c = canonical()
    mesh = make_mesh(2, 2, 2)
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                          layout_leaves(c, 2, 2), layout_specs(2))  # fmt: skip
    opt = optax.adam(1e-2)
    state = opt.init(params)
    grads = jax.tree.map(lambda p: p * 0.1 + 1.0, params)
    _, state = opt.update(grads, state, params)
    ucp.save(tmp_path / "ck", params, state, rules=layout_rules(2))
    ck = ucp.open(tmp_path / "ck")
    assert set(ck.atoms["blocks.3.qkv"].slots) == {"fp32", "exp_avg", "exp_avg_sq"}
    # the stored moment is the canonical one: mu = 0.1 * grad = 0.1 * (0.1 * w + 1)
    np.testing.assert_allclose(
        ck.read("blocks.3.qkv", "exp_avg"), 0.1 * (0.1 * c["blocks.3.qkv"] + 1), rtol=1e-6
    )
    # restore into a different layout AND a different optax structure holding the same moments
    dmesh = make_mesh(4, 2, 1)
    want = layout_leaves(c, 2, 1)
    pt = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(dmesh, s)),
        want, layout_specs(1),
    )  # fmt: skip
    opt2 = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    st = jax.eval_shape(opt2.init, pt)
    st_t = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(dmesh, P())), st
    )
    p2, s2 = ucp.restore(tmp_path / "ck", pt, st_t, rules=layout_rules(1))
    assert_tree_bitexact(want, p2)
    adam = s2[1][0]
    assert int(adam.count) == 1
    # canonical moments laid out for the new layout: the vocab padding's moments are zeros
    mu_ref = layout_leaves({k: 0.1 * (0.1 * v + 1) for k, v in c.items()}, 2, 1)
    for a, b in zip(jax.tree.leaves(adam.mu), jax.tree.leaves(mu_ref)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)


# ----------------------------------------------------------------------- mismatched rules


def _save_fused(tmp_path, sizes=SIZES):
    mesh = mesh_of((2, 4), ("data", "tensor"))
    subs = [f32(D, s) for s in sizes]
    leaf = jax.device_put(ref_fuse(subs, 4, 1), NamedSharding(mesh, P(None, "tensor")))
    ucp.save(tmp_path / "ck", {"qkv": leaf}, rules=[("qkv", ucp.Fused(sizes, 1, "tensor"))])
    return mesh, leaf


def _target(shape, mesh, spec):
    return {"qkv": jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))}


def test_fused_wrong_total_size(tmp_path):
    mesh, leaf = _save_fused(tmp_path)
    with pytest.raises(ucp.PatternError, match=r"leaf 'qkv'.*Fused\(sizes=\(8, 8, 8\).*expects 24"):
        ucp.restore(tmp_path / "ck", _target(leaf.shape, mesh, P(None, "tensor")),
                    rules=[("qkv", ucp.Fused((8, 8, 8), 1, "tensor"))])  # fmt: skip


def test_fused_wrong_split_same_total(tmp_path):
    mesh, leaf = _save_fused(tmp_path)
    with pytest.raises(ucp.PatternError, match=r"fuses atom 'qkv'.*saved as"):
        ucp.restore(tmp_path / "ck", _target(leaf.shape, mesh, P(None, "tensor")),
                    rules=[("qkv", ucp.Fused((8, 12, 12), 1, "tensor"))])  # fmt: skip


def test_fused_wrong_axis(tmp_path):
    mesh, leaf = _save_fused(tmp_path)
    with pytest.raises(ucp.PatternError, match=r"leaf 'qkv'.*expects 32 along axis 0"):
        ucp.restore(tmp_path / "ck", _target(leaf.shape, mesh, P(None, "tensor")),
                    rules=[("qkv", ucp.Fused(SIZES, 0, "tensor"))])  # fmt: skip


def test_fused_sizes_not_divisible_by_tp(tmp_path):
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    mesh = mesh_of((2, 4), ("data", "tensor"))
    leaf = jax.device_put(f32(4, 6), NamedSharding(mesh, P()))
    with pytest.raises(ucp.PatternError, match=r"do not divide by the 4 shards"):
        ucp.save(tmp_path / "ck", {"qkv": leaf}, rules=[("qkv", ucp.Fused((2, 2, 2), 1, "tensor"))])


def test_no_rule_for_relayout_is_a_shape_error(tmp_path):
    mesh, _leaf = _save_fused(tmp_path)
    with pytest.raises(
        ucp.MismatchError, match=r"leaf 'qkv'.*expects atom 'qkv' of shape \(8, 16\)"
    ):
        ucp.restore(tmp_path / "ck", _target((8, 16), mesh, P(None, "tensor")),
                    rules=[(".*", ucp.Replicated())])  # fmt: skip


def test_vocab_padded_too_small_and_bad_template(tmp_path):
    mesh = mesh_of((8,), ("data",))
    emb = jax.device_put(f32(16, 4), NamedSharding(mesh, P("data")))
    with pytest.raises(ucp.PatternError, match=r"VocabPadded\(size=20.*only 16"):
        ucp.save(tmp_path / "ck", {"emb": emb}, rules=[("emb", ucp.VocabPadded(20, 0))])
    stacked = jax.device_put(f32(4, 3), NamedSharding(mesh, P()))
    ucp.save(tmp_path / "ok", {"layers": {"w": stacked}},
             rules=[(r"layers\.(.*)", ucp.Stacked(r"blocks.{i}.\1", 0))])  # fmt: skip
    with pytest.raises(ucp.MismatchError, match=r"needs atom 'block.0.w'.*close"):
        ucp.restore(tmp_path / "ok", {"layers": {"w": jax.ShapeDtypeStruct((4, 3), np.float32, sharding=stacked.sharding)}},
                    rules=[(r"layers\.(.*)", ucp.Stacked(r"block.{i}.\1", 0))])  # fmt: skip


@pytest.mark.parametrize("pad_value", [0.0, 99.0])
def test_nonzero_vocab_padding_is_named_once(tmp_path, caplog, pad_value):
    # Rows past VocabPadded's size are stored nowhere: a restore gives zeros. Rows that hold
    # values there (a true vocabulary given too small) are named in the log, once per leaf
    # (and process: a second save of it says nothing more).
    import logging

    from ucp_jax._src import save as save_mod

    save_mod._PADDING_WARNED.clear()
    mesh = mesh_of((8,), ("data",))
    host = f32(64, 4)
    host[50:] = pad_value
    emb = jax.device_put(host, NamedSharding(mesh, P("data")))
    rules = [("emb", ucp.VocabPadded(50, 0))]
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        ucp.save(tmp_path / "ck", {"emb": emb}, rules=rules)
    warned = [r for r in caplog.records if "in its padding" in r.getMessage()]
    assert len(warned) == (1 if pad_value else 0)
    if pad_value:
        assert "leaf 'emb' holds nonzero values" in warned[0].getMessage()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ucp_jax"):
            ucp.save(tmp_path / "ck2", {"emb": emb}, rules=rules)
        assert "in its padding" not in caplog.text
    out, _ = ucp.restore(tmp_path / "ck", {"emb": jax.ShapeDtypeStruct((64, 4), np.float32,
                                                                       sharding=emb.sharding)},
                         rules=rules)  # fmt: skip
    want = host.copy()
    want[50:] = 0
    np.testing.assert_array_equal(np.asarray(out["emb"]), want)


def test_pattern_sizes_and_templates_that_cannot_be(tmp_path):
    # VocabPadded(0) would make every row padding (stored nowhere, restored as zeros); a template
    # naming a regex group its rule lacks was a bare re.error: both are PatternErrors.
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ucp.PatternError, match=f"VocabPadded: size={bad!r}"):
            ucp.VocabPadded(bad)
    assert ucp.VocabPadded(np.int64(50)).size == 50
    with pytest.raises(ucp.PatternError, match="positive sub-param sizes"):
        ucp.Fused((8, 0), 0, "tensor")
    mesh = mesh_of((8,), ("data",))
    stacked = jax.device_put(f32(4, 3), NamedSharding(mesh, P()))
    with pytest.raises(ucp.PatternError, match=r"template 'blocks.\{i}.\\\\9' does not expand"):
        ucp.save(tmp_path / "ck", {"layers": {"w": stacked}},
                 rules=[(r"layers\.(.*)", ucp.Stacked(r"blocks.{i}.\9", 0))])  # fmt: skip
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "make, message",
    [
        # ints, not floats rounded down or strings split into digits or names into letters
        (lambda: ucp.Fused(4, axis=1), "Fused: sizes=4 is a int; expected a tuple of integers"),
        (lambda: ucp.Fused("22", axis=1), "Fused: sizes='22' is a str; expected a tuple"),
        (lambda: ucp.Fused((2.7, 2.7), axis=1), "Fused: sizes=2.7 is a float; expected an integer"),
        (lambda: ucp.Fused((2, 2), axis=1.0), "Fused: axis=1.0 is a float; expected an integer"),
        (lambda: ucp.Fused((2, 2), 1, atoms="xy"), "Fused: atoms='xy'; expected a tuple of names"),
        (
            lambda: ucp.Fused((2, 2), 1, shard_axis=1),
            "Fused: shard_axis=1 is a int; expected a str",
        ),
        (lambda: ucp.VocabPadded(6, axis="0"), "VocabPadded: axis='0' is a str; expected an int"),
        (lambda: ucp.Transposed("ab"), "Transposed: perm='ab' is a str; expected a tuple"),
        (lambda: ucp.Transposed(1), "Transposed: perm=1 is a int; expected a tuple of integers"),
        (lambda: ucp.Transposed((1.7, 0.2)), "Transposed: perm=1.7 is a float; expected an int"),
        (lambda: ucp.Partitioned(axis=0.5), "Partitioned: axis=0.5 is a float; expected an int"),
        (lambda: ucp.Stacked(3, axes=0), "Stacked: atoms=3 is a int; expected a string"),
        (lambda: ucp.Stacked("b.{i}", axes=(0.0,)), "Stacked: axes=0.0 is a float; expected"),
    ],
)
def test_pattern_arguments_of_the_wrong_type_are_refused(make, message):
    # they were coerced (Fused((2.7, 2.7)) saved as sizes (2, 2), atoms="xy" as ("x", "y")) or
    # failed later with a bare TypeError from inside the library
    with pytest.raises(ucp.PatternError, match=re.escape(message)):
        make()
    assert ucp.Fused(np.array([2, 2]), np.int64(1), atoms=["a", "b"]).sizes == (2, 2)


@pytest.mark.parametrize(
    "rule, message",
    [
        ((r"a\.w", ucp.Replicated), "rule #0 ('a\\\\.w'): rule pattern <class"),
        (
            (r"a\.w", ucp.Replicated),
            "is not a ucp pattern (a class: call it, e.g. ucp.Replicated())",
        ),
        ((r"a\.w", 7), "rule #0 ('a\\\\.w'): rule pattern 7 is not a ucp pattern"),
        ((r"a\.w", "Replicated"), "rule pattern 'Replicated' is not a ucp pattern"),
        ((7, ucp.Replicated()), "rule #0: its regex 7 is a int; expected a string"),
        ((re.compile(r"a\.w"), ucp.Replicated()), "is a Pattern; expected a string"),
    ],
)
def test_rules_of_the_wrong_type_name_the_rule(tmp_path, rule, message):
    # a bare TypeError before ('type' object is not iterable; Pattern is not JSON serializable)
    with pytest.raises(ucp.PatternError, match=re.escape(message)):
        ucp.save(tmp_path / "ck", {"a": {"w": np.ones((2, 2), np.float32)}}, rules=[rule])
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "chain, past",
    [
        (ucp.Stacked(r"blocks.{i}.\1"), "blocks.2.qkv"),
        ((ucp.Fused((2, 2, 2), axis=1, shard_axis="tensor",
                    atoms=("blocks.{i}.q", "blocks.{i}.k", "blocks.{i}.v")),
          ucp.Stacked("blocks.{i}.qkv")), "blocks.2.q"),
        ((ucp.Renamed(r"model.{i}.\1"), ucp.Stacked(r"blocks.{i}.\1")), "model.2.qkv"),
    ],
    ids=["stacked", "fused-atoms", "renamed"],
)  # fmt: skip
def test_a_stack_restored_short_is_refused_whoever_names_the_atoms(tmp_path, chain, past):
    # 4 layers saved, a target of 2: the plain chain was refused, but where Fused(atoms=) or
    # Renamed named the atoms the check was skipped and layers 2-3 were dropped silently
    w = np.arange(4 * 2 * 6, dtype=np.float32).reshape(4, 2, 6)
    rules = [(r"layers\.(qkv)", chain)]
    ucp.save(tmp_path / "ck", {"layers": {"qkv": w}}, step=1, rules=rules)
    with pytest.raises(ucp.MismatchError, match=rf"stacks 2 atoms along its {{i}} axis, but the "
                       rf"checkpoint also has '{re.escape(past)}'"):  # fmt: skip
        ucp.restore(tmp_path / "ck", {"layers": {"qkv": np.zeros((2, 2, 6), np.float32)}},
                    rules=rules)  # fmt: skip
    got, _ = ucp.restore(tmp_path / "ck", {"layers": {"qkv": np.zeros_like(w)}}, rules=rules)
    np.testing.assert_array_equal(got["layers"]["qkv"], w)


def test_transposed_bad_perm():
    with pytest.raises(ucp.PatternError, match="not a permutation"):
        ucp.Transposed((0, 0))
    _idx, m, chain = CompiledRules([("w", ucp.Transposed((1, 0)))]).match("w")
    with pytest.raises(ucp.PatternError, match=r"Transposed\(1, 0\) needs a 2-d array"):
        chain_pieces(chain, LeafContext("w", m, {}), (2, 3, 4), full_box((2, 3, 4)))


def test_pattern_json_roundtrip():
    from ucp_jax._src.mapping.pattern_json import pattern_from_json

    for p in [ucp.Replicated(), ucp.Averaged(), ucp.Partitioned(1), ucp.Transposed((1, 0)),
              ucp.VocabPadded(7, 1), ucp.Fused((2, 2), 0, "t", atoms=("a", "b")),
              ucp.Stacked(r"b.{i}.\1", (0, 1))]:  # fmt: skip
        assert pattern_from_json(p.to_json()) == p
    assert as_chain(None) == ()
    assert list(itertools.chain(as_chain(ucp.Replicated()))) == [ucp.Replicated()]


def test_forgotten_fused_rule_is_an_error(tmp_path):
    """A fused atom restored onto a TP>1 leaf without ucp.Fused would silently come back in TP=1
    column order: it is refused; Fused(..., shard_axis=None) asks for the canonical order."""
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    mesh, leaf = _save_fused(tmp_path)
    tgt = _target(leaf.shape, mesh, P(None, "tensor"))
    with pytest.raises(ucp.PatternError, match=r"has no ucp.Fused.*TP=1 order"):
        ucp.restore(tmp_path / "ck", tgt, rules=[("qkv", ucp.Replicated())])
    out, _ = ucp.restore(tmp_path / "ck", tgt, rules=[("qkv", ucp.Fused(SIZES, 1, None))])
    np.testing.assert_array_equal(np.asarray(out["qkv"]), ucp.open(tmp_path / "ck").read("qkv"))
    # on a mesh without the shard axis the canonical order is the only one: no error
    m1 = mesh_of((8,), ("data",))
    out, _ = ucp.restore(
        tmp_path / "ck", _target(leaf.shape, m1, P()), rules=[("qkv", ucp.Replicated())]
    )
    np.testing.assert_array_equal(np.asarray(out["qkv"]), ucp.open(tmp_path / "ck").read("qkv"))


def test_lazy_submodules():
    import subprocess
    import sys

    assert ucp.orbax.UniversalCheckpointHandler is not None
    with pytest.raises(AttributeError):
        ucp.nonexistent  # noqa: B018
    code = "import sys, ucp_jax; assert 'torch' not in sys.modules, 'ucp_jax imported torch'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


RELAYOUT_OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "multisteps_adam": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "inject_adamw": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
}


WANT_P_SPECS = {
    "emb": P(None, "tensor"),
    "layers.qkv": P(None, None, "tensor"),
    "layers.out": P(None, "tensor", None),
}


def _layout_state(opt, c, data, tensor, stages):
    """Params laid out for (data, tensor, stages) and the optax state after one update with
    grads 0.1 * params (zero in the vocab padding, so the padding's moments are zero too)."""
    mesh = make_mesh(data, tensor, stages)
    specs = layout_specs(stages)
    params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                          layout_leaves(c, tensor, stages), specs)  # fmt: skip
    state = opt.init(params)
    _, state = opt.update(jax.tree.map(lambda p: 0.1 * p, params), state, params)
    return mesh, params, state


@pytest.mark.parametrize("name", sorted(RELAYOUT_OPTIMIZERS))
def test_optimizer_states_follow_relayout(tmp_path, name):
    """Any optax state that mirrors the params restores onto a new TP/PP layout like its params."""
    opt = RELAYOUT_OPTIMIZERS[name]()
    c = canonical()
    _, params, state = _layout_state(opt, c, 2, 2, 2)
    ucp.save(tmp_path / "ck", params, state, rules=layout_rules(2))
    mesh, want_p, want_s = _layout_state(opt, c, 4, 2, 1)  # the same update, done in layout B
    pt, st = ucp.targets(want_p, mesh, lambda n, x: WANT_P_SPECS[n], opt_state=want_s)
    p2, s2 = ucp.restore(tmp_path / "ck", pt, st, rules=layout_rules(1))
    assert_tree_bitexact(want_p, p2)
    assert jax.tree.structure(s2) == jax.tree.structure(want_s)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(s2)[0], jax.tree.leaves(want_s)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim) or a.ndim == 0, path
        # clip_by_global_norm reduces in a layout-dependent order: last-bit differences only
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=2e-6, atol=0, err_msg=str(path)
        )
