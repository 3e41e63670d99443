"""The reconfiguration experiment: train in one layout, checkpoint, resume in other layouts.

Layout A trains from the canonical init to ``steps`` and saves a universal checkpoint after
``save_at``; every resumed layout restores that checkpoint (params and Adam state, laid out for its
own mesh by its own ``ucp_rules``) and trains ``save_at + 1 .. steps`` on the same batches. The loss
curves must continue: the resumed losses equal A's to float32 rounding, and the restored state,
mapped back to the canonical layout, is bit-identical to A's state at ``save_at``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..models.parallel import Layout, make_mesh
from ..models.placement import abstract_opt_state
from .layouts import from_layout, init_canonical, to_layout
from .model import GPTConfig, abstract_params, ucp_rules
from .train import batch, init_opt_state, make_optimizer, make_train_step

TOLERANCE = 1e-5
"""Largest relative difference accepted between a resumed loss and the uninterrupted one."""

LAYOUT_A = Layout(stages=2, data=2, tensor=2)
"""The layout that trains uninterrupted and writes the checkpoint (``pp2-dp2-tp2``)."""

RESUMED: dict[str, Layout] = {
    "B": Layout(data=4, tensor=2),  # one stage instead of two
    "C": Layout(data=8),  # no tensor parallelism, one stage
    "D": Layout(fsdp=4, tensor=2),  # parameters and moments sharded over fsdp too
    "E": Layout(data=2, tensor=4),  # twice the tensor-parallel degree: a different fused layout
}
"""The layouts that resume from A's checkpoint, by label."""


@dataclasses.dataclass
class Run:
    """One layout's training run.

    Attributes:
        label: ``"A"`` for the uninterrupted run, ``"B"``... for the resumed ones.
        layout: its parallel layout.
        losses: ``{step: loss}``, the loss of each step's batch before its update.
        state: the canonical state (:func:`canonical_state`): for A the state saved at the
            checkpoint step, for a resumed run the state right after its restore.
        seconds: wall time of the run (compile, restore and steps).
    """

    label: str
    layout: Layout
    losses: dict[int, float]
    state: dict[str, np.ndarray]
    seconds: float = 0.0


def canonical_state(
    params: Any, opt_state: Any, config: GPTConfig, layout: Layout
) -> dict[str, np.ndarray]:
    """Params and Adam moments in the canonical layout, as numpy (``<slot>/<atom name>``).

    Args:
        params: the params in ``layout``.
        opt_state: the state of :func:`make_optimizer` for them.
        config: the model configuration.
        layout: the layout of ``params``.

    Returns:
        A flat dict of numpy arrays (and ``"step"``, Adam's count), comparable across layouts.
    """
    adam = opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    out = {"step": np.asarray(adam.count)}
    for slot, tree in (("fp32", params), ("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        out.update({f"{slot}/{k}": v for k, v in from_layout(tree, config, layout).items()})
    return out


def state_differences(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> list[str]:
    """The entries of two canonical states that are not bit-identical (missing ones included).

    Args:
        a: a canonical state.
        b: another one.

    Returns:
        Sorted names whose shape, dtype or bytes differ, or that only one side has.
    """
    diff = set(a) ^ set(b)
    for k in set(a) & set(b):
        x, y = np.asarray(a[k]), np.asarray(b[k])
        if x.shape != y.shape or x.dtype != y.dtype or x.tobytes() != y.tobytes():
            diff.add(k)
    return sorted(diff)


def run_layout(
    config: GPTConfig,
    layout: Layout,
    steps: range,
    *,
    label: str = "",
    batch_size: int = 16,
    restore_from: Path | None = None,
    save_at: int | None = None,
    save_to: Path | None = None,
) -> Run:
    """Train ``layout`` over ``steps``, from the canonical init or from a universal checkpoint.

    Args:
        config: the model configuration.
        layout: the parallel layout to train in.
        steps: the steps to run (step ``s`` trains on ``batch(config, s, ...)``).
        label: the run's label.
        batch_size: global batch size.
        restore_from: a universal checkpoint to resume from (default: the canonical init).
        save_at: save a universal checkpoint to ``save_to`` after this step.
        save_to: where to save it (replaced if it exists).

    Returns:
        The run; its ``state`` is the restored state (``restore_from``) or the saved one.
    """
    return train_run(DEMO_FAMILY, config, layout, steps, label=label, batch_size=batch_size,
                     restore_from=restore_from, save_at=save_at, save_to=save_to)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Family:
    """What a reconfiguration run needs of a model family (the demo GPT, the sparse Llama...).

    Each field is the family's function of that name: ``make_mesh(layout)``,
    ``ucp_rules(config, layout)``, ``init_canonical(config)``,
    ``to_layout(canonical, config, layout, mesh)``, ``abstract_params(config, layout, mesh)``,
    ``make_train_step(config, layout, mesh, optimizer)``, ``batch(config, step, batch_size, mesh)``
    and ``state(params, opt_state, config, layout)`` (canonical numpy atoms per slot).
    """

    make_mesh: Any
    ucp_rules: Any
    init_canonical: Any
    to_layout: Any
    abstract_params: Any
    make_train_step: Any
    batch: Any
    state: Any


def train_run(
    family: Family,
    config: Any,
    layout: Layout,
    steps: range,
    *,
    label: str,
    batch_size: int,
    restore_from: Path | None,
    save_at: int | None,
    save_to: Path | None,
) -> Run:
    """`run_layout` for any model family (the arguments are `run_layout`'s)."""
    import ucp_jax as ucp  # lazy: the model itself does not need the core library

    t0 = time.perf_counter()
    mesh = family.make_mesh(layout)
    optimizer = make_optimizer()
    rules = family.ucp_rules(config, layout)
    state: dict[str, np.ndarray] = {}
    if restore_from is None:
        params = family.to_layout(family.init_canonical(config), config, layout, mesh)
        opt_state = init_opt_state(optimizer, params)
    else:
        p_target = family.abstract_params(config, layout, mesh)
        o_target = abstract_opt_state(optimizer, p_target)
        params, opt_state = ucp.restore(restore_from, p_target, o_target, rules=rules)
        state = family.state(params, opt_state, config, layout)
    train_step = family.make_train_step(config, layout, mesh, optimizer)
    losses: dict[int, float] = {}
    for step in steps:
        params, opt_state, loss = train_step(
            params, opt_state, family.batch(config, step, batch_size, mesh)
        )
        losses[step] = float(loss)
        if save_at is not None and step == save_at and save_to is not None:
            if save_to.exists():  # our own output from an earlier run
                shutil.rmtree(save_to)
            ucp.save(save_to, params, opt_state, step=step, rules=rules)
            state = family.state(params, opt_state, config, layout)
    return Run(label, layout, losses, state, time.perf_counter() - t0)


@dataclasses.dataclass
class Experiment:
    """The runs of the reconfiguration experiment and what they show.

    Attributes:
        config: the model configuration.
        steps: the last training step.
        save_at: the checkpoint step.
        checkpoint: the universal checkpoint A wrote.
        runs: ``{label: Run}``, the uninterrupted run ``"A"`` first.
    """

    config: Any  # GPTConfig; the sparse experiment's LlamaConfig (ucp_jax.demo.moe_experiment)
    steps: int
    save_at: int
    checkpoint: Path
    runs: dict[str, Run]

    @property
    def reference(self) -> Run:
        """The uninterrupted run (the first one)."""
        return next(iter(self.runs.values()))

    @property
    def resumed(self) -> list[Run]:
        """The resumed runs, in order."""
        return list(self.runs.values())[1:]

    def rel_diffs(self) -> dict[str, dict[int, float]]:
        """``{label: {step: |loss / loss_A - 1|}}`` of each resumed run."""
        ref = self.reference.losses
        return {
            r.label: {s: abs(v / ref[s] - 1.0) for s, v in r.losses.items()} for r in self.resumed
        }

    def max_rel_diff(self) -> dict[str, float]:
        """``{label: largest relative loss difference to A}`` of each resumed run."""
        return {k: max(d.values(), default=0.0) for k, d in self.rel_diffs().items()}

    def worst(self) -> float:
        """The largest relative loss difference of any resumed run."""
        return max(self.max_rel_diff().values(), default=0.0)

    def state_mismatches(self) -> dict[str, list[str]]:
        """``{label: names}`` of restored state entries not bit-identical to A's saved state."""
        saved = self.reference.state
        return {r.label: state_differences(saved, r.state) for r in self.resumed}

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        """Every resumed loss within ``tolerance`` of A's, every restored state bit-identical."""
        return self.worst() <= tolerance and not any(self.state_mismatches().values())

    def table(self) -> str:
        """The loss table ``step | A | B | ... | max rel diff`` as text."""
        heads = [f"{r.label} {r.layout.name}" for r in self.runs.values()]
        widths = [max(11, len(h)) for h in heads]
        rel = self.rel_diffs()
        lines = [
            " | ".join(
                [f"{'step':>4}", *(f"{h:>{w}}" for h, w in zip(heads, widths)), "max rel diff"]
            ),
            "-+-".join(["-" * 4, *("-" * w for w in widths), "-" * 12]),
        ]
        for s in range(1, self.steps + 1):
            cells = [
                f"{r.losses[s]:>{w}.7f}" if s in r.losses else " " * w
                for r, w in zip(self.runs.values(), widths)
            ]
            diffs = [d[s] for d in rel.values() if s in d]
            cells.append(f"{max(diffs):>12.2e}" if diffs else "")
            lines.append(" | ".join([f"{s:>4}", *cells]).rstrip())
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The table and the checks, as JSON-able data (what ``losses.json`` holds)."""
        rel = self.rel_diffs()
        rows = []
        for s in range(1, self.steps + 1):
            row: dict[str, Any] = {"step": s}
            row.update({r.label: r.losses.get(s) for r in self.runs.values()})
            diffs = [d[s] for d in rel.values() if s in d]
            row["max_rel_diff"] = max(diffs) if diffs else None
            rows.append(row)
        return {
            "config": dataclasses.asdict(self.config),
            "steps": self.steps,
            "save_at": self.save_at,
            "checkpoint": str(self.checkpoint),
            "layouts": {r.label: r.layout.name for r in self.runs.values()},
            "uninterrupted": self.reference.label,
            "tolerance": TOLERANCE,
            "max_rel_diff": self.max_rel_diff(),
            "max_rel_diff_overall": self.worst(),
            "state_bit_identical": {k: not v for k, v in self.state_mismatches().items()},
            "seconds": {r.label: round(r.seconds, 2) for r in self.runs.values()},
            "table": rows,
        }

    def save_json(self, path: Path) -> None:
        """Write :meth:`to_json` to ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def plot(self, path: Path | None = None, *, dpi: int = 100) -> Any:
        """Plot the loss curves (A as a line, the resumed runs as markers) and the differences.

        Uses matplotlib's Agg canvas directly (no pyplot, no GUI backend).

        Args:
            path: save the figure as PNG here, if given.
            dpi: resolution of the PNG.

        Returns:
            The ``matplotlib.figure.Figure``.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(11, 4.2), layout="constrained")
        FigureCanvasAgg(fig)
        ax, ax_diff = fig.subplots(1, 2, width_ratios=(3, 2))
        ref = self.reference
        xs = sorted(ref.losses)
        ax.plot(xs, [ref.losses[s] for s in xs], "-", color="k", lw=2, label=f"A {ref.layout.name}")
        markers, rel = "osD^vP*X", self.rel_diffs()
        for k, r in enumerate(self.resumed):
            rs = sorted(r.losses)
            style = {"marker": markers[k % len(markers)], "ls": "none", "ms": 9 - 1.2 * k}
            ax.plot(
                rs,
                [r.losses[s] for s in rs],
                mfc="none",
                mew=1.5,
                **style,
                label=f"{r.label} {r.layout.name} (resumed)",
            )
            floor = [max(rel[r.label][s], 1e-10) for s in rs]
            ax_diff.plot(rs, floor, **style, mfc="none", label=r.label)
        for a in (ax, ax_diff):
            a.axvline(self.save_at + 0.5, color="grey", ls=":", lw=1)
            a.set_xlabel("training step")
            a.set_xlim(0.5, self.steps + 0.5)
            a.set_xticks(
                range(2, self.steps + 1, 2) if self.steps > 10 else range(1, self.steps + 1)
            )
            a.grid(alpha=0.3)
        ax.annotate(
            f"universal checkpoint\n(step {self.save_at})",
            (self.save_at + 0.3, 0.03),
            xycoords=("data", "axes fraction"),
            ha="right",
            va="bottom",
            fontsize=8,
            color="grey",
        )
        ax.set_ylabel("training loss (cross-entropy)")
        ax.set_title(
            f"Trained in {ref.layout.name}, resumed at step {self.save_at} in other layouts"
        )
        ax.legend(fontsize=8)
        ax_diff.axhline(TOLERANCE, color="r", ls="--", lw=1, label=f"tolerance {TOLERANCE:.0e}")
        ax_diff.set_yscale("log")
        ax_diff.set_ylim(3e-11, 1e-2)
        ax_diff.set_ylabel("|loss / loss_A − 1|  (0 drawn at 1e-10)")
        ax_diff.set_title("Relative difference to the uninterrupted run")
        ax_diff.legend(fontsize=8, ncol=2)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=dpi)
        return fig


def run_experiment(
    config: GPTConfig | None = None,
    layout_a: Layout = LAYOUT_A,
    resumed: Mapping[str, Layout] | None = None,
    *,
    steps: int = 20,
    save_at: int = 10,
    batch_size: int = 16,
    checkpoint: Path = Path("demo_out/step_10"),
) -> Experiment:
    """Train ``layout_a`` to ``steps`` saving at ``save_at``; resume each layout from the save.

    Args:
        config: the model configuration (default ``GPTConfig()``).
        layout_a: the uninterrupted layout (label ``"A"``).
        resumed: ``{label: layout}`` to resume in (default :data:`RESUMED`).
        steps: the last step.
        save_at: the checkpoint step, in ``[1, steps)``.
        batch_size: global batch size, a multiple of every layout's ``data * fsdp``.
        checkpoint: where A saves the universal checkpoint (replaced if it exists).

    Returns:
        The :class:`Experiment`.
    """
    config = GPTConfig() if config is None else config
    resumed = RESUMED if resumed is None else resumed
    if not 1 <= save_at < steps:
        raise ValueError(f"save_at={save_at} must be in [1, steps={steps})")
    for lay in (layout_a, *resumed.values()):
        lay.check(config)
        if batch_size % (lay.data * lay.fsdp):
            raise ValueError(f"batch_size={batch_size} is not a multiple of {lay.name}'s data*fsdp")
    checkpoint = Path(checkpoint).absolute()
    runs = {
        "A": run_layout(
            config,
            layout_a,
            range(1, steps + 1),
            label="A",
            batch_size=batch_size,
            save_at=save_at,
            save_to=checkpoint,
        )
    }
    for label, lay in resumed.items():
        runs[label] = run_layout(
            config,
            lay,
            range(save_at + 1, steps + 1),
            label=label,
            batch_size=batch_size,
            restore_from=checkpoint,
        )
    return Experiment(config, steps, save_at, checkpoint, runs)


DEMO_FAMILY = Family(make_mesh, ucp_rules, init_canonical, to_layout, abstract_params,
                     make_train_step, batch, canonical_state)  # fmt: skip
"""The demo GPT as a :class:`Family`."""
