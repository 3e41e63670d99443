"""In-memory snapshot benchmark: step time with and without a snapshot per step, snapshot
bandwidth vs memcpy, recovery from shared memory vs `ucp.restore` from disk.

A jax.distributed job of `--procs` processes (localhost, gloo, 8 // procs CPU devices each) trains
an MLP stack (params + adam state of `--gib` GiB; weights sharded over the 'model' axis inside a
process and replicated over 'data' across processes, i.e. data parallel across nodes; params and
adam state donated every step, or with --no-donate not donated and the manager holding
references instead of device copies). In one run it measures:

* step time (block_until_ready) without snapshots and with `SnapshotManager.snapshot()` every
  step (interleaved blocks of steps), median and p99;
* snapshot bandwidth: bytes each node copies into shared memory per snapshot / the background
  copy time, and end-to-end (snapshot + wait with training idle); against the memcpy bandwidth of
  the same machine in the same run (numpy copy between two pre-faulted buffers, and into a
  pre-faulted /dev/shm mapping), measured on every process at once;
* recovery time: `SnapshotManager.restore` from shared memory vs `ucp.restore` of the same state
  from a universal checkpoint on disk, cold (the checkpoint's pages evicted from the page cache
  with posix_fadvise(DONTNEED)) and warm; both onto the training shardings, checked bit-exact;
* the same for what Orbax offers (`--orbax`, `benchmarks/orbax_tiers.py`): an async
  `CheckpointManager` saving every step into the same shared memory (what the emergency
  manager's local tier does on each host), and the emergency `CheckpointManager` itself (local
  tier every step); step time in the same interleaved blocks, recovery by a fresh manager
  restoring the latest step (checked bit-exact), as ratios against ucp's tier and the disk.

Shared memory is `--shm-dir` (default /dev/shm). Recovery maps the snapshot's pages: on a tmpfs
with 2 MiB pages that is ~100x less page-table work than with 4 KiB pages, e.g.::

    mount -t tmpfs -o huge=within_size,size=8g tmpfs /mnt/ucp-shm   # or remount /dev/shm so
    python benchmarks/snapshot.py --shm-dir /mnt/ucp-shm

The launcher and the report are here; each process of the job runs `snapshot_worker.py`.

Usage::

    python benchmarks/snapshot.py                      # 2 processes, 1 GiB, writes JSON
    python benchmarks/snapshot.py --gib 0.25 --steps 12 --out /tmp/snap.json
    python benchmarks/snapshot.py --no-donate --redundancy none
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from harness import GB, REPO, child_env, free_port, run_job, write_json
from orbax_tiers import orbax_table

# ----------------------------------------------------------------------------------- launcher


def launch(args: argparse.Namespace) -> dict[str, Any]:
    """Run the job; return process 0's results."""
    out = Path(tempfile.mkdtemp(prefix="ucp-snapbench-"))
    cfg = dict(vars(args), addr=f"127.0.0.1:{free_port()}", work=str(out))
    env = child_env(8 // args.procs, pythonpath=[REPO])
    return run_job(__file__, args.procs, cfg, out, env)


# ------------------------------------------------------------------------------------- report


def table(r: dict[str, Any]) -> str:
    """The report printed on stdout, from process 0's results."""
    c = r["config"]
    st = r["step_s"]
    gib = r["state_bytes"] / 2**30
    lines = [
        f"ucp.memory snapshot benchmark: {c['procs']} processes x {8 // c['procs']} CPU devices, "
        f"state {gib:.2f} GiB (params + adam, {r['layers']} x {c['width']}^2 float32), "
        f"redundancy={c['redundancy']}, keep={c['keep']}, "
        + (
            "step without donation, snapshot holds references"
            if c["no_donate"]
            else "step donates its state, so snapshot() copies it out before it returns "
            "(CPU devices: straight into shared memory)"
        ),
        f"shared memory: {r['shm_dir']} ({'2 MiB pages' if r['huge_pages'] else '4 KiB pages'})",
        f"load average (1 min) around the timed steps: "
        f"{', '.join(f'{x:.1f}' for x in r['machine']['loadavg_1min_during_steps'])} "
        f"on {r['machine']['cpus']} CPUs",
        "",
        f"{'':34}{'median':>10}{'p99':>10}{'n':>5}",
        f"{'step, no snapshot':34}{st['base']['median']:>9.3f}s{st['base']['p99']:>9.3f}s"
        f"{st['base']['n']:>5}",
        f"{'step, snapshot every step':34}{st['snap']['median']:>9.3f}s{st['snap']['p99']:>9.3f}s"
        f"{st['snap']['n']:>5}   {100 * r['step_overhead']:+.1f}% (target <= +3%)",
        f"{'  paired by block (95% interval)':34}{100 * r['step_overhead_paired']['estimate']:+9.1f}%"
        f"  [{100 * r['step_overhead_paired']['ci95'][0]:+.1f}%, {100 * r['step_overhead_paired']['ci95'][1]:+.1f}%]"
        f"  over {r['step_overhead_paired']['blocks']} block pairs of {r['step_overhead_paired']['block_steps']} steps",
        f"{'  peak RSS above block start':34}"
        + ", ".join(f"{m} {v / 2**20:.0f} MiB" for m, v in r["peak_rss_above_block_start"].items()),
        f"{'  snapshot() call':34}{r['snapshot_dispatch_s']['median']:>9.3f}s"
        f"{r['snapshot_dispatch_s']['p99']:>9.3f}s   "
        + (
            "(waits for the previous snapshot's copy; this step runs meanwhile)"
            if c["no_donate"]
            else "(CPU: waits for the step's outputs, then copies them)"
        ),
        "",
        f"snapshot per node: {r['node_snapshot_bytes'] / 2**30:.2f} GiB"
        + (
            " (own pieces + the neighbour's, copied from the node's own replica)"
            if c["redundancy"] == "replica"
            else ""
        ),
    ]
    if r.get("snapshot_Bps"):
        lines.append(
            f"  copy while training:            {r['snapshot_copy_s']['median']:.3f} s = "
            f"{r['snapshot_Bps'] / GB:.2f} GB/s"
        )
    lines += [
        f"  end to end, training idle:      {r['snapshot_e2e_s']:.3f} s = "
        f"{r['snapshot_e2e_Bps'] / GB:.2f} GB/s",
        f"  memcpy (same run, every process at once): {r['memcpy_Bps'] / GB:.2f} GB/s; into a "
        f"shared-memory mapping: {r['memcpy_shm_Bps'] / GB:.2f} GB/s "
        f"(snapshot e2e = {r['snapshot_e2e_Bps'] / r['memcpy_Bps']:.0%} of memcpy)",
        "",
        f"recovery (same targets, max over processes): from shared memory "
        f"{r['recovery_s']['memory']:.3f} s",
        f"  ucp.restore from disk, cold: {r['recovery_s']['disk_cold']:.3f} s "
        f"({r['recovery_speedup_cold']:.1f}x slower; target >= 10x)"
        + ("" if r["evicted_pages_ok"] else " [page eviction failed: warm]"),
        f"  ucp.restore from disk, warm: {r['recovery_s']['disk_warm']:.3f} s "
        f"({r['recovery_speedup_warm']:.1f}x slower)",
        f"  (ucp.save of the same state to disk: {r['disk_save_s']:.3f} s)",
    ]
    lines += orbax_table(r)
    return "\n".join(lines)


def main() -> None:
    """Parse arguments; run the job (or, with the hidden --worker, one process of it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2, choices=(1, 2, 4, 8))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24, help="timed steps per mode")
    ap.add_argument(
        "--block",
        type=int,
        default=0,
        help="steps per block (default: steps / 4); blocks of each mode alternate",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="recovery measurements")
    ap.add_argument("--redundancy", default="replica", choices=("replica", "xor", "none"))
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument(
        "--no-donate",
        action="store_true",
        help="train without donating the state; the manager holds references (donation_safe=False)",
    )
    ap.add_argument("--shm-dir", default=None, help="shared-memory folder (default /dev/shm)")
    ap.add_argument(
        "--orbax",
        default="local,emergency",
        help="Orbax tiers to run beside it, comma-separated (local, emergency; '' none)",
    )
    ap.add_argument("--disk", default=None, help="folder for the on-disk checkpoint")
    ap.add_argument("--out", default="bench_out/snapshot.json", help="JSON results file")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        from snapshot_worker import worker

        worker(args.worker, json.loads(args.config))
        return
    args.orbax = [t for t in args.orbax.split(",") if t]
    result = launch(args)
    print(table(result))
    out = write_json(args.out, result, indent=1)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
