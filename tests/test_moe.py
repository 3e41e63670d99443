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

from pathlib import Path

import numpy as np
import pytest
from helpers import need_devices

import ucp_jax as ucp
from ucp_jax.demo.experiment import Run, state_differences
from ucp_jax.demo.moe_experiment import SPARSE_A, SPARSE_CONFIG, SPARSE_RESUMED, run_sparse
from ucp_jax.models.llama import LlamaConfig, MoELayout, abstract_params, make_mesh, ucp_rules

CFG = SPARSE_CONFIG
SAVE_AT, STEPS = 3, 6
REL_TOL = 1e-5


def test_the_resumed_layouts_change_ep_tp_and_stages() -> None:
    lays = list(SPARSE_RESUMED.values())
    assert {lay.expert for lay in lays} == {1, 2} and SPARSE_A.expert == 4
    assert any(lay.expert == 2 and lay.tensor == 2 for lay in lays)
    assert any(lay.stages != SPARSE_A.stages for lay in lays)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe") / f"step_{SAVE_AT}"


@pytest.fixture(scope="module")
def uninterrupted(checkpoint: Path) -> Run:
    return run_sparse(SPARSE_A, range(1, STEPS + 1), label="A", save_at=SAVE_AT, save_to=checkpoint)


def test_expert_atoms_one_per_expert(uninterrupted: Run, checkpoint: Path) -> None:
    names = set(ucp.Checkpoint(checkpoint).manifest.atoms)
    for i in range(CFG.n_layers):
        assert f"blocks.{i}.router.kernel" in names
        for e in range(CFG.n_experts):
            for w in ("gate_up.kernel", "down.kernel"):
                assert f"blocks.{i}.experts.{e}.{w}" in names
    assert not any(".mlp." in n for n in names), "a sparse model has no dense MLP"
    # Adam's moments follow their expert: the saved state has them for every expert atom
    assert "exp_avg_sq/blocks.1.experts.3.down.kernel" in uninterrupted.state
    losses = uninterrupted.losses
    assert all(np.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1], losses


@pytest.mark.parametrize("label", list(SPARSE_RESUMED))
def test_resume_on_other_expert_layout(label: str, uninterrupted: Run, checkpoint: Path) -> None:
    layout = SPARSE_RESUMED[label]
    run = run_sparse(layout, range(SAVE_AT + 1, STEPS + 1), label=label, restore_from=checkpoint)
    diffs = state_differences(uninterrupted.state, run.state)
    assert not diffs, f"{layout.name}: restored state differs from A's: {diffs}"
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    ref = np.array([uninterrupted.losses[s] for s in steps])
    got = np.array([run.losses[s] for s in steps])
    rel = np.abs(got / ref - 1.0)
    print(
        f"\n{SPARSE_A.name} -> {layout.name}: max rel loss diff {rel.max():.2e} "
        f"(tolerance {REL_TOL:.0e}, {run.seconds:.1f}s)"
    )
    assert rel.max() <= REL_TOL, (steps, got.tolist(), ref.tolist())


@pytest.mark.parametrize("n_experts", [2, 8])
def test_other_number_of_experts_is_an_error(
    n_experts: int, uninterrupted: Run, checkpoint: Path
) -> None:
    cfg = LlamaConfig(model_type="mixtral", n_experts=n_experts, d_ff=64, n_layers=2)
    layout = MoELayout(expert=2)
    target = abstract_params(cfg, layout, make_mesh(layout))
    with pytest.raises((ucp.MismatchError, ucp.PatternError)) as err:
        ucp.restore(checkpoint, target, rules=ucp_rules(cfg, layout))
    msg = str(err.value)
    assert "router" in msg or "experts" in msg, msg


def test_expert_axis_for_a_dense_model_is_refused() -> None:
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    with pytest.raises(ValueError, match="no experts"):
        abstract_params(LlamaConfig(), MoELayout(expert=2), make_mesh(MoELayout(expert=2)))
    with pytest.raises(ValueError, match="does not divide n_experts"):
        abstract_params(CFG, MoELayout(expert=8), make_mesh(MoELayout(expert=8)))


@pytest.mark.parametrize("n_experts", [2, 8])
def test_fewer_experts_without_the_router_is_an_error(
    n_experts: int, uninterrupted: Run, checkpoint: Path
) -> None:
    """Only the expert leaves restored (no router to give the count away): 2 of the 4 saved
    experts is an error naming the first expert left behind; 8 is a missing atom."""
    cfg = LlamaConfig(model_type="mixtral", n_experts=n_experts, d_ff=64, n_layers=2)
    layout = MoELayout(expert=2)
    experts = {
        "layers": {"experts": abstract_params(cfg, layout, make_mesh(layout))["layers"]["experts"]}
    }
    rules = [r for r in ucp_rules(cfg, layout) if "experts" in r[0]]
    with pytest.raises(ucp.MismatchError) as err:
        ucp.restore(checkpoint, experts, rules=rules)
    msg = str(err.value)
    if n_experts == 2:
        assert "stacks 2 atoms along its {e} axis" in msg and "blocks.0.experts.2." in msg, msg
    else:
        assert "blocks.0.experts.4." in msg, msg
    # the same target with the saved number of experts restores
    cfg4 = LlamaConfig(model_type="mixtral", n_experts=4, d_ff=64, n_layers=2)
    experts4 = {
        "layers": {"experts": abstract_params(cfg4, layout, make_mesh(layout))["layers"]["experts"]}
    }
    got, _ = ucp.restore(
        checkpoint, experts4, rules=[r for r in ucp_rules(cfg4, layout) if "experts" in r[0]]
    )
    assert got["layers"]["experts"]["down"]["kernel"].shape[1] == 4


def test_fewer_layers_is_an_error(uninterrupted: Run, checkpoint: Path) -> None:
    """The same check on the layer axis: a 1-layer target of the 2-layer checkpoint."""
    cfg = LlamaConfig(model_type="mixtral", n_experts=4, d_ff=64, n_layers=1)
    layout = MoELayout(expert=2)
    with pytest.raises(ucp.MismatchError, match=r"along its \{i\} axis.*blocks\.1\."):
        ucp.restore(checkpoint, abstract_params(cfg, layout, make_mesh(layout)),
                    rules=ucp_rules(cfg, layout))  # fmt: skip
