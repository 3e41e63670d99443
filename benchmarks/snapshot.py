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

Usage::

    python benchmarks/snapshot.py                      # 2 processes, 1 GiB, writes JSON
    python benchmarks/snapshot.py --gib 0.25 --steps 12 --out /tmp/snap.json
    python benchmarks/snapshot.py --no-donate --redundancy none
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from orbax_tiers import orbax_table

STEP_TARGET = 0.03  # one snapshot per step: at most 3% slower (median)
RECOVERY_TARGET = 10.0  # recovery from memory at least 10x faster than from disk
GB = 1e9


# ----------------------------------------------------------------------------------- launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace) -> dict[str, Any]:
    """Run the job; return process 0's results."""
    out = Path(tempfile.mkdtemp(prefix="ucp-snapbench-"))
    cfg = dict(vars(args), addr=f"127.0.0.1:{_free_port()}", work=str(out))
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // args.procs}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), *filter(None, [env.get("PYTHONPATH")])]
    )
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(i), "--config", json.dumps(cfg)],
            env=env,
            stdout=subprocess.DEVNULL if i else None,
            stderr=open(out / f"stderr_{i}.txt", "w"),  # noqa: SIM115
        )
        for i in range(args.procs)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        tail = "\n".join((out / f"stderr_{i}.txt").read_text()[-3000:] for i in range(len(procs)))
        raise SystemExit(f"benchmark job failed (exit codes {codes}):\n{tail}")
    return json.loads((out / "result.json").read_text())


# ------------------------------------------------------------------------------------- worker


def _layers(gib: float, d: int) -> int:
    return max(1, math.ceil(gib * 2**30 / 3 / (d * d * 4)))


def worker(pid: int, cfg: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cfg["procs"] > 1:
        jax.distributed.initialize(cfg["addr"], num_processes=cfg["procs"], process_id=pid)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from orbax_tiers import OrbaxEmergency, OrbaxLocal, orbax_summary

    import ucp_jax as ucp
    from ucp_jax.memory import SnapshotManager

    def sync(tag: str) -> None:
        multihost_utils.sync_global_devices(tag)

    def gather_max(x: float) -> float:
        return float(np.max(multihost_utils.process_allgather(np.array([x], np.float32))))

    n = cfg["procs"]
    devs = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    mesh = jax.sharding.Mesh(devs.reshape(n, -1), ("data", "model"))
    d = cfg["width"]
    layers = _layers(cfg["gib"], d)
    w_sh = NamedSharding(mesh, P(None, "model"))
    rng = np.random.default_rng(0)

    def weight() -> jax.Array:
        ref = rng.standard_normal((d, d), np.float32) * np.float32(d**-0.5)
        return jax.make_array_from_callback(ref.shape, w_sh, lambda idx: ref[idx])

    params = {f"w{i:02d}": weight() for i in range(layers)}
    tx = optax.adam(1e-4)
    adam, *rest = tx.init(params)
    mu = jax.tree.map(lambda z, p: jax.device_put(z, p.sharding), adam.mu, params)
    nu = jax.tree.map(lambda z, p: jax.device_put(z, p.sharding), adam.nu, params)
    count = jax.device_put(adam.count, NamedSharding(mesh, P()))
    opt_state = (adam._replace(count=count, mu=mu, nu=nu), *rest)
    del adam, mu, nu
    shardings = jax.tree.map(lambda a: a.sharding, (params, opt_state))
    x_sh = NamedSharding(mesh, P("data", None))

    def loss(p, x):
        for k in sorted(p):
            x = jnp.tanh(x @ p[k])
        return jnp.mean(x**2)

    def step(p, s, x):
        g = jax.grad(loss)(p, x)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    donate = not cfg["no_donate"]
    step_fn = jax.jit(step, out_shardings=shardings, donate_argnums=(0, 1) if donate else ())
    state_bytes = sum(a.nbytes for a in jax.tree.leaves((params, opt_state)))

    def batch(i: int) -> jax.Array:
        ref = np.random.default_rng(i).standard_normal((cfg["batch"], d)).astype(np.float32)
        return jax.make_array_from_callback(ref.shape, x_sh, lambda idx: ref[idx])

    mgr = SnapshotManager(
        Path(cfg["work"]) / "persist",
        redundancy=cfg["redundancy"] if cfg["redundancy"] != "none" else None,
        namespace=f"bench-{cfg['addr'].split(':')[1]}",
        keep=cfg["keep"],
        shm_dir=cfg["shm_dir"],
        donation_safe=donate,  # a donating step needs the snapshot's own device copies
    )
    times: dict[str, list[float]] = {"base": [], "snap": []}
    dispatch, copy_s, copied = [], [], []
    i = 0
    for _ in range(cfg["warmup"]):  # compile the step and the snapshot's copies
        i += 1
        params, opt_state = step_fn(params, opt_state, batch(i))
        mgr.snapshot(i, params, opt_state)
        jax.block_until_ready(params)
    mgr.wait()
    # Orbax, same job and state: async CheckpointManager into /dev/shm; the emergency manager
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            {"params": params, "opt_state": opt_state})  # fmt: skip
    tiers, orbax_errors = [], {}
    port = cfg["addr"].split(":")[1]
    shm = Path(cfg["shm_dir"] or "/dev/shm")
    for name in cfg["orbax"]:
        tier = (
            OrbaxLocal(shm / f"orbax-local-{port}", abstract, mesh)
            if name == "local"  # (one folder: both processes are on this machine)
            else OrbaxEmergency(
                shm / f"orbax-em-{port}" / f"host{pid}",
                abstract,
                mesh,
                Path(cfg["work"]) / "orbax-em-persist",
            )
        )
        try:
            tier.start()
            for _ in range(2):  # compile, and a first save of each kind
                i += 1
                params, opt_state = step_fn(params, opt_state, batch(i))
                tier.save(i, {"params": params, "opt_state": opt_state})
                jax.block_until_ready(params)
            tier.wait()
            tiers.append(tier)
        except Exception as e:  # recorded and printed: why that tier is absent
            orbax_errors[tier.name] = f"{type(e).__name__}: {e}"
            print(f"process {pid}: {tier.name} does not run: {orbax_errors[tier.name]}",
                  file=sys.stderr, flush=True)  # fmt: skip
            sync(f"orbax-failed-{name}")
    times.update({t.name: [] for t in tiers})
    block = max(1, cfg["steps"] // 4)
    sync("start")
    load = [os.getloadavg()[0]]
    by_name = {t.name: t for t in tiers}
    while len(times["snap"]) < cfg["steps"]:
        for mode in times:
            for _ in range(block):
                i += 1
                t0 = time.perf_counter()
                params, opt_state = step_fn(params, opt_state, batch(i))
                if mode == "snap":
                    t1 = time.perf_counter()
                    mgr.snapshot(i, params, opt_state)
                    dispatch.append(time.perf_counter() - t1)
                elif mode in by_name:
                    by_name[mode].save(i, {"params": params, "opt_state": opt_state})
                jax.block_until_ready((params, opt_state))
                times[mode].append(time.perf_counter() - t0)
                if mode == "snap" and mgr.stats.step == i - 1:
                    copy_s.append(mgr.stats.copy_s)
                    copied.append(mgr.stats.copied_bytes)
            mgr.wait()  # the last snapshot of the block lands before the next baseline block
            for t in tiers:
                t.wait()
    load.append(os.getloadavg()[0])
    # end-to-end snapshot with training idle
    e2e = []
    for _ in range(3):
        i += 1
        params, opt_state = step_fn(params, opt_state, batch(i))
        jax.block_until_ready(params)
        sync(f"e2e{i}")
        t0 = time.perf_counter()
        mgr.snapshot(i, params, opt_state)
        mgr.wait()
        e2e.append(time.perf_counter() - t0)
    node_bytes = mgr.stats.nbytes
    last = i

    # memcpy bandwidth, every process at once
    buf = 256 << 20
    src = np.random.default_rng(1).integers(0, 255, buf, dtype=np.uint8)
    dst = np.ones(buf, np.uint8)
    shm_path = Path(cfg["shm_dir"] or "/dev/shm") / f"ucp-bench-memcpy-{uuid.uuid4().hex}"
    import mmap

    with open(shm_path, "wb+") as f:
        f.truncate(buf)
        mm = mmap.mmap(f.fileno(), buf)
        mm.madvise(mmap.MADV_HUGEPAGE)  # as snapshot blobs do
    shm_dst = np.frombuffer(mm, np.uint8)
    shm_dst[:] = 1  # pre-fault
    sync("memcpy")
    mem, shm = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        mem.append(buf / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        np.copyto(shm_dst, src)
        shm.append(buf / (time.perf_counter() - t0))
    del shm_dst
    mm.close()
    shm_path.unlink()
    del src, dst

    # recovery: shared memory vs a universal checkpoint on disk
    expect = jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), (params, opt_state))
    p_t = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                       (params, opt_state))  # fmt: skip
    disk = Path(cfg["disk"] or cfg["work"]) / f"ckpt-{cfg['addr'].split(':')[1]}"
    sync("disk-save")
    t0 = time.perf_counter()
    ucp.save(disk, params, opt_state, step=last)
    disk_save_s = gather_max(time.perf_counter() - t0)
    for t in tiers:  # each Orbax tier's copy of the same step
        t.save(last, {"params": params, "opt_state": opt_state})
        t.wait()
    del params, opt_state
    sync("saved")

    def check(got: Any) -> None:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expect)):
            assert np.asarray(a.addressable_shards[0].data).tobytes() == b.tobytes()

    rec: dict[str, list[float]] = {"memory": [], "disk_cold": [], "disk_warm": []}
    rec.update({t.name: [] for t in tiers})
    for r in range(cfg["repeats"]):
        for t in tiers:  # a fresh Orbax manager (as a restarted job) restores the latest step
            sync(f"{t.name}{r}")
            t0 = time.perf_counter()
            got_step, got = t.restore()
            jax.block_until_ready(got)
            rec[t.name].append(gather_max(time.perf_counter() - t0))
            assert got_step == last, (t.name, got_step, last)
            if r == 0:
                check((got["params"], got["opt_state"]))
            del got
        sync(f"mem{r}")
        t0 = time.perf_counter()
        got = mgr.restore(*p_t)
        jax.block_until_ready(got)
        rec["memory"].append(gather_max(time.perf_counter() - t0))
        assert mgr.restored.step == last and mgr.restored.source == "memory"
        if r == 0:
            check(got)
        del got
        if pid == 0:
            evicted = _evict(disk)
        sync(f"cold{r}")
        t0 = time.perf_counter()
        got = ucp.restore(disk, *p_t)
        jax.block_until_ready(got)
        rec["disk_cold"].append(gather_max(time.perf_counter() - t0))
        if r == 0:
            check(got)
        del got
        sync(f"warm{r}")
        t0 = time.perf_counter()
        got = ucp.restore(disk, *p_t)
        jax.block_until_ready(got)
        rec["disk_warm"].append(gather_max(time.perf_counter() - t0))
        del got
    mgr.free(all_nodes=True)
    for t in tiers:
        t.close()
    sync("done")
    if pid != 0:
        return
    import shutil

    shutil.rmtree(disk, ignore_errors=True)
    med = statistics.median

    def p99(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]

    result = {
        "config": {k: v for k, v in cfg.items() if k not in ("addr", "work")},
        "layers": layers,
        "state_bytes": state_bytes,
        "node_snapshot_bytes": node_bytes,
        "shm_dir": str(mgr.root.parent),
        "huge_pages": mgr.huge_pages,
        "evicted_pages_ok": bool(evicted),
        "step_s": {
            m: {"median": med(v), "p99": p99(v), "n": len(v), "all": v} for m, v in times.items()
        },
        "snapshot_dispatch_s": {"median": med(dispatch), "p99": p99(dispatch)},
        "snapshot_copy_s": {"median": med(copy_s) if copy_s else None},
        "snapshot_copy_bytes": med(copied) if copied else None,
        "snapshot_e2e_s": med(e2e),
        "memcpy_Bps": med(mem),
        "memcpy_shm_Bps": med(shm),
        "recovery_s": {k: med(v) for k, v in rec.items()},
        "recovery_all_s": rec,
    }
    slow = result["step_s"]["snap"]["median"] / result["step_s"]["base"]["median"] - 1
    result["step_overhead"] = slow
    if copy_s:
        result["snapshot_Bps"] = result["snapshot_copy_bytes"] / result["snapshot_copy_s"]["median"]
    result["snapshot_e2e_Bps"] = node_bytes / result["snapshot_e2e_s"]
    result["recovery_speedup_cold"] = rec_ratio = (
        result["recovery_s"]["disk_cold"] / result["recovery_s"]["memory"]
    )
    result["recovery_speedup_warm"] = (
        result["recovery_s"]["disk_warm"] / result["recovery_s"]["memory"]
    )
    result["disk_save_s"] = disk_save_s
    result["orbax"] = orbax_summary(result, [t.name for t in tiers], orbax_errors)
    result["targets"] = {
        "step_overhead<=3%": slow <= STEP_TARGET,
        "recovery>=10x (cold)": rec_ratio >= RECOVERY_TARGET,
        **{
            f"{k} vs {name}": v
            for name, o in result["orbax"]["tiers"].items()
            for k, v in o["ucp_wins"].items()
        },
    }
    result["machine"] = {
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "loadavg_1min_during_steps": load,  # other work on the machine skews step times
    }
    Path(cfg["work"], "result.json").write_text(json.dumps(result, indent=1))


def _evict(path: Path) -> bool:
    """Drop a checkpoint's pages from the page cache (so that the restore reads the disk)."""
    os.sync()
    ok = True
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                ok = False
            finally:
                os.close(fd)
    return ok


# ------------------------------------------------------------------------------------- report


def table(r: dict[str, Any]) -> str:
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2, choices=(1, 2, 4, 8))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24, help="timed steps per mode")
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
        worker(args.worker, json.loads(args.config))
        return
    args.orbax = [t for t in args.orbax.split(",") if t]
    result = launch(args)
    print(table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
