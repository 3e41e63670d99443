"""``python -m ucp_jax.demo``: one universal checkpoint, resumed in four other parallel layouts.

Layout A (pp2-dp2-tp2: 2 pipeline stages x 2 data x 2 tensor) trains steps 1..20 and saves a
universal checkpoint after step 10. Layouts B (dp4-tp2), C (dp8), D (fsdp4-tp2) and E (dp2-tp4)
each restore it with their own rules and train steps 11..20 on the same batches. The loss curves
must continue: every resumed loss equals A's within a relative 1e-5 (float32), and every restored
state is bit-identical to A's saved state. Writes ``losses.json`` and ``losses.png`` to ``--out``.

Then the same for a sparse (Mixtral-style, 4 experts, top-2) Llama: A dp2-ep4 saves, B dp2-ep2,
C dp2 (experts replicated), D dp2-ep2-tp2 and E pp2-dp2-ep2 resume (``--no-sparse`` skips it;
``sparse_losses.json``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax

from .experiment import LAYOUT_A, RESUMED, TOLERANCE, run_experiment


def main(argv: Sequence[str] | None = None) -> int:
    """Run the reconfiguration experiment.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 when every resumed run continues A's loss curve, 1 when one does not,
        2 when there are not enough devices.
    """
    parser = argparse.ArgumentParser(
        prog="python -m ucp_jax.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output directory")
    parser.add_argument("--steps", type=int, default=20, help="total training steps")
    parser.add_argument("--save-at", type=int, default=None, help="checkpoint step (steps // 2)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--sparse", action=argparse.BooleanOptionalAction, default=True,
        help="also run the mixture-of-experts experiment (EP/TP/PP changes)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    save_at = args.steps // 2 if args.save_at is None else args.save_at
    if not 1 <= save_at < args.steps:
        parser.error("--save-at must be in [1, steps)")
    need = max(lay.size for lay in (LAYOUT_A, *RESUMED.values()))
    if jax.device_count() < need:
        print(
            f"need {need} devices, have {jax.device_count()}; on CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8",
            file=sys.stderr,
        )
        return 2

    t0 = time.perf_counter()
    exp = run_experiment(
        steps=args.steps,
        save_at=save_at,
        batch_size=args.batch_size,
        checkpoint=args.out / f"step_{save_at}",
    )
    print(
        f"A {LAYOUT_A.name}: trains steps 1..{args.steps}, saves a universal checkpoint after "
        f"step {save_at}\n  -> {exp.checkpoint}"
    )
    for label, lay in RESUMED.items():
        print(f"{label} {lay.name}: restores it and trains steps {save_at + 1}..{args.steps}")
    print()
    print(exp.table())

    print(f"\nmax rel diff of the resumed losses vs A (tolerance {TOLERANCE:.0e}):")
    mismatches = exp.state_mismatches()
    for r in exp.resumed:
        bad = mismatches[r.label]
        state = "bit-identical" if not bad else f"DIFFERENT ({len(bad)}: {', '.join(bad[:3])}...)"
        print(
            f"  {r.label} {r.layout.name:<12} {exp.max_rel_diff()[r.label]:.2e}   "
            f"restored state vs A's at step {save_at} (params, Adam moments, count): {state}"
        )

    json_path, png_path = args.out / "losses.json", args.out / "losses.png"
    exp.save_json(json_path)
    try:
        exp.plot(png_path)
        wrote = f"{json_path}, {png_path}"
    except ImportError:  # matplotlib is a dev extra; `make demo` installs it
        wrote = f"{json_path} (no plot: pip install matplotlib)"
    ok = exp.ok()
    if args.sparse:
        ok = _sparse(args.out, args.steps, save_at) and ok
    secs = ", ".join(f"{r.label} {r.seconds:.1f}s" for r in exp.runs.values())
    print(
        f"\nmax rel diff {exp.worst():.2e} (tolerance {TOLERANCE:.0e}): "
        f"{'OK, the loss curve continues in every layout' if ok else 'MISMATCH'}"
    )
    print(f"wrote {wrote}  [{secs}; total {time.perf_counter() - t0:.1f}s]")
    return 0 if ok else 1


def _sparse(out: Path, steps: int, save_at: int) -> bool:
    """Run and print the mixture-of-experts experiment; True when its loss curves continue."""
    from .moe_experiment import SPARSE_A, SPARSE_RESUMED, run_sparse_experiment

    t0 = time.perf_counter()
    exp = run_sparse_experiment(steps, save_at, checkpoint=out / f"sparse_step_{save_at}")
    print(
        f"\nMixture of experts (4 experts, top-2; experts sharded over the 'expert' axis): "
        f"A {SPARSE_A.name} saves after step {save_at}; "
        + ", ".join(f"{k} {lay.name}" for k, lay in SPARSE_RESUMED.items())
        + " resume\n"
    )
    print(exp.table())
    bad = {k: v for k, v in exp.state_mismatches().items() if v}
    exp.save_json(out / "sparse_losses.json")
    print(
        f"\nsparse: max rel diff {exp.worst():.2e} (tolerance {TOLERANCE:.0e}); restored states "
        f"{'bit-identical' if not bad else f'DIFFERENT: {bad}'}  [{time.perf_counter() - t0:.1f}s]"
    )
    return exp.ok()


if __name__ == "__main__":
    sys.exit(main())
