"""Tests of the demo GPT itself: layouts round-trip, and every layout computes the same model."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import need_devices

from ucp_jax import demo
from ucp_jax.demo import GPTConfig, Layout

CFG = GPTConfig()
GQA = GPTConfig(n_heads=8, n_kv_heads=4, n_layers=2)  # 2 query heads per kv head
BATCH = 16

ROUNDTRIP_LAYOUTS = [
    Layout(),
    Layout(data=8),
    Layout(data=4, tensor=2),
    Layout(data=2, tensor=4),
    Layout(stages=2, data=2, tensor=2),
    Layout(stages=2, tensor=4),
    Layout(data=2, fsdp=2, tensor=2),
    Layout(fsdp=2, stages=2, tensor=2),
]
LOSS_LAYOUTS = [
    Layout(data=2, tensor=4),
    Layout(data=4, tensor=2),
    Layout(data=8),
    Layout(stages=2, data=2, tensor=2),
    Layout(data=2, fsdp=2, tensor=2),
    Layout(),  # a one-device mesh
]


@pytest.fixture(scope="module")
def canonical() -> dict[str, np.ndarray]:
    return demo.init_canonical(CFG)


def _first_loss(cfg: GPTConfig, layout: Layout, canonical: dict[str, np.ndarray]) -> float:
    mesh = demo.make_mesh(layout)
    params = demo.to_layout(canonical, cfg, layout, mesh)
    loss = jax.jit(demo.loss_fn, static_argnums=(2, 3))(
        params, demo.batch(cfg, 1, BATCH, mesh), cfg, layout
    )
    return float(loss)


def _train(
    layout: Layout, canonical: dict[str, np.ndarray], steps: int
) -> tuple[list[float], dict]:
    mesh = demo.make_mesh(layout)
    optimizer = demo.make_optimizer()
    params = demo.to_layout(canonical, CFG, layout, mesh)
    opt_state = demo.init_opt_state(optimizer, params)
    step_fn = demo.make_train_step(CFG, layout, mesh, optimizer)
    losses = []
    for s in range(1, steps + 1):
        params, opt_state, loss = step_fn(params, opt_state, demo.batch(CFG, s, BATCH, mesh))
        losses.append(float(loss))
    return losses, {"params": params, "opt_state": opt_state}


def test_eight_devices() -> None:
    need_devices(8)  # the layouts of this file: fewer devices (one GPU) skip them
    assert jax.device_count() >= 8


@pytest.mark.parametrize("layout", ROUNDTRIP_LAYOUTS, ids=lambda lay: lay.name)
def test_to_layout_from_layout_roundtrip(layout: Layout, canonical: dict[str, np.ndarray]) -> None:
    mesh = demo.make_mesh(layout)
    params = demo.to_layout(canonical, CFG, layout, mesh)
    target = demo.abstract_params(CFG, layout, mesh)
    assert jax.tree.structure(params) == jax.tree.structure(target)
    for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target)):
        assert (p.shape, p.dtype) == (t.shape, t.dtype)
        assert p.sharding.is_equivalent_to(t.sharding, p.ndim)
    back = demo.from_layout(params, CFG, layout)
    assert back.keys() == canonical.keys()
    for name, a in canonical.items():
        np.testing.assert_array_equal(back[name], a, err_msg=name)


def test_parameter_layout_is_the_documented_one(canonical: dict[str, np.ndarray]) -> None:
    layout = Layout(stages=2, data=1, tensor=4)
    params = demo.to_layout(canonical, CFG, layout, demo.make_mesh(layout))
    t, hd = layout.tensor, CFG.head_dim
    dq, dk = CFG.n_heads * hd, CFG.n_kv_heads * hd
    qkv = np.asarray(params["layers"]["attn"]["qkv"]["kernel"])
    assert qkv.shape == (2, 2, CFG.d_model, dq + 2 * dk)
    for i in range(CFG.n_layers):
        atom = canonical[f"blocks.{i}.attn.qkv.kernel"]
        q, k, v = atom[:, :dq], atom[:, dq : dq + dk], atom[:, dq + dk :]
        expect = np.concatenate(
            [np.concatenate([np.split(x, t, 1)[r] for x in (q, k, v)], 1) for r in range(t)], 1
        )
        np.testing.assert_array_equal(qkv[i // 2, i % 2], expect)
    emb = np.asarray(params["embed"]["embedding"])
    assert emb.shape == (256, CFG.d_model) and emb.shape[0] % (64 * t) == 0
    assert np.all(emb[CFG.vocab_size :] == 0)
    spec = params["layers"]["mlp"]["down"]["kernel"].sharding.spec
    assert tuple(spec) == ("stage", None, "tensor", None)


@pytest.mark.parametrize("cfg", [CFG, GQA], ids=["mha", "gqa"])
def test_first_loss_is_layout_independent(cfg: GPTConfig) -> None:
    canonical = demo.init_canonical(cfg)
    losses = {lay.name: _first_loss(cfg, lay, canonical) for lay in LOSS_LAYOUTS}
    ref = losses[Layout().name]
    assert 4.0 < ref < 8.0, losses
    for name, loss in losses.items():
        assert loss == pytest.approx(ref, rel=1e-6), (name, losses)


def test_training_is_layout_independent(canonical: dict[str, np.ndarray]) -> None:
    steps = 4
    la, state_a = _train(Layout(data=2, tensor=4), canonical, steps)
    lb, state_b = _train(Layout(stages=2, data=2, tensor=2), canonical, steps)
    rel = np.abs(np.array(lb) / np.array(la) - 1)
    assert rel.max() < 1e-5, (la, lb, rel)
    assert la[-1] < la[0]  # it learns
    wa = demo.from_layout(state_a["params"], CFG, Layout(data=2, tensor=4))
    wb = demo.from_layout(state_b["params"], CFG, Layout(stages=2, data=2, tensor=2))
    for name in canonical:  # Adam can amplify the last-bit differences of a ~0 gradient locally
        diff = np.linalg.norm(wa[name] - wb[name]) / np.linalg.norm(wa[name])
        assert diff < 1e-5, (name, diff)


def test_padding_stays_zero_and_is_masked(canonical: dict[str, np.ndarray]) -> None:
    layout, v = Layout(data=2, tensor=4), CFG.vocab_size
    _, state = _train(layout, canonical, 2)
    params = state["params"]
    mu = state["opt_state"][1][0].mu
    for tree in (params, mu):
        assert np.all(np.asarray(tree["embed"]["embedding"])[v:] == 0)
        assert np.all(np.asarray(tree["unembed"]["kernel"])[:, v:] == 0)
    # Garbage in the padding changes nothing: padded logits are masked, padded rows never read.
    mesh = demo.make_mesh(layout)
    clean = demo.to_layout(canonical, CFG, layout, mesh)
    dirty = jax.tree.map(lambda a: a, clean)
    rng = np.random.default_rng(0)
    for key, sl in (("embed", np.s_[v:]), ("unembed", np.s_[:, v:])):
        leaf = "embedding" if key == "embed" else "kernel"
        arr = np.asarray(clean[key][leaf]).copy()
        arr[sl] = rng.standard_normal(arr[sl].shape) * 10
        dirty[key] = {leaf: jax.device_put(arr, clean[key][leaf].sharding)}
    tokens = demo.batch(CFG, 1, BATCH, mesh)
    f = jax.jit(demo.loss_fn, static_argnums=(2, 3))
    assert float(f(dirty, tokens, CFG, layout)) == float(f(clean, tokens, CFG, layout))
    logits = jax.jit(lambda p, x: demo.model_from_params(p, CFG, layout)(x))(dirty, tokens)
    assert np.all(np.asarray(logits)[..., v:] < -1e8)


def test_opt_state_is_sharded_like_the_params(canonical: dict[str, np.ndarray]) -> None:
    layout = Layout(data=2, fsdp=2, tensor=2)
    mesh = demo.make_mesh(layout)
    optimizer = demo.make_optimizer()
    params = demo.to_layout(canonical, CFG, layout, mesh)
    state = demo.init_opt_state(optimizer, params)
    target = demo.abstract_opt_state(optimizer, demo.abstract_params(CFG, layout, mesh))
    assert jax.tree.structure(state) == jax.tree.structure(target)
    for s, t in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
        assert (s.shape, s.dtype) == (t.shape, t.dtype)
        assert s.sharding.is_equivalent_to(t.sharding, s.ndim)
    adam = state[1][0]
    for mom in (adam.mu, adam.nu):
        for m, p in zip(jax.tree.leaves(mom), jax.tree.leaves(params)):
            assert m.sharding.is_equivalent_to(p.sharding, p.ndim)


def test_batch_is_deterministic_and_layout_independent() -> None:
    a = demo.batch(CFG, 3, BATCH, demo.make_mesh(Layout(data=2, tensor=4)))
    b = demo.batch(CFG, 3, BATCH, demo.make_mesh(Layout(stages=2, data=2, fsdp=2)))
    c = demo.batch(CFG, 4, BATCH, demo.make_mesh(Layout(data=2, tensor=4)))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.shape == (BATCH, CFG.seq_len + 1) and not np.array_equal(np.asarray(a), np.asarray(c))
    assert np.asarray(a).max() < CFG.vocab_size


def test_bad_layouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="tensor"):
        Layout(tensor=8).check(CFG)
    with pytest.raises(ValueError, match="stages"):
        Layout(stages=8).check(CFG)


def test_ucp_rules_cover_every_leaf(canonical: dict[str, np.ndarray]) -> None:
    ucp = pytest.importorskip("ucp_jax")
    if not all(hasattr(ucp, n) for n in ("Fused", "Stacked", "VocabPadded")):
        pytest.skip("the core library does not export the patterns yet")
    for layout in (Layout(data=2, tensor=4), Layout(stages=2, data=2, tensor=2)):
        rules = demo.ucp_rules(CFG, layout)
        target = demo.abstract_params(CFG, layout, demo.make_mesh(layout))
        atoms: set[str] = set()
        for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
            name = ".".join(k.key for k in path)
            match = next(((m, p) for r, p in rules if (m := re.fullmatch(r, name))), None)
            if match is None:
                atoms.add(name)
                continue
            m, pats = match
            pats = pats if isinstance(pats, tuple) else (pats,)
            stacked = [p for p in pats if isinstance(p, ucp.Stacked)]
            if not stacked:
                atoms.add(name)
                continue
            template = m.expand(stacked[0].atoms)
            atoms.update(template.replace("{i}", str(i)) for i in range(CFG.n_layers))
        assert atoms == set(canonical)


def test_ucp_rules_roundtrip_across_layouts(
    canonical: dict[str, np.ndarray], tmp_path: Path
) -> None:
    ucp = pytest.importorskip("ucp_jax")
    if not all(hasattr(ucp, n) for n in ("save", "restore")):
        pytest.skip("the core library does not export save/restore yet")
    src, dst = Layout(stages=2, data=2, tensor=2), Layout(data=2, fsdp=2, tensor=2)
    _, state = _train(src, canonical, 1)
    path = tmp_path / "ckpt"
    ucp.save(path, state["params"], state["opt_state"], step=1, rules=demo.ucp_rules(CFG, src))
    mesh, optimizer = demo.make_mesh(dst), demo.make_optimizer()
    p_target = demo.abstract_params(CFG, dst, mesh)
    o_target = demo.abstract_opt_state(optimizer, p_target)
    params, opt_state = ucp.restore(path, p_target, o_target, rules=demo.ucp_rules(CFG, dst))
    for a, b in ((state["params"], params), (state["opt_state"][1][0].nu, opt_state[1][0].nu)):
        wa, wb = demo.from_layout(a, CFG, src), demo.from_layout(b, CFG, dst)
        for name in canonical:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
    assert int(opt_state[1][0].count) == 1
