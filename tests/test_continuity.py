"""Reconfiguration: a universal checkpoint resumes under other parallel layouts, the loss continues.

Layout A (pp2-dp2-tp2) trains steps 1..20 and saves a universal checkpoint after step 10. Each
resumed layout restores it through its own `ucp_rules` (other TP degree -> other fused QKV/SwiGLU
column order and vocabulary padding; other stage count -> other `[stages, L/stages]` stacking) and
trains steps 11..20 on the same batches. Its losses must equal A's to a relative 1e-5 (fp32
reduction order differs between meshes, nothing else), and its restored state, mapped back to the
canonical layout with `from_layout`, must be bit-identical to A's state at step 10.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ucp_jax.demo import GPTConfig, Layout, init_canonical
from ucp_jax.demo.experiment import Run, run_layout, state_differences

CFG = GPTConfig()
SAVE_AT, STEPS, BATCH = 10, 20, 16
REL_TOL = 1e-5
LAYOUT_A = Layout(stages=2, data=2, tensor=2)
RESUMED = [
    Layout(data=4, tensor=2),  # 2 stages -> 1, same TP
    Layout(data=8),  # TP 2 -> 1, 2 stages -> 1
    Layout(fsdp=4, tensor=2),  # params and moments also sharded over fsdp, 1 stage
    Layout(data=2, tensor=4),  # TP 2 -> 4, 1 stage
    Layout(stages=4, data=2),  # 2 stages -> 4 ([2, 2] stacking -> [4, 1]), TP 2 -> 1
]


def test_the_resumed_layouts_change_tp_and_stages() -> None:
    tps = {lay.tensor for lay in RESUMED} - {LAYOUT_A.tensor}
    stages = {lay.stages for lay in RESUMED} - {LAYOUT_A.stages}
    both = [
        lay for lay in RESUMED if lay.tensor != LAYOUT_A.tensor and lay.stages != LAYOUT_A.stages
    ]
    assert len(tps) >= 2 and len(stages) >= 2 and len(both) >= 2, (tps, stages, both)
    assert all(BATCH % (lay.data * lay.fsdp) == 0 for lay in (LAYOUT_A, *RESUMED))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("continuity") / f"step_{SAVE_AT}"


@pytest.fixture(scope="module")
def uninterrupted(checkpoint: Path) -> Run:
    """A trains 1..20 without interruption, saving the universal checkpoint after step 10."""
    return run_layout(
        CFG,
        LAYOUT_A,
        range(1, STEPS + 1),
        label="A",
        batch_size=BATCH,
        save_at=SAVE_AT,
        save_to=checkpoint,
    )


@pytest.fixture(scope="module", params=RESUMED, ids=lambda lay: lay.name)
def resumed(request: pytest.FixtureRequest, uninterrupted: Run, checkpoint: Path) -> Run:
    """One layout restores A's checkpoint and trains 11..20 (once per layout, shared by tests)."""
    return run_layout(
        CFG,
        request.param,
        range(SAVE_AT + 1, STEPS + 1),
        label=request.param.name,
        batch_size=BATCH,
        restore_from=checkpoint,
    )


def test_uninterrupted_run_learns(uninterrupted: Run) -> None:
    losses = uninterrupted.losses
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(np.isfinite(v) for v in losses.values())
    assert losses[STEPS] < losses[1] - 1.0, losses
    assert int(uninterrupted.state["step"]) == SAVE_AT


def test_resumed_losses_match_the_uninterrupted_run(uninterrupted: Run, resumed: Run) -> None:
    steps = list(range(SAVE_AT + 1, STEPS + 1))
    assert sorted(resumed.losses) == steps
    ref = np.array([uninterrupted.losses[s] for s in steps])
    got = np.array([resumed.losses[s] for s in steps])
    rel = np.abs(got / ref - 1.0)
    print(
        f"\n{LAYOUT_A.name} -> {resumed.layout.name}: steps {steps[0]}..{steps[-1]}, "
        f"max rel diff {rel.max():.2e} (tolerance {REL_TOL:.0e}, {resumed.seconds:.1f}s)"
    )
    worst = int(rel.argmax())
    assert rel.max() <= REL_TOL, (
        f"step {steps[worst]}: resumed {got[worst]!r} vs uninterrupted {ref[worst]!r}; "
        f"all rel diffs {rel.tolist()}"
    )
    # it resumed the trained state, not the init: the first resumed loss is far below step 1's
    assert resumed.losses[SAVE_AT + 1] < uninterrupted.losses[1] - 0.5


def test_restored_state_is_bit_identical(uninterrupted: Run, resumed: Run) -> None:
    saved, restored = uninterrupted.state, resumed.state
    atoms = set(init_canonical(CFG))  # params and both Adam moments, every canonical atom
    assert set(saved) == {"step"} | {
        f"{s}/{a}" for s in ("fp32", "exp_avg", "exp_avg_sq") for a in atoms
    }
    diffs = state_differences(saved, restored)
    assert not diffs, (
        f"{resumed.layout.name}: not bit-identical to A's step-{SAVE_AT} state: {diffs}"
    )
    assert int(restored["step"]) == SAVE_AT
    print(
        f"\n{LAYOUT_A.name} -> {resumed.layout.name}: restored state bit-identical "
        f"({len(saved) - 1} canonical arrays + Adam count)"
    )
