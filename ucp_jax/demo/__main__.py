"""``python -m ucp_jax.demo``: train in one layout, save a universal checkpoint, resume in another.

Layout A (data=2, tensor=4) trains from the canonical init and saves at ``--save-at``; layout B
(data=4, tensor=2) restores that checkpoint and trains on. The loss curve must continue exactly.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .layouts import from_layout, init_canonical, to_layout
from .model import GPTConfig, Layout, abstract_params, make_mesh, ucp_rules
from .train import abstract_opt_state, batch, init_opt_state, make_optimizer, make_train_step

TOLERANCE = 1e-5


def run_layout(
    config: GPTConfig,
    layout: Layout,
    steps: range,
    *,
    batch_size: int = 16,
    restore_from: Path | None = None,
    save_at: dict[int, Path] | None = None,
    snapshots: dict[str, dict[str, np.ndarray]] | None = None,
) -> dict[int, float]:
    """Train ``layout`` over ``steps``, from the canonical init or a universal checkpoint.

    Args:
        config: the model configuration.
        layout: the parallel layout to train in.
        steps: the steps to run (step ``s`` trains on ``batch(config, s, ...)``).
        batch_size: global batch size.
        restore_from: a universal checkpoint to resume from (default: the canonical init).
        save_at: ``{step: path}``: save a universal checkpoint after these steps.
        snapshots: if given, receives the canonical state (:func:`canonical_state`) under
            ``"saved@<step>"`` for each save and ``"restored"`` after a restore.

    Returns:
        ``{step: loss}`` (the loss of the batch of each step, before its update).
    """
    import ucp_jax as ucp  # lazy: the model itself does not need the core library

    mesh = make_mesh(layout)
    optimizer = make_optimizer()
    rules = ucp_rules(config, layout)
    if restore_from is None:
        params = to_layout(init_canonical(config), config, layout, mesh)
        opt_state = init_opt_state(optimizer, params)
    else:
        p_target = abstract_params(config, layout, mesh)
        o_target = abstract_opt_state(optimizer, p_target)
        params, opt_state = ucp.restore(restore_from, p_target, o_target, rules=rules)
        if snapshots is not None:
            snapshots["restored"] = canonical_state(params, opt_state, config, layout)
    train_step = make_train_step(config, layout, mesh, optimizer)
    losses: dict[int, float] = {}
    for step in steps:
        params, opt_state, loss = train_step(
            params, opt_state, batch(config, step, batch_size, mesh)
        )
        losses[step] = float(loss)
        if save_at and step in save_at:
            path = save_at[step]
            if path.exists():  # our own output from an earlier run
                shutil.rmtree(path)
            ucp.save(path, params, opt_state, step=step, rules=rules)
            if snapshots is not None:
                snapshots[f"saved@{step}"] = canonical_state(params, opt_state, config, layout)
    return losses


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
        A flat dict of numpy arrays, comparable across layouts.
    """
    adam = opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    out = {"step": np.asarray(adam.count)}
    for slot, tree in (("fp32", params), ("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        out.update({f"{slot}/{k}": v for k, v in from_layout(tree, config, layout).items()})
    return out


def print_table(columns: dict[str, dict[int, float]], reference: str, resumed: str) -> float:
    """Print ``step | loss <column>... | rel diff`` and return the largest relative difference.

    Args:
        columns: ``{column title: {step: loss}}``, in display order.
        reference: the title of the column the relative difference is taken against.
        resumed: the title of the column compared with ``reference``.

    Returns:
        The largest ``|resumed / reference - 1|`` over the steps both columns have.
    """
    steps = sorted({s for col in columns.values() for s in col})
    titles = [*columns, "rel diff"]
    widths = [max(14, len(t)) for t in titles]
    print(" | ".join([f"{'step':>4}"] + [f"{t:>{w}}" for t, w in zip(titles, widths)]))
    print("-+-".join(["-" * 4] + ["-" * w for w in widths]))
    worst = 0.0
    for s in steps:
        cells = [
            f"{columns[t][s]:>{w}.7f}" if s in columns[t] else " " * w
            for t, w in zip(columns, widths)
        ]
        ref, res = columns[reference].get(s), columns[resumed].get(s)
        if ref is not None and res is not None:
            rel = abs(res / ref - 1.0)
            worst = max(worst, rel)
            cells.append(f"{rel:>{widths[-1]}.2e}")
        else:
            cells.append(" " * widths[-1])
        print(" | ".join([f"{s:>4}", *cells]).rstrip())
    return worst


def main(argv: Sequence[str] | None = None) -> int:
    """Run the layout-change experiment.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 when the resumed losses match within the tolerance.
    """
    parser = argparse.ArgumentParser(prog="python -m ucp_jax.demo", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output directory")
    parser.add_argument("--steps", type=int, default=10, help="total training steps")
    parser.add_argument("--save-at", type=int, default=None, help="checkpoint step (steps // 2)")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    save_at = args.steps // 2 if args.save_at is None else args.save_at
    if not 1 <= save_at < args.steps:
        parser.error("--save-at must be in [1, steps)")
    layout_a, layout_b = Layout(data=2, tensor=4), Layout(data=4, tensor=2)
    if jax.device_count() < max(layout_a.size, layout_b.size):
        print(
            f"need {layout_a.size} devices, have {jax.device_count()}; on CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8",
            file=sys.stderr,
        )
        return 2
    config = GPTConfig()
    ckpt = (args.out / f"step_{save_at}").absolute()
    t0 = time.perf_counter()
    snaps: dict[str, dict[str, np.ndarray]] = {}
    losses_a = run_layout(
        config,
        layout_a,
        range(1, args.steps + 1),
        batch_size=args.batch_size,
        save_at={save_at: ckpt},
        snapshots=snaps,
    )
    t1 = time.perf_counter()
    losses_b = run_layout(
        config,
        layout_b,
        range(save_at + 1, args.steps + 1),
        batch_size=args.batch_size,
        restore_from=ckpt,
        snapshots=snaps,
    )
    t2 = time.perf_counter()
    a, b = f"loss A ({layout_a.name})", f"loss B ({layout_b.name}, resumed)"
    print(
        f"layout A {layout_a.name} trains steps 1..{args.steps}, saves {ckpt} after step {save_at}"
    )
    print(f"layout B {layout_b.name} restores it and trains steps {save_at + 1}..{args.steps}\n")
    worst = print_table({a: losses_a, b: losses_b}, reference=a, resumed=b)
    saved, restored = snaps[f"saved@{save_at}"], snaps["restored"]
    exact = saved.keys() == restored.keys() and all(
        np.array_equal(saved[k], restored[k]) for k in saved
    )
    print(
        f"\nstate restored in {layout_b.name} vs saved in {layout_a.name} (params, Adam moments, "
        f"count; canonical layout): {'bit-identical' if exact else 'DIFFERENT'}"
    )
    ok = exact and worst <= TOLERANCE
    print(
        f"\nmax rel diff {worst:.2e} (tolerance {TOLERANCE:.0e}): "
        f"{'OK, the loss curve continues' if ok else 'MISMATCH'}  "
        f"[A {t1 - t0:.1f}s, B {t2 - t1:.1f}s]"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
