"""The reconfiguration experiment for the sparse (Mixtral-style) Llama: EP, TP and PP changes.

Layout A (dp2-ep4: 4 experts, one per expert shard) trains from the canonical init and saves a
universal checkpoint; every resumed layout (EP 2, EP 1 with the experts replicated, EP 2 x TP 2,
2 pipeline stages x EP 2) restores it through its own rules and trains on the same batches. The
result is a :class:`ucp_jax.demo.experiment.Experiment`, so it prints the demo's table.

>>> SPARSE_A.name, [lay.name for lay in SPARSE_RESUMED.values()]
('dp2-ep4', ['dp2-ep2', 'dp2', 'dp2-ep2-tp2', 'pp2-dp2-ep2'])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..models.llama import abstract_params, make_mesh, ucp_rules
from ..models.llama_config import LlamaConfig
from ..models.llama_layouts import from_layout, init_canonical, to_layout
from ..models.llama_train import make_train_step
from ..models.moe import MoELayout
from .experiment import Experiment, Family, Run, train_run
from .model import GPTConfig
from .train import batch as demo_batch

SPARSE_CONFIG = LlamaConfig(model_type="mixtral", n_experts=4, top_k=2, d_ff=64, n_layers=2)
"""The small sparse model: 2 layers, 4 SwiGLU experts each, top-2 routing."""

SPARSE_A = MoELayout(expert=4, data=2)
SPARSE_RESUMED: dict[str, MoELayout] = {
    "B": MoELayout(expert=2, data=2),  # EP 4 -> 2
    "C": MoELayout(data=2),  # EP 4 -> 1: every device holds every expert
    "D": MoELayout(expert=2, tensor=2, data=2),  # EP 2 x TP 2: gate_up fused per TP shard
    "E": MoELayout(stages=2, expert=2, data=2),  # [L] -> [2 stages, L / 2], EP 2
}
SEQ_LEN = 16


def sparse_batch(config: LlamaConfig, step: int, batch_size: int, mesh: Any) -> Any:
    """The demo's learnable tokens (arithmetic progressions mod vocab) ``[batch, SEQ_LEN + 1]``."""
    return demo_batch(
        GPTConfig(vocab_size=config.vocab_size, seq_len=SEQ_LEN), step, batch_size, mesh
    )


def sparse_state(
    params: Any, opt_state: Any, config: LlamaConfig, layout: MoELayout
) -> dict[str, np.ndarray]:
    """Params and Adam moments as canonical numpy atoms (``<slot>/<atom>``) and Adam's count."""
    adam = opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    out = {"step": np.asarray(adam.count)}
    for slot, tree in (("fp32", params), ("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        out.update({f"{slot}/{k}": v for k, v in from_layout(tree, config, layout).items()})
    return out


SPARSE_FAMILY = Family(make_mesh, ucp_rules, init_canonical, to_layout, abstract_params,
                       make_train_step, sparse_batch, sparse_state)  # fmt: skip
"""The sparse Llama as a :class:`ucp_jax.demo.experiment.Family`."""


def run_sparse(
    layout: MoELayout,
    steps: range,
    *,
    config: LlamaConfig = SPARSE_CONFIG,
    label: str = "",
    batch_size: int = 8,
    restore_from: Path | None = None,
    save_at: int | None = None,
    save_to: Path | None = None,
) -> Run:
    """Train the sparse model in ``layout`` over ``steps``, from the init or a universal checkpoint.

    Args:
        layout: the parallel layout (its ``expert`` axis shards the experts).
        steps: the steps to run (step ``s`` trains on :func:`sparse_batch` of ``s``).
        config: the sparse model configuration.
        label: the run's label.
        batch_size: global batch size (a multiple of ``data * fsdp``).
        restore_from: a universal checkpoint to resume from (default: the canonical init).
        save_at: save a universal checkpoint to ``save_to`` after this step.
        save_to: where to save it (replaced if it exists).

    Returns:
        The run; its ``state`` is the restored state (``restore_from``) or the saved one.
    """
    return train_run(SPARSE_FAMILY, config, layout, steps, label=label, batch_size=batch_size,
                     restore_from=restore_from, save_at=save_at, save_to=save_to)  # fmt: skip


def run_sparse_experiment(
    steps: int = 10, save_at: int = 5, batch_size: int = 8, checkpoint: Path | None = None
) -> Experiment:
    """A (:data:`SPARSE_A`) trains 1..steps saving at ``save_at``; B..E resume and train on.

    Args:
        steps: the last training step.
        save_at: the checkpoint step.
        batch_size: global batch size.
        checkpoint: where A writes the checkpoint (default: ``demo_out/sparse_step_<save_at>``).

    Returns:
        The experiment (its ``table()``, ``ok()`` ... as the dense demo's).
    """
    ck = checkpoint or Path("demo_out") / f"sparse_step_{save_at}"
    a = run_sparse(SPARSE_A, range(1, steps + 1), label="A", batch_size=batch_size,
                   save_at=save_at, save_to=ck)  # fmt: skip
    runs = {"A": a}
    for label, lay in SPARSE_RESUMED.items():
        runs[label] = run_sparse(lay, range(save_at + 1, steps + 1), label=label,
                                 batch_size=batch_size, restore_from=ck)  # fmt: skip
    return Experiment(SPARSE_CONFIG, steps, save_at, ck, runs)
