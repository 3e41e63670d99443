"""The worker of `snapshot.py`: one process of its jax.distributed job (CPU devices, gloo).

Trains an MLP stack with `optax.adam` (weights sharded over 'model' inside a process, replicated
over 'data' across processes), times steps without and with a `SnapshotManager.snapshot()` every
step (and beside it the Orbax tiers of `orbax_tiers.py`) in interleaved blocks, the snapshot
bandwidth against memcpy, and recovery from shared memory against `ucp.restore` from disk (cold
and warm). Process 0 writes `result.json` into the job's work folder for the launcher.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import (
    evict_pages,
    load_average,
    p99,
    paired_ratio_ci,
    peak_rss,
    reset_peak_rss,
    write_json,
)
from orbax_tiers import OrbaxEmergency, OrbaxLocal, orbax_summary

STEP_TARGET = 0.03  # one snapshot per step: at most 3% slower (median)
RECOVERY_TARGET = 10.0  # recovery from memory at least 10x faster than from disk


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memcpy_bandwidth(
    shm_dir: Path, barrier: Callable[[], None], nbytes: int = 256 << 20, repeats: int = 5
) -> tuple[list[float], list[float]]:
    """Bytes/s of numpy copies between two pre-faulted buffers, and into a pre-faulted mapping
    of a file in `shm_dir` (huge pages asked for, as snapshot blobs do): `repeats` of each,
    after `barrier()` (so that every process of the job copies at once)."""
    import numpy as np

    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, np.uint8)
    shm_path = shm_dir / f"ucp-bench-memcpy-{uuid.uuid4().hex}"
    with open(shm_path, "wb+") as f:
        f.truncate(nbytes)
        mm = mmap.mmap(f.fileno(), nbytes)
        mm.madvise(mmap.MADV_HUGEPAGE)  # as snapshot blobs do
    shm_dst = np.frombuffer(mm, np.uint8)
    shm_dst[:] = 1  # pre-fault
    barrier()
    mem, shm = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        mem.append(nbytes / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        np.copyto(shm_dst, src)
        shm.append(nbytes / (time.perf_counter() - t0))
    del shm_dst
    mm.close()
    shm_path.unlink()
    return mem, shm


def layers_for(gib: float, d: int) -> int:
    """Layers of `d` x `d` float32 weights whose params + adam state hold `gib` GiB."""
    return max(1, math.ceil(gib * 2**30 / 3 / (d * d * 4)))


def worker(pid: int, cfg: dict[str, Any]) -> None:
    """Process `pid` of the job: train, snapshot, measure; process 0 writes result.json."""
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
    layers = layers_for(cfg["gib"], d)
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
    blocks: dict[str, list[list[float]]] = {m: [] for m in times}  # step times, block by block
    peaks: dict[str, list[int]] = {m: [] for m in times}  # peak RSS above the block's start
    block = max(1, cfg.get("block") or cfg["steps"] // 4)
    sync("start")
    load = [load_average()]
    by_name = {t.name: t for t in tiers}
    while len(times["snap"]) < cfg["steps"]:
        for mode in times:
            blocks[mode].append([])
            rss0 = _rss()
            reset_peak_rss()
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
                blocks[mode][-1].append(times[mode][-1])
                if mode == "snap" and mgr.stats.step == i - 1:
                    copy_s.append(mgr.stats.copy_s)
                    copied.append(mgr.stats.copied_bytes)
            mgr.wait()  # the last snapshot of the block lands before the next baseline block
            for t in tiers:
                t.wait()
            peaks[mode].append(max(0, peak_rss() - rss0))
    load.append(load_average())
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
    mem, shm = memcpy_bandwidth(Path(cfg["shm_dir"] or "/dev/shm"), lambda: sync("memcpy"))

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
            evicted = evict_pages(disk)
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
    shutil.rmtree(disk, ignore_errors=True)
    med = statistics.median

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
    # the same, paired block by block, with a 95% bootstrap interval
    est, lo, hi = paired_ratio_ci(blocks["snap"], blocks["base"])
    result["step_overhead_paired"] = {"estimate": est, "ci95": [lo, hi], "blocks": len(blocks["base"]),
                                      "block_steps": block}  # fmt: skip
    result["peak_rss_above_block_start"] = {m: med(v) for m, v in peaks.items() if v}
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
    write_json(Path(cfg["work"], "result.json"), result, machine=False)
