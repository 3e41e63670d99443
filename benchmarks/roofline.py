"""Roofline: ucp_jax and Orbax save/restore against the machine's own limits, in one run.

For each state (few large leaves; a model-like tree of hundreds of mixed leaves) and dtype, the
same bytes on the same disk with the same thread count:

* limits (benchmarks/roofline_limits.py): memcpy; a plain parallel pwrite+fsync of the state's
  unique shards; a plain parallel read of those files into fresh host buffers (warm, and cold
  where the kernel lets this process drop caches; warm also into buffers on transparent huge
  pages, as ucp's restore buffers are); placing host shards on the target devices
  (`jax.device_put`, and into the `pinned_host` memory kind where the device has it);
* ucp save, ucp restore onto the same mesh and onto another (a reshard), Orbax
  `StandardCheckpointer` save and same-mesh restore.

Each operation is repeated `--repeats` times, tools interleaved, and reported as the median with
its min-max spread, in GB/s and as a fraction of its limit (save: write+fsync; restore: read, plus
placement where placing costs a copy; and, for a restore, against the plain read made again just
before it, which pairs each run with the limit of its moment on a machine whose speed drifts).
Beside each: peak host memory above the state (VmHWM reset
before each operation) and, for restores, bytes read over the bytes the target shards need (read
amplification). Every restore is checked bit-exact. A table on stdout, JSON with `--out`.

On a VM guest whose host takes freed pages back (virtio balloon free page reporting, detected
from sysfs), every timed operation, limits included, is preceded by writing to and freeing twice
the state's bytes of memory (`--warm-pages`): otherwise whichever operation happened to follow a
pause of a few seconds paid the host's page faults on every page it allocated or wrote into the
page cache (0.16 s vs 0.73-1.86 s for 768 MiB into the page cache here), a cost bare metal has
not. `--warm-pages 0` measures without it.

Usage::

    python benchmarks/roofline.py                       # both states, f32 and bf16, ~0.8 GB
    python benchmarks/roofline.py --gb 0.1 --repeats 1 --states large --dtypes f32
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness

if "--accelerator" not in sys.argv:
    harness.force_cpu_devices(8)

import argparse
import math
import shutil
import statistics
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import roofline_limits as lim
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp

GB = harness.GB
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


# ------------------------------------------------------------------------------------ states


def meshes() -> tuple[Mesh, Mesh]:
    """The save mesh (2, n/2) and the reshard mesh (n/2, 2) over the devices in reverse order
    (n: up to 8 devices; one device: both (1, 1))."""
    n = min(jax.device_count(), 8)
    a = 2 if n % 2 == 0 else 1
    devs = np.array(jax.devices()[:n])
    return (Mesh(devs.reshape(a, n // a), ("data", "model")),
            Mesh(devs[::-1].reshape(n // a, a), ("data", "model")))  # fmt: skip


def large_leaves(gb: float) -> dict[str, tuple[tuple[int, ...], P, P]]:
    """Few large leaves: 8 matrices (x3 with Adam's moments), 2-D sharded both ways."""
    rows = max(64, int(math.sqrt(gb * GB / 3 / 8 / 4 / 2)) // 64 * 64)
    return {f"w{i}": ((rows, 2 * rows), P("data", "model"), P("model", "data")) for i in range(8)}


def model_like(gb: float) -> dict[str, tuple[tuple[int, ...], P, P]]:
    """A transformer's tree: per layer 4 attention + 2 MLP matrices, 2 norms, biases; embedding."""
    d = 512 if gb < 0.5 else 768
    f = 4 * d
    per_layer = 4 * d * d + 2 * d * f + 4 * d + f
    layers = max(2, round((gb * GB / 3 / 4 - 16 * d * d) / per_layer))
    col, row, rep = (
        (P(None, "model"), P("model", None)),
        (P("model", None), P(None, "model")),
        (P(), P()),
    )
    out: dict[str, tuple[tuple[int, ...], P, P]] = {
        "embed": ((16 * d, d), P("model", None), P(None, "model"))
    }
    for i in range(layers):
        for k in ("wq", "wk", "wv"):
            out[f"l{i}.{k}"] = ((d, d), *col)
        out[f"l{i}.wo"] = ((d, d), *row)
        out[f"l{i}.w1"] = ((d, f), P("data", "model"), P("model", "data"))
        out[f"l{i}.w2"] = ((f, d), P("model", "data"), P("data", "model"))
        out[f"l{i}.b1"] = ((f,), P("model"), P())
        for k in ("n1", "n2", "bo"):
            out[f"l{i}.{k}"] = ((d,), *rep)
    return out


def build(spec: dict[str, Any], dtype: Any, seed: int = 0) -> tuple[Any, ...]:
    """(params, opt_state, abstract same-mesh targets, abstract reshard targets)."""
    m0, m1 = meshes()
    key = jax.random.key(seed)
    params = {}
    for i, (name, (shape, s0, _)) in enumerate(spec.items()):
        x = jax.random.normal(jax.random.fold_in(key, i), shape, dtype)
        params[name] = jax.device_put(x, NamedSharding(m0, s0))
    opt = optax.adam(1e-3)
    state = jax.jit(opt.init)(params)
    # moments with values (not zeros): a step of Adam on a pseudo-gradient
    grads = jax.tree.map(lambda p: p * 0.5, params)
    _, state = jax.jit(opt.update)(grads, state, params)

    def targets(which: int, mesh: Mesh) -> tuple[Any, Any]:
        sh = {n: NamedSharding(mesh, v[1 + which]) for n, v in spec.items()}
        p = {n: jax.ShapeDtypeStruct(v[0], dtype, sharding=sh[n]) for n, v in spec.items()}
        rep = NamedSharding(mesh, P())
        o = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
            jax.eval_shape(opt.init, p),
        )
        o = (o[0]._replace(mu=p, nu=p), *o[1:])
        return p, o

    return params, state, targets(0, m0), targets(1, m1)


def state_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def identical(a: Any, b: Any) -> bool:
    """Bit-exact equality of two trees of arrays."""
    return all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# -------------------------------------------------------------------------------- operations


def run_case(name: str, spec: dict[str, Any], dtype_name: str, args: argparse.Namespace) -> dict:
    params, opt_state, (tp, to), (rp, ro) = build(spec, DTYPES[dtype_name])
    full = (params, opt_state)
    nbytes = state_bytes(full)
    root = tempfile.mkdtemp(prefix="ucp-roofline-", dir=args.dir)
    threads = args.threads
    res: dict[str, list[dict[str, float]]] = {}

    def rec(op: str, m: dict[str, float]) -> None:
        res.setdefault(op, []).append(dict(m))

    shards = lim.unique_shards(full)
    need_same, need_re = lim.needed_bytes((tp, to)), lim.needed_bytes((rp, ro))
    cold_ok = lim.drop_caches()
    pinned = lim.pinned_host_supported()
    warm = int(args.warm_pages * nbytes)

    def settle() -> None:
        """Before each timed operation: memory the host backs now (see warm_free_pages)."""
        lim.warm_free_pages(warm)

    tools: list[tuple[str, Callable[[str], None], Callable[[str], Any], Any]] = [
        ("ucp", lambda p: ucp.save(p, params, opt_state, step=1),
         lambda p: ucp.restore(p, tp, to), lambda p: ucp.restore(p, rp, ro)),
    ]  # fmt: skip
    if not args.no_orbax:
        import orbax.checkpoint as ocp

        ck = ocp.StandardCheckpointer()

        def osave(p: str) -> None:
            ck.save(p, {"params": params, "opt_state": opt_state})
            ck.wait_until_finished()

        tools.append(
            ("orbax", osave, lambda p: ck.restore(p, {"params": tp, "opt_state": to}), None)
        )

    try:
        for r, order in harness.interleaved(tools, args.repeats):
            # limits
            d = os.path.join(root, f"raw{r}")
            settle()
            t, paths = lim.write_fsync(shards, d, threads)
            rec("limit_write", {"seconds": t})
            settle()
            rec("limit_read_warm", {"seconds": lim.read_back(paths, shards, threads)})
            settle()
            rec(
                "limit_read_warm_huge",
                {"seconds": lim.read_back(paths, shards, threads, huge=True)},
            )
            if cold_ok and lim.drop_caches():
                settle()
                rec("limit_read_cold", {"seconds": lim.read_back(paths, shards, threads)})
            # host copies of the target shards, made for the placement limits and freed after:
            # held through the whole run they doubled the benchmark's memory (4 GB ran out)
            same_shards = lim.host_shards(full, (tp, to))
            settle()
            rec("limit_place", {"seconds": lim.placement_seconds(same_shards, (tp, to))})
            if pinned:
                settle()
                rec(
                    "limit_place_pinned",
                    {"seconds": lim.placement_seconds(same_shards, (tp, to), "pinned_host")},
                )
            del same_shards
            re_shards = lim.host_shards(full, (rp, ro))
            settle()
            rec("limit_place_reshard", {"seconds": lim.placement_seconds(re_shards, (rp, ro))})
            del re_shards

            for tool, save, restore_same, restore_re in order:
                p = os.path.join(root, f"{tool}{r}")
                settle()
                with lim.accounting() as m:
                    save(p)
                rec(f"{tool}_save", m)
                for kind, fn, need in (
                    ("same", restore_same, need_same),
                    ("reshard", restore_re, need_re),
                ):
                    if fn is None:
                        continue
                    for cache in ("warm", "cold") if cold_ok else ("warm",):
                        # the plain read again, just before: this restore's own limit, so that
                        # a VM whose speed drifts within a run is compared at the same moment
                        if cache == "warm":  # a cold restore before this one dropped its files
                            lim.read_back(paths, shards, threads)
                        else:
                            lim.drop_caches()
                        settle()
                        paired = lim.read_back(paths, shards, threads)
                        if cache == "cold":
                            lim.drop_caches()
                        settle()
                        with lim.accounting() as m:
                            got = fn(p)
                            jax.block_until_ready(got)
                        m["amplification"] = m["read_bytes"] / need
                        m["paired_read_seconds"] = paired
                        if r == 0 and cache == "warm":
                            pair = got if tool == "ucp" else (got["params"], got["opt_state"])
                            ok = identical(full, pair)
                            m["bit_exact"] = float(ok)
                            if not ok:
                                raise SystemExit(
                                    f"{tool} {kind} restore is not bit-exact on {name}"
                                )
                        rec(f"{tool}_restore_{kind}_{cache}", m)
                        del got
                shutil.rmtree(p, ignore_errors=True)
            shutil.rmtree(d)
    finally:  # an interrupted run leaves no GBs behind in the temp folder
        shutil.rmtree(root, ignore_errors=True)
    return summarize(name, dtype_name, nbytes, len(jax.tree.leaves(full)), res, threads)


def med(xs: list[dict[str, float]], key: str = "seconds") -> tuple[float, float, float]:
    v = [x[key] for x in xs if key in x]
    return (statistics.median(v), min(v), max(v)) if v else (float("nan"),) * 3


def summarize(name: str, dt: str, nbytes: int, leaves: int, res: dict, threads: int) -> dict:
    """Per operation: median seconds, spread, GB/s, fraction of its limit, memory, amplification."""
    lw = med(res["limit_write"])[0]
    place = med(res["limit_place"])[0]
    place_re = med(res["limit_place_reshard"])[0]
    out: dict[str, Any] = {"state": name, "dtype": dt, "bytes": nbytes, "leaves": leaves,
                           "threads": threads, "ops": {}}  # fmt: skip
    for op, xs in res.items():
        s, lo, hi = med(xs)
        row: dict[str, Any] = {"seconds": s, "min": lo, "max": hi, "gbps": nbytes / s / GB,
                               "runs": len(xs)}  # fmt: skip
        if op.endswith("_save"):
            row["limit_seconds"] = lw
            # each save against the write limit measured in its own round (one of each a round)
            row["fraction_each"] = [lw / x["seconds"] for x in xs]
            if len(xs) == len(res["limit_write"]):
                pe = [w["seconds"] / x["seconds"] for w, x in zip(res["limit_write"], xs)]
                row["fraction_paired_each"] = pe
                row["fraction_paired"] = statistics.median(pe)
        elif "_restore_" in op:
            cache = op.rsplit("_", 1)[1]
            read = med(res.get(f"limit_read_{cache}", res["limit_read_warm"]))[0]
            pl = place_re if "_reshard_" in op else place
            row["limit_seconds"] = read + pl
            row["read_limit_seconds"] = read
            # fraction of the limit in every run (the worst run is what the target is held to),
            # against the median limit, and against the plain read made just before that restore
            row["fraction_each"] = [(read + pl) / x["seconds"] for x in xs]
            paired = [(x["paired_read_seconds"] + pl) / x["seconds"] for x in xs
                      if "paired_read_seconds" in x]  # fmt: skip
            if paired:
                row["fraction_paired_each"] = paired
                row["fraction_paired"] = statistics.median(paired)
            row["amplification"] = med(xs, "amplification")[0]
            if f"limit_read_{cache}_huge" in res:  # the plain read into huge-page buffers
                huge = med(res[f"limit_read_{cache}_huge"])[0]
                row["limit_huge_seconds"] = huge + pl
                row["fraction_huge"] = (huge + pl) / s
        if "limit_seconds" in row:
            row["fraction"] = row["limit_seconds"] / s
        if "peak_above_start" in xs[0]:
            row["peak_over_state"] = med(xs, "peak_above_start")[0] / nbytes
        out["ops"][op] = row
    return out


def table(results: list[dict]) -> str:
    lines = ["| state | dtype | operation | median s (min-max) | GB/s | of limit | of the limit beside it (min-max) | of the read into huge pages + place | peak RAM / state | read ampl. |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        for op, x in r["ops"].items():
            frac = f"{x['fraction']:.0%}" if "fraction" in x else ""
            peak = f"{x['peak_over_state']:.2f}" if "peak_over_state" in x else ""
            amp = f"{x['amplification']:.2f}" if "amplification" in x else ""
            pe = x.get("fraction_paired_each")
            pair = f"{x['fraction_paired']:.0%} ({min(pe):.0%}-{max(pe):.0%})" if pe else ""
            huge = f"{x['fraction_huge']:.0%}" if "fraction_huge" in x else ""
            lines.append(
                f"| {r['state']} ({r['leaves']} leaves, {r['bytes'] / GB:.2f} GB) | {r['dtype']} | "
                f"{op} | {x['seconds']:.3f} ({x['min']:.3f}-{x['max']:.3f}) | {x['gbps']:.2f} | "
                f"{frac} | {pair} | {huge} | {peak} | {amp} |"
            )
    return "\n".join(lines)


def ratios(results: list[dict]) -> str:
    lines = []
    for r in results:
        o = r["ops"]
        if "orbax_save" in o:
            fh = o["ucp_restore_reshard_warm"].get("fraction_huge")
            huge = "" if fh is None else f" ({fh:.0%} of the read into huge-page buffers)"
            lines.append(
                f"{r['state']}/{r['dtype']}: ucp save / Orbax save time = "
                f"{o['ucp_save']['seconds'] / o['orbax_save']['seconds']:.2f}; ucp reshard restore "
                f"/ Orbax same-mesh restore (warm) = "
                f"{o['ucp_restore_reshard_warm']['seconds'] / o['orbax_restore_same_warm']['seconds']:.2f}"
                f"; ucp reshard restore (warm) at {o['ucp_restore_reshard_warm']['fraction']:.0%} "
                f"of read + place{huge}"
            )
    return "\n".join(lines)


def machine(directory: str | None) -> dict[str, Any]:
    """The harness's machine description, plus memcpy speed and what the kernel lets us do."""
    info = harness.machine_info(directory or tempfile.gettempdir())
    info.update(memcpy_gbps=lim.memcpy_gbps(), pinned_host=lim.pinned_host_supported(),
                drop_caches=harness.drop_caches(),
                free_page_reporting=lim.free_page_reporting(), device=str(jax.devices()[0].device_kind),
                platform_name=jax.devices()[0].platform)  # fmt: skip
    return info


def tiny_cost(repeats: int, root: str | None) -> dict[str, Any]:
    """The fixed cost of a checkpoint: save and restore of one 4-byte leaf, in ms (median)."""
    mesh = meshes()[0]
    x = jax.device_put(jnp.zeros((1,), jnp.float32), NamedSharding(mesh, P()))
    tgt = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=NamedSharding(mesh, P()))
    d = tempfile.mkdtemp(prefix="ucp-tiny-", dir=root)
    saves, restores = [], []
    for i in range(repeats + 1):  # the first is a warm-up (imports, compilation)
        p = os.path.join(d, f"t{i}")
        t, _ = harness.timed(lambda p=p, i=i: ucp.save(p, {"x": x}, step=i), settle=False)
        r, _ = harness.timed(lambda p=p: ucp.restore(p, {"x": tgt}), settle=False)
        if i:
            saves.append(t.wall * 1e3)
            restores.append(r.wall * 1e3)
    shutil.rmtree(d, ignore_errors=True)
    return {"save_ms": statistics.median(saves), "restore_ms": statistics.median(restores),
            "save_ms_max": max(saves), "restore_ms_max": max(restores), "runs": repeats}  # fmt: skip


def by_cores(argv: list[str], cores: list[int]) -> list[dict]:
    """Run this script once per core count, pinned with `taskset` to the first k processors."""
    out = []
    for k in cores:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = ["taskset", "-c", f"0-{k - 1}", sys.executable, os.path.abspath(__file__),
                   *argv, "--out", f.name]  # fmt: skip
            import subprocess

            subprocess.run(cmd, check=True)
            import json

            with open(f.name) as g:
                doc = json.load(g)
        for r in doc["results"]:
            r["cores"] = k
        out += doc["results"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gb", type=float, default=0.8, help="state size (params + Adam), GB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--states", default="large,model", help="large, model, or both")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--threads", type=int, default=max(4, os.cpu_count() or 1))
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: TMPDIR)")
    ap.add_argument("--no-orbax", action="store_true")
    ap.add_argument(
        "--warm-pages",
        type=float,
        default=None,
        metavar="X",
        help="before each timed operation, write to and free X times the state's bytes of memory "
        "(default: 2 on a VM guest whose host takes freed pages back, else 0)",
    )
    ap.add_argument(
        "--accelerator",
        action="store_true",
        help="run on the accelerator jax finds (no forced CPU devices)",
    )
    ap.add_argument(
        "--sizes",
        default=None,
        help="state sizes in GB for a scaling table, e.g. 0.25,0.5,1,2,4 (instead of --gb)",
    )
    ap.add_argument(
        "--cores", default=None, help="core counts, e.g. 1,2: one run per count under taskset"
    )
    ap.add_argument(
        "--tiny",
        type=int,
        default=0,
        metavar="N",
        help="also time N saves and restores of a 4-byte checkpoint (fixed cost)",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    info = machine(args.dir)
    if args.warm_pages is None:
        args.warm_pages = 2.0 if info["free_page_reporting"] else 0.0
    print(f"machine: {info}")
    doc: dict[str, Any] = {"machine": info, "args": vars(args)}
    if args.cores:
        rest = [
            a for i, a in enumerate(argv) if a != "--cores" and (i == 0 or argv[i - 1] != "--cores")
        ]
        rest = [
            a for i, a in enumerate(rest) if a != "--out" and (i == 0 or rest[i - 1] != "--out")
        ]
        results = by_cores(rest, [int(c) for c in args.cores.split(",")])
    else:
        results = []
        builders = {"large": large_leaves, "model": model_like}
        sizes = [float(x) for x in args.sizes.split(",")] if args.sizes else [args.gb]
        for gb in sizes:
            for st in args.states.split(","):
                for dt in args.dtypes.split(","):
                    results.append(run_case(st, builders[st](gb), dt, args))
                    print(table(results[-1:]), flush=True)
    print("\n" + table(results) + "\n\n" + ratios(results))
    if args.tiny:
        doc["tiny"] = tiny_cost(args.tiny, args.dir)
        print(f"\nfixed cost of a 4-byte checkpoint: save {doc['tiny']['save_ms']:.1f} ms, "
              f"restore {doc['tiny']['restore_ms']:.1f} ms (median of {args.tiny})")  # fmt: skip
    doc["results"] = results
    if args.out:
        harness.write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
