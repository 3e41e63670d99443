"""Mixture of experts: a sparse Llama (Mixtral-style) checkpoint moves between EP/TP/PP layouts.

Layout A (dp2-ep4: 4 experts, one per expert shard) trains steps 1..6 and saves a universal
checkpoint after step 3; every expert of every layer is an atom of its own
(``blocks.{i}.experts.{e}.gate_up.kernel`` ...), Adam's moments follow it. Each resumed layout (EP 2,
EP 1 with the experts replicated, EP 2 x TP 2, 2 pipeline stages) restores it through its own rules
and trains 4..6 on the same batches: the losses (cross-entropy + load-balancing loss) equal A's to
a relative 1e-5 and the restored state is bit-identical to A's. Asking for another number of
experts than were saved is an error.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucp_jax as ucp
from ucp_jax.demo import GPTConfig, make_optimizer
from ucp_jax.demo.experiment import state_differences
from ucp_jax.demo.train import abstract_opt_state
from ucp_jax.demo.train import batch as demo_batch
from ucp_jax.demo.train import init_opt_state
from ucp_jax.models.llama import (
    LlamaConfig,
    MoELayout,
    abstract_params,
    from_layout,
    init_canonical,
    make_mesh,
    make_train_step,
    to_layout,
    ucp_rules,
)

CFG = LlamaConfig(model_type="mixtral", n_experts=4, top_k=2, d_ff=64, n_layers=2)
SEQ, BATCH, SAVE_AT, STEPS = 16, 8, 3, 6
REL_TOL = 1e-5
LAYOUT_A = MoELayout(expert=4, data=2)
RESUMED = [
    MoELayout(expert=2, data=2),  # EP 4 -> 2
    MoELayout(data=2),  # EP 4 -> 1: every device holds all experts
    MoELayout(expert=2, tensor=2, data=2),  # EP 2 x TP 2: gate_up fused per TP shard per expert
    MoELayout(stages=2, expert=2, data=2),  # [L] -> [2 stages, L/2] stacking, EP 2
]


def _batch(step: int, mesh: Any) -> Any:
    """Learnable tokens (arithmetic progressions mod vocab) for a step, batch-sharded."""
    return demo_batch(GPTConfig(vocab_size=CFG.vocab_size, seq_len=SEQ), step, BATCH, mesh)


def _canonical(params: Any, opt_state: Any, layout: MoELayout) -> dict[str, np.ndarray]:
    adam = opt_state[1][0]
    out = {"step": np.asarray(adam.count)}
    for slot, tree in (("fp32", params), ("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        out.update({f"{slot}/{k}": v for k, v in from_layout(tree, CFG, layout).items()})
    return out


def _run(
    layout: MoELayout, steps: range, *, restore: Path | None = None, save: Path | None = None
) -> tuple[dict[int, float], dict[str, np.ndarray], float]:
    t0 = time.perf_counter()
    mesh, optimizer = make_mesh(layout), make_optimizer()
    rules = ucp_rules(CFG, layout)
    state: dict[str, np.ndarray] = {}
    if restore is None:
        params = to_layout(init_canonical(CFG), CFG, layout, mesh)
        opt_state = init_opt_state(optimizer, params)
    else:
        p_target = abstract_params(CFG, layout, mesh)
        o_target = abstract_opt_state(optimizer, p_target)
        params, opt_state = ucp.restore(restore, p_target, o_target, rules=rules)
        state = _canonical(params, opt_state, layout)
    step_fn = make_train_step(CFG, layout, mesh, optimizer)
    losses = {}
    for s in steps:
        params, opt_state, loss = step_fn(params, opt_state, _batch(s, mesh))
        losses[s] = float(loss)
        if save is not None and s == SAVE_AT:
            ucp.save(save, params, opt_state, step=s, rules=rules)
            state = _canonical(params, opt_state, layout)
    return losses, state, time.perf_counter() - t0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe") / f"step_{SAVE_AT}"


@pytest.fixture(scope="module")
def uninterrupted(checkpoint: Path) -> tuple[dict[int, float], dict[str, np.ndarray], float]:
    return _run(LAYOUT_A, range(1, STEPS + 1), save=checkpoint)


def test_expert_atoms_one_per_expert(uninterrupted: Any, checkpoint: Path) -> None:
    ck = ucp.Checkpoint(checkpoint)
    names = set(ck.manifest.atoms)
    for i in range(CFG.n_layers):
        assert f"blocks.{i}.router.kernel" in names
        for e in range(CFG.n_experts):
            for w in ("gate_up.kernel", "down.kernel"):
                assert f"blocks.{i}.experts.{e}.{w}" in names
    assert not any(".mlp." in n for n in names), "a sparse model has no dense MLP"
    losses = uninterrupted[0]
    assert all(np.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1], losses


@pytest.mark.parametrize("layout", RESUMED, ids=lambda lay: lay.name)
def test_resume_on_other_expert_layout(
    layout: MoELayout, uninterrupted: Any, checkpoint: Path
) -> None:
    ref_losses, ref_state, _ = uninterrupted
    losses, state, secs = _run(layout, range(SAVE_AT + 1, STEPS + 1), restore=checkpoint)
    diffs = state_differences(ref_state, state)
    assert not diffs, f"{layout.name}: restored state differs from A's: {diffs}"
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    ref = np.array([ref_losses[s] for s in steps])
    got = np.array([losses[s] for s in steps])
    rel = np.abs(got / ref - 1.0)
    print(
        f"\n{LAYOUT_A.name} -> {layout.name}: max rel loss diff {rel.max():.2e} "
        f"(tolerance {REL_TOL:.0e}, {secs:.1f}s)"
    )
    assert rel.max() <= REL_TOL, (steps, got.tolist(), ref.tolist())


@pytest.mark.parametrize("n_experts", [2, 8])
def test_other_number_of_experts_is_an_error(
    n_experts: int, uninterrupted: Any, checkpoint: Path
) -> None:
    cfg = LlamaConfig(model_type="mixtral", n_experts=n_experts, d_ff=64, n_layers=2)
    layout = MoELayout(expert=2)
    target = abstract_params(cfg, layout, make_mesh(layout))
    with pytest.raises((ucp.MismatchError, ucp.PatternError)) as err:
        ucp.restore(checkpoint, target, rules=ucp_rules(cfg, layout))
    msg = str(err.value)
    assert "router" in msg or "experts" in msg, msg
