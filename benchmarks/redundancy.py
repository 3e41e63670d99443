"""Redundancy schemes of the in-memory tier, side by side: none, xor and rs2 in one run.

A jax.distributed job of `--procs` processes (localhost, gloo, 8 // procs CPU devices each; with
4 processes the default groups are one group of 4 for xor and for rs2) trains an MLP stack (params
+ adam state of `--mib` MiB, donated every step). Weights are replicated across processes (data
parallel: every node holds what its parities need, no exchange), or with `--fsdp` sharded over
them (each snapshot exchanges them with ppermutes). It measures, in the same run:

* the step-time cost of a snapshot per step for each scheme: interleaved blocks of steps without
  snapshots and with each scheme's `SnapshotManager`, median step time minus the baseline's;
* per scheme, the bytes a node keeps and the time its copy takes (`stats.copy_s`: device to
  shared memory, XOR and the bit-sliced Q included), as bytes/s against memcpy on every process
  at once in the same run;
* rebuild: `SnapshotManager.restore` of the same step with nothing lost, with one node's shared
  memory gone, and (rs2) two nodes' gone, against `ucp.restore` of the same state from a
  universal checkpoint on disk, cold (its pages evicted) and warm. Every restore is checked
  bit-exact.

Usage::

    python benchmarks/redundancy.py                       # 4 processes, 256 MiB
    python benchmarks/redundancy.py --mib 64 --steps 8 --out /tmp/red.json
    python benchmarks/redundancy.py --fsdp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import REPO, child_env, evict_pages, free_port, run_job
from snapshot_worker import layers_for

SCHEMES = ("none", "xor", "rs2")
GB = 1e9


def launch(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="ucp-redbench-"))
    cfg = dict(vars(args), addr=f"127.0.0.1:{free_port()}", work=str(out))
    env = child_env(8 // args.procs, pythonpath=[REPO])
    try:
        return run_job(__file__, args.procs, cfg, out, env)
    finally:  # the snapshots live in shared memory beyond the job (that is their point): free them
        from ucp_jax._src.memory.shm import namespace_root

        port = cfg["addr"].split(":")[1]
        for s in SCHEMES:
            shutil.rmtree(namespace_root(f"redbench-{port}-{s}"), ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def worker(pid: int, cfg: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cfg["addr"], num_processes=cfg["procs"], process_id=pid)
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ucp_jax as ucp
    from ucp_jax.memory import SnapshotManager

    def sync(tag: str) -> None:
        multihost_utils.sync_global_devices(tag)

    def gather_max(x: float) -> float:
        return float(np.max(multihost_utils.process_allgather(np.array([x], np.float32))))

    n, d = cfg["procs"], cfg["width"]
    devs = np.array(sorted(jax.devices(), key=lambda x: (x.process_index, x.id)))
    mesh = jax.sharding.Mesh(devs.reshape(n, -1), ("data", "model"))
    w_sh = NamedSharding(mesh, P("data", "model") if cfg["fsdp"] else P(None, "model"))
    rng = np.random.default_rng(0)
    refs = [rng.standard_normal((d, d), np.float32) * np.float32(d**-0.5)
            for _ in range(layers_for(cfg["mib"] / 1024, d))]  # fmt: skip
    params = {f"w{i:02d}": jax.make_array_from_callback((d, d), w_sh, lambda idx, r=r: r[idx])
              for i, r in enumerate(refs)}  # fmt: skip
    tx = optax.adam(1e-4)
    opt_state = jax.jit(tx.init, out_shardings=None)(params)
    opt_state = jax.tree.map(
        lambda z: jax.device_put(z, w_sh if z.ndim == 2 else NamedSharding(mesh, P())), opt_state
    )
    shardings = jax.tree.map(lambda a: a.sharding, (params, opt_state))
    x_sh = NamedSharding(mesh, P("data", None))

    def step(p, s, x):
        def loss(p):
            h = x
            for k in sorted(p):
                h = jax.numpy.tanh(h @ p[k])
            return jax.numpy.mean(h**2)

        u, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    step_fn = jax.jit(step, out_shardings=shardings, donate_argnums=(0, 1))

    def batch(i: int) -> jax.Array:
        ref = np.random.default_rng(i).standard_normal((cfg["batch"], d)).astype(np.float32)
        return jax.make_array_from_callback(ref.shape, x_sh, lambda idx: ref[idx])

    port = cfg["addr"].split(":")[1]
    mgrs = {s: SnapshotManager(None, redundancy=None if s == "none" else s,
                               namespace=f"redbench-{port}-{s}", keep=1) for s in SCHEMES}  # fmt: skip
    i = 0
    for mgr in mgrs.values():  # compile the step and each scheme's copies and exchanges
        for _ in range(2):
            i += 1
            params, opt_state = step_fn(params, opt_state, batch(i))
            mgr.snapshot(i, params, opt_state)
            jax.block_until_ready(params)
        mgr.wait()
    times: dict[str, list[float]] = {m: [] for m in ("base", *SCHEMES)}
    copy_s: dict[str, list[float]] = {s: [] for s in SCHEMES}
    fill_s: dict[str, list[float]] = {s: [] for s in SCHEMES}
    call_s: dict[str, list[float]] = {s: [] for s in SCHEMES}
    sync("start")
    while len(times["rs2"]) < cfg["steps"]:
        for mode in times:
            for _ in range(max(1, cfg["steps"] // 4)):
                i += 1
                t0 = time.perf_counter()
                params, opt_state = step_fn(params, opt_state, batch(i))
                if mode != "base":
                    jax.block_until_ready((params, opt_state))  # `call`: the snapshot's own time
                    t1 = time.perf_counter()
                    mgrs[mode].snapshot(i, params, opt_state)
                    call_s[mode].append(time.perf_counter() - t1)
                jax.block_until_ready((params, opt_state))
                times[mode].append(time.perf_counter() - t0)
            if mode != "base":
                mgrs[mode].wait()
                copy_s[mode].append(mgrs[mode].stats.copy_s)
                fill_s[mode].append(mgrs[mode].stats.fill_s)
    # the same step in every scheme's memory, and on disk
    i += 1
    params, opt_state = step_fn(params, opt_state, batch(i))
    for mgr in mgrs.values():
        mgr.snapshot(i, params, opt_state)
        mgr.wait()
    stats = {s: vars(m.stats) for s, m in mgrs.items()}
    expect = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), (params, opt_state))
    targets = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                           (params, opt_state))  # fmt: skip
    disk = Path(cfg["work"]) / "ckpt"
    ucp.save(disk, params, opt_state, step=i)
    del params, opt_state
    buf = 64 << 20
    src = np.random.default_rng(1).integers(0, 255, buf, dtype=np.uint8)
    dst = np.ones(buf, np.uint8)
    sync("memcpy")
    mem = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        mem.append(buf / (time.perf_counter() - t0))
    del src, dst

    def check(got: Any, tag: str) -> None:
        leaves = zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(expect))
        for (path, a), b in leaves:
            if np.asarray(a.addressable_shards[0].data).tobytes() != b.tobytes():
                raise AssertionError(f"{tag}: {jax.tree_util.keystr(path)} is not bit-exact")

    def timed(tag: str, fn: Any) -> float:
        sync(tag)
        t0 = time.perf_counter()
        got = fn()
        jax.block_until_ready(got)
        dt = gather_max(time.perf_counter() - t0)
        check(got, tag)
        return dt

    rec: dict[str, list[float]] = {}
    losses = {"xor": [(), (1,)], "rs2": [(), (1,), (1, 2)], "none": [()]}
    for r in range(cfg["repeats"]):
        for s, cases in losses.items():
            for lost in cases:
                root = mgrs[s].root
                if pid == 0:
                    for k in lost:
                        os.rename(root / str(k), root / f"gone-{k}")
                got_lost: list[int] = []

                def restore(s: str = s, out: list[int] = got_lost) -> Any:
                    res = mgrs[s].restore(*targets)
                    out.extend(mgrs[s].restored.lost)
                    return res

                name = f"{s}, {len(lost)} lost"
                rec.setdefault(name, []).append(timed(f"{name}{r}", restore))
                assert got_lost == list(lost) and mgrs[s].restored.step == i, (name, got_lost)
                sync(f"{name}{r}done")
                if pid == 0:
                    for k in lost:
                        os.rename(root / f"gone-{k}", root / str(k))
        if pid == 0:
            evict_pages(disk)
        rec.setdefault("disk, cold", []).append(
            timed(f"cold{r}", lambda: ucp.restore(disk, *targets))
        )
        rec.setdefault("disk, warm", []).append(
            timed(f"warm{r}", lambda: ucp.restore(disk, *targets))
        )
    for mgr in mgrs.values():
        mgr.free(all_nodes=True)
    sync("done")
    if pid:
        return
    med = statistics.median
    result = {
        "config": {k: v for k, v in cfg.items() if k not in ("addr", "work")},
        "state_bytes": sum(r.nbytes for r in refs) * 3,
        "step_s": {m: med(v) for m, v in times.items()},
        "steps": {m: len(v) for m, v in times.items()},
        "stats": stats,
        "copy_s": {s: med(v) for s, v in copy_s.items()},
        "fill_s": {s: med(v) for s, v in fill_s.items()},
        "call_s": {s: med(v) for s, v in call_s.items()},
        "memcpy_Bps": med(mem),
        "restore_s": {k: med(v) for k, v in rec.items()},
        "loadavg": os.getloadavg(),
    }
    Path(cfg["work"], "result.json").write_text(json.dumps(result, indent=1))


def table(r: dict[str, Any]) -> str:
    c, st = r["config"], r["step_s"]
    lines = [
        f"{c['procs']} processes x {8 // c['procs']} CPU devices, state "
        f"{r['state_bytes'] / 2**20:.0f} MiB (params + adam), weights "
        f"{'sharded over processes (exchanged)' if c['fsdp'] else 'replicated over processes'}, "
        f"one snapshot per step (donated state); load average {r['loadavg'][0]:.1f}",
        "",
        f"{'scheme':8}{'step':>9}{'cost':>9}{'call':>9}{'vs xor':>8}{'node keeps':>12}{'fill':>9}"
        f"{'fill GB/s':>11}{'of memcpy':>11}{'commit':>9}",
        f"{'(none)':8}{st['base'] * 1e3:8.1f}ms",
    ]
    for s in SCHEMES:
        cost, call = st[s] - st["base"], r["call_s"][s]
        nb, fs = r["stats"][s]["nbytes"], r["fill_s"][s]
        lines.append(
            f"{s:8}{st[s] * 1e3:8.1f}ms{cost * 1e3:+8.1f}ms{call * 1e3:7.1f}ms"
            f"{call / r['call_s']['xor']:7.2f}x{nb / 2**20:9.1f} MiB"
            f"{fs * 1e3:7.1f}ms{nb / fs / GB:10.2f}{nb / fs / r['memcpy_Bps']:10.0%}"
            f"{(r['copy_s'][s] - fs) * 1e3:7.1f}ms"
        )
    lines += ["cost: median step time minus the baseline's; call: median time in snapshot() on the"
              " training thread, the step's outputs ready (CPU devices, donated state: it copies"
              " and encodes before it returns), and its ratio to xor's;",
              "fill: the node's blob written (copies, XOR, bit-sliced Q) on its training thread;"
              " commit: digests and extras exchanged with the peers, index and COMMIT written, in"
              " the background",
              f"memcpy, every process at once: {r['memcpy_Bps'] / GB:.2f} GB/s", "",
              f"{'restore (max over processes)':32}{'s':>8}{'disk cold / it':>16}"]  # fmt: skip
    cold = r["restore_s"]["disk, cold"]
    for k, v in r["restore_s"].items():
        lines.append(f"{k:32}{v:8.3f}{cold / v:15.1f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=4, choices=(2, 4, 8))
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24, help="timed steps per mode")
    ap.add_argument("--repeats", type=int, default=3, help="restore measurements")
    ap.add_argument("--fsdp", action="store_true", help="shard the weights over processes")
    ap.add_argument("--out", default="bench_out/redundancy.json")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, json.loads(args.config))
        return
    result = launch(args)
    print(table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
