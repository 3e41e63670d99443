"""Save/restore benchmark: ucp_jax vs Orbax `StandardCheckpointer` on a sharded train state.

Builds a transformer-like train state (params + `optax.adam` state, params ~1/3 of the bytes) of
`--gib` GiB on 8 forced CPU devices, sharded Megatron-style over a (2, 4) ('data', 'model') mesh,
and times in one run, into temporary directories on the same disk:

* save (until durable and committed) with Orbax `ocp.StandardCheckpointer` (whose `save` wraps
  the state in `ocp.args.StandardSave`; timed until `wait_until_finished`) and `ucp.save`;
* restore onto the same mesh and shardings (`StandardRestore` of abstract targets with
  shardings; `ucp.restore`);
* restore onto a different mesh, (4, 2) with other specs (a reshard), with both tools.

Each measurement is repeated `--repeats` times (tools interleaved, order alternating) and the
median is reported. Restores are timed with a warm page cache (the checkpoint was just written)
and, when this process may write /proc/sys/vm/drop_caches, also cold (caches dropped before every
restore of either tool). Restored states are checked bit-exact against the original once per tool
and target. Results go to a Markdown table on stdout and to JSON (`--out`), with the CPU seconds
of each operation and the machine's load average, since other work may share a small machine.

Usage::

    python benchmarks/save_restore.py                 # 1 GiB, 3 repeats
    python benchmarks/save_restore.py --gib 0.1 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import harness
from harness import GB, Spread, Timing, drop_caches, interleaved, timed

harness.force_cpu_devices(8)  # before jax is imported

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from save_restore_state import (  # noqa: E402
    ModelShape,
    build_state,
    check_equal,
    meshes,
    model_shape,
    param_layout,
    spec_json,
    targets_for,
    tgt_tree,
    tree_bytes,
)

import ucp_jax as ucp  # noqa: E402

SAVE_TARGET = 1.0  # ucp save throughput >= 1.0 x Orbax save throughput
RESHARD_TARGET = 1.1  # ucp reshard restore time <= 1.1 x Orbax same-mesh restore time
VERSIONS = ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "optax", "numpy", "ucp_jax")


def orbax_settings(ckptr: ocp.StandardCheckpointer) -> dict[str, Any]:
    """The Orbax storage settings in effect (introspected where possible, else its defaults)."""
    impl = getattr(getattr(ckptr, "_handler", None), "_impl", None)
    return {
        "checkpointer": "ocp.StandardCheckpointer (async; save timed until wait_until_finished)",
        "use_ocdbt": getattr(impl, "_use_ocdbt", True),
        "use_zarr3": getattr(impl, "_use_zarr3", False),
        "compression": "zstd level 1 (zarr2 default; use_compression=True)"
        if not getattr(impl, "_use_zarr3", False)
        else "zstd level 3 (zarr3)",
        "save_concurrent_gb": getattr(impl, "_save_concurrent_gb", 96),
        "restore_concurrent_gb": getattr(impl, "_restore_concurrent_gb", 96),
        "ts_context": "file_io_concurrency limit 128, OCDBT cache pool 100 MB",
        "replica_dedup": "each shard written once (replica 0)",
    }


# ---------------------------------------------------------------------------------- benchmark


@dataclass
class Result:
    """The timings of one (operation, tool, cache) cell."""

    operation: str
    tool: str
    cache: str
    nbytes: int
    runs: list[Timing] = field(default_factory=list)

    @property
    def median(self) -> float:
        return Spread.of(t.wall for t in self.runs).median

    @property
    def cpu(self) -> float:
        return Spread.of(t.cpu for t in self.runs).median

    @property
    def gbps(self) -> float:
        return self.nbytes / GB / self.median


class Tools:
    """The save and restore calls of both tools on one train state, timed."""

    def __init__(self, params: Any, opt_state: Any) -> None:
        self.params, self.opt_state = params, opt_state
        self.ckptr = ocp.StandardCheckpointer()

    def save(self, tool: str, path: str) -> Timing:
        """Save the state with `tool` ('orbax' or 'ucp'), until durable and committed."""
        if tool == "orbax":

            def go() -> None:
                # StandardCheckpointer.save wraps the state in ocp.args.StandardSave
                self.ckptr.save(path, {"params": self.params, "opt_state": self.opt_state})
                self.ckptr.wait_until_finished()

        else:

            def go() -> None:
                ucp.save(path, self.params, self.opt_state)

        return timed(go)[0]

    def restore(self, tool: str, path: str, tgt: tuple[Any, Any]) -> tuple[Timing, Any]:
        """Restore onto the abstract targets `tgt`; returns {'params', 'opt_state'}."""
        if tool == "orbax":
            # StandardCheckpointer.restore wraps the target in ocp.args.StandardRestore
            return timed(lambda: self.ckptr.restore(path, tgt_tree(tgt)))

        def go() -> dict[str, Any]:
            p, o = ucp.restore(path, tgt[0], tgt[1])
            return {"params": p, "opt_state": o}

        return timed(go)


def warm_up(mesh: Mesh, mesh2: Mesh, work: str) -> None:
    """One untimed save and restores of a small state with both tools (first-call costs)."""
    m = ModelShape(d_model=256, d_ff=1024, vocab=2048, layers=1)
    layout = param_layout(m)
    params, opt_state = build_state(m, mesh, seed=1)
    tools = Tools(params, opt_state)
    for tool in ("orbax", "ucp"):
        path = os.path.join(work, f"warmup-{tool}")
        tools.save(tool, path)
        for tgt in (
            targets_for(params, opt_state, layout, mesh, 0),
            targets_for(params, opt_state, layout, mesh2, 1),
        ):
            tools.restore(tool, path, tgt)
        shutil.rmtree(path, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the state, time every operation, verify once, and return the results."""
    if jax.device_count() < 8:
        sys.exit(f"need 8 devices, have {jax.device_count()}; set XLA_FLAGS before running")
    mesh, mesh2 = meshes()
    m = model_shape(args.gib)
    layout = param_layout(m)
    t0 = time.perf_counter()
    params, opt_state = build_state(m, mesh)
    build_s = time.perf_counter() - t0
    nbytes = tree_bytes((params, opt_state))
    pbytes = tree_bytes(params)
    print(
        f"state: {nbytes / 2**30:.3f} GiB ({pbytes / nbytes:.1%} params), "
        f"{len(jax.tree.leaves((params, opt_state)))} leaves, {m}, built in {build_s:.1f} s",
        flush=True,
    )
    host = jax.device_get({"params": params, "opt_state": opt_state})
    same = targets_for(params, opt_state, layout, mesh, 0)
    reshard = targets_for(params, opt_state, layout, mesh2, 1)
    tgts = {"same mesh": same, "reshard": reshard}

    cold_ok = args.cache in ("cold", "both") and drop_caches()
    caches = {"warm": ["warm"], "cold": ["cold"], "both": ["warm", "cold"]}[args.cache]
    if not cold_ok and "cold" in caches:
        print("note: cannot drop the page cache here (needs root); cold restores skipped")
        caches = ["warm"]

    base = args.dir or tempfile.mkdtemp(prefix="ucp-bench-")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=base)
    machine = harness.machine_info(work, VERSIONS)
    results: dict[tuple[str, str, str], Result] = {}

    def record(op: str, tool: str, cache: str, t: Timing, rep: int) -> None:
        key = (op, tool, cache)
        results.setdefault(key, Result(op, tool, cache, nbytes)).runs.append(t)
        what = f"{op} ({cache})" if cache != "-" else op
        print(
            f"  [{rep}] {what:<26} {tool:<5} {t.wall:7.3f} s  cpu {t.cpu:6.2f} s  "
            f"load {t.load:5.2f}",
            flush=True,
        )

    tools = Tools(params, opt_state)
    orbax_conf = orbax_settings(tools.ckptr)
    verified: dict[str, bool] = {}
    disk: dict[str, dict[str, int]] = {}
    try:
        if not args.no_warmup:
            warm_up(mesh, mesh2, work)
        # Checkpoints stay until the end: deleting 1 GiB between runs makes the disk discard
        # blocks while the next run writes.
        for rep, order in interleaved(("orbax", "ucp"), args.repeats):
            paths = {t: os.path.join(work, f"{t}-{rep}") for t in order}
            for tool in order:
                record("save", tool, "-", tools.save(tool, paths[tool]), rep)
                if rep == 0:
                    size, files = harness.dir_bytes(paths[tool])
                    disk[tool] = {"bytes": size, "files": files}
            for cache in caches:
                for name, tgt in tgts.items():
                    for tool in order:
                        if cache == "cold":
                            drop_caches()
                        t, out = tools.restore(tool, paths[tool], tgt)
                        record(f"restore {name}", tool, cache, t, rep)
                        key = f"{tool} restore {name}"
                        if key not in verified:
                            check_equal(out, host, tgt_tree(tgt), key)
                            verified[key] = True
                        del out
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    leaves = len(jax.tree.leaves((params, opt_state)))
    return report(
        args, m, nbytes, pbytes, results, caches, verified, disk, orbax_conf, machine, leaves
    )


def report(
    args: argparse.Namespace,
    m: ModelShape,
    nbytes: int,
    pbytes: int,
    results: dict[tuple[str, str, str], Result],
    caches: list[str],
    verified: dict[str, bool],
    disk: dict[str, dict[str, int]],
    orbax_conf: dict[str, Any],
    machine: dict[str, Any],
    leaves: int,
) -> dict[str, Any]:
    """Print the table and the target verdicts; return everything as a JSON-able dict."""
    save_o, save_u = results[("save", "orbax", "-")], results[("save", "ucp", "-")]
    rows: list[tuple[Result, float, str]] = []
    for r in (save_o, save_u):
        rows.append((r, r.gbps / save_o.gbps, "throughput vs Orbax save"))
    for cache in caches:
        anchor = results[("restore same mesh", "orbax", cache)]
        for op in ("restore same mesh", "restore reshard"):
            for tool in ("orbax", "ucp"):
                r = results[(op, tool, cache)]
                rows.append((r, r.median / anchor.median, f"time vs Orbax same-mesh ({cache})"))
    print()
    print(
        f"ucp_jax vs Orbax: {nbytes / 2**30:.2f} GiB train state ({pbytes / 2**30:.2f} GiB params "
        f"+ adam mu/nu), 8 CPU devices, {os.cpu_count()} cores, median of {args.repeats}"
    )
    print()
    print("| operation | tool | seconds | GB/s | ratio | anchor of the ratio | CPU s |")
    print("|---|---|---:|---:|---:|---|---:|")
    for r, ratio, anchor_name in rows:
        op = r.operation if r.cache == "-" else f"{r.operation} ({r.cache})"
        print(
            f"| {op} | {r.tool} | {r.median:.3f} | {r.gbps:.2f} | {ratio:.2f}x | {anchor_name} "
            f"| {r.cpu:.2f} |"
        )
    print()
    save_ratio = save_u.gbps / save_o.gbps
    verdicts = [
        {
            "target": f"ucp save throughput >= {SAVE_TARGET:.1f}x Orbax save throughput",
            "value": save_ratio,
            "pass": save_ratio >= SAVE_TARGET,
        }
    ]
    for cache in caches:
        anchor_s = results[("restore same mesh", "orbax", cache)].median
        v = results[("restore reshard", "ucp", cache)].median / anchor_s
        verdicts.append(
            {
                "target": f"ucp reshard restore time <= {RESHARD_TARGET:.1f}x Orbax same-mesh "
                f"restore time ({cache} cache)",
                "value": v,
                "pass": v <= RESHARD_TARGET,
            }
        )
    for v in verdicts:
        print(f"{'PASS' if v['pass'] else 'FAIL'}  {v['target']}: {v['value']:.2f}x")
    load = Spread.of(t.load for r in results.values() for t in r.runs)
    cores = os.cpu_count() or 1
    notes = [
        "GB/s = logical state bytes (each replica counted once) / median seconds; 1 GB = 1e9 B. "
        "CPU s = median user+system CPU seconds of this process during the operation.",
        "Saves are timed until durable and committed: Orbax save + wait_until_finished; "
        "ucp.save returns after COMMIT. Both tools fsync through TensorStore's file driver.",
        "warm: restores read a checkpoint just written, i.e. from the page cache, for both tools.",
        "cold: page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches) before every restore "
        "of either tool; on a VM the host may still cache the virtual disk.",
        f"Orbax settings: OCDBT={orbax_conf['use_ocdbt']}, zarr3={orbax_conf['use_zarr3']}, "
        f"compression={orbax_conf['compression']}; ucp: zarr3 + crc32c per chunk, no compression.",
        f"On disk: Orbax {disk['orbax']['bytes'] / 2**20:.0f} MiB in {disk['orbax']['files']} "
        f"files, ucp {disk['ucp']['bytes'] / 2**20:.0f} MiB in {disk['ucp']['files']} files.",
        f"Load average at the start of the runs: median {load.median:.1f}, max "
        f"{load.max:.1f} on {cores} cores"
        + (
            " -- other work shared the machine; expect noisy wall times"
            if load.median > cores
            else ""
        )
        + ". Tools run interleaved, order alternating per repeat.",
        "Restored states verified bit-exact (and laid out as the target) for: "
        + ", ".join(sorted(verified)),
    ]
    for n in notes:
        print(f"note: {n}")
    return {
        "benchmark": "save_restore",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine,
        "config": {
            "gib": args.gib,
            "repeats": args.repeats,
            "cache": caches,
            "dir": args.dir or "a temporary directory (removed afterwards)",
            "warmup": not args.no_warmup,
        },
        "state": {
            "bytes": nbytes,
            "gib": nbytes / 2**30,
            "param_bytes": pbytes,
            "param_fraction": pbytes / nbytes,
            "leaves": leaves,
            "model": dataclasses.asdict(m),
            "dtype": "float32",
            "save_mesh": {"shape": [2, 4], "axes": ["data", "model"], "specs": spec_json(0)},
            "reshard_mesh": {"shape": [4, 2], "axes": ["data", "model"], "specs": spec_json(1)},
        },
        "orbax_settings": orbax_conf,
        "on_disk": disk,
        "results": [
            {
                "operation": r.operation,
                "tool": r.tool,
                "cache": r.cache,
                "seconds_median": r.median,
                "gb_per_s": r.gbps,
                "ratio": ratio,
                "anchor": anchor_name,
                "cpu_seconds_median": r.cpu,
                "runs": [dataclasses.asdict(t) for t in r.runs],
            }
            for r, ratio, anchor_name in rows
        ],
        "targets": verdicts,
        "all_targets_pass": all(v["pass"] for v in verdicts),
        "verified_bit_exact": sorted(verified),
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the benchmark, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="train state size in GiB (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    ap.add_argument("--out", default="bench_out/save_restore.json", help="JSON results file")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up round")
    ap.add_argument(
        "--cache",
        choices=("warm", "cold", "both"),
        default="both",
        help="restore with the page cache warm, dropped (needs root), or both (default)",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(args)
    res["wall_seconds"] = time.perf_counter() - t0
    harness.write_json(args.out, res, indent=2)
    print(f"wrote {args.out} ({res['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
