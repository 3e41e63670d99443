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

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp

GB = 1e9  # throughput unit: 1 GB = 1e9 bytes
SAVE_TARGET = 1.0  # ucp save throughput >= 1.0 x Orbax save throughput
RESHARD_TARGET = 1.1  # ucp reshard restore time <= 1.1 x Orbax same-mesh restore time


# --------------------------------------------------------------------------------- train state


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the transformer-like parameter tree."""

    d_model: int
    d_ff: int
    vocab: int
    layers: int

    @property
    def param_bytes(self) -> int:
        """float32 bytes of all parameters."""
        per_layer = 4 * self.d_model**2 + 2 * self.d_model * self.d_ff + 2 * self.d_model
        return 4 * (per_layer * self.layers + self.vocab * self.d_model + self.d_model)


def model_shape(gib: float) -> ModelShape:
    """The smallest layer count whose train state (params x 3) holds at least `gib` GiB."""
    d = 1024 if gib >= 0.5 else 512
    base = ModelShape(d_model=d, d_ff=4 * d, vocab=8 * d, layers=0)
    per_layer = ModelShape(d, 4 * d, 0, 1).param_bytes - 4 * d
    want = gib * 2**30 / 3 - base.param_bytes
    return ModelShape(d, 4 * d, 8 * d, max(1, math.ceil(want / per_layer)))


# Megatron-style: column-parallel in, row-parallel out, vocab-parallel embedding, norms replicated.
# The reshard target uses a (4, 2) mesh over the devices in reverse order with 2-D (FSDP x TP) specs.
_SPECS: dict[str, tuple[P, P]] = {
    "embed": (P("model", None), P(None, "model")),
    "column": (P(None, "model"), P("data", "model")),
    "row": (P("model", None), P("model", "data")),
    "norm": (P(), P("model")),
}
_KINDS = {"wq": "column", "wk": "column", "wv": "column", "wo": "row", "w1": "column", "w2": "row"}


def param_layout(m: ModelShape) -> dict[str, Any]:
    """Nested dict of (shape, spec kind) for every parameter."""
    d, f = m.d_model, m.d_ff
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, f), "w2": (f, d)}
    tree: dict[str, Any] = {"embed": ((m.vocab, d), "embed")}
    for i in range(m.layers):
        tree[f"layer_{i}"] = {
            "attn": {k: (shapes[k], _KINDS[k]) for k in ("wq", "wk", "wv", "wo")},
            "mlp": {k: (shapes[k], _KINDS[k]) for k in ("w1", "w2")},
            "norm1": ((d,), "norm"),
            "norm2": ((d,), "norm"),
        }
    tree["final_norm"] = ((d,), "norm")
    return tree


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


def meshes() -> tuple[Mesh, Mesh]:
    """The save mesh (2, 4) and the reshard mesh (4, 2), both ('data', 'model')."""
    devs = np.array(jax.devices()[:8])
    return Mesh(devs.reshape(2, 4), ("data", "model")), Mesh(
        devs[::-1].reshape(4, 2), ("data", "model")
    )


def shardings(layout: dict[str, Any], mesh: Mesh, which: int) -> dict[str, Any]:
    """NamedShardings of the params on `mesh`, spec set `which` (0: save layout, 1: reshard)."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, _SPECS[s[1]][which]), layout, is_leaf=_is_spec
    )


def build_state(m: ModelShape, mesh: Mesh, seed: int = 0) -> tuple[Any, Any]:
    """Random params and an `optax.adam` state with random mu/nu (as after some steps).

    Values come from numpy's generator (fast on a small CPU) and are placed with the params'
    Megatron shardings; mu/nu mirror them, `count` is replicated. Returns (params, opt_state).
    """
    layout = param_layout(m)
    p_sh = shardings(layout, mesh, 0)
    shapes = jax.tree.map(lambda s: s[0], layout, is_leaf=_is_spec)
    rng = np.random.default_rng(seed)

    def rand(scale: float, positive: bool = False) -> Any:
        def one(shape: tuple[int, ...], sh: NamedSharding) -> jax.Array:
            x = rng.standard_normal(shape, dtype=np.float32)
            x *= np.float32(scale)
            return jax.device_put(np.abs(x) if positive else x, sh)

        return jax.tree.map(one, shapes, p_sh, is_leaf=lambda x: isinstance(x, tuple))

    params = rand(0.02)
    tx = optax.adam(1e-3)
    adam, *rest = jax.eval_shape(tx.init, params)
    count = jax.device_put(np.asarray(7, np.int32), NamedSharding(mesh, P()))
    opt_state = (adam._replace(count=count, mu=rand(1e-3), nu=rand(1e-6, positive=True)), *rest)
    jax.block_until_ready((params, opt_state))
    return params, opt_state


def targets_for(
    params: Any, opt_state: Any, layout: dict[str, Any], mesh: Mesh, which: int
) -> tuple[Any, Any]:
    """Abstract (ShapeDtypeStruct with sharding) params and opt_state for a restore."""
    p_sh = shardings(layout, mesh, which)
    p_tgt = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, p_sh
    )
    rep = NamedSharding(mesh, P())

    def opt_leaf(x: jax.Array) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)

    # adam state: (ScaleByAdamState(count, mu, nu), EmptyState()); mu and nu mirror params.
    adam = opt_state[0]
    o_tgt = (
        adam._replace(count=opt_leaf(adam.count), mu=p_tgt, nu=p_tgt),
        *opt_state[1:],
    )
    return p_tgt, o_tgt


def tree_bytes(tree: Any) -> int:
    """Logical (global, replicas counted once) bytes of all leaves."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ------------------------------------------------------------------------------------ helpers


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dir_bytes(path: str) -> tuple[int, int]:
    """(total bytes, number of files) under `path`."""
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            total += os.path.getsize(os.path.join(root, n))
            files += 1
    return total, files


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load_average() -> float:
    """The 1-minute load average (other work on the machine competes for its cores)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


@dataclass
class Timing:
    """One timed run: wall seconds, CPU seconds of this process, load average at its start."""

    wall: float
    cpu: float
    load: float


def timed(fn: Callable[[], Any]) -> tuple[Timing, Any]:
    """Run `fn` until its result is ready (after a sync and a GC, so neither lands inside)."""
    gc.collect()
    os.sync()
    load = load_average()
    c0, t0 = cpu_seconds(), time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return Timing(time.perf_counter() - t0, cpu_seconds() - c0, load), out


def check_equal(restored: Any, expected_host: Any, target: Any, what: str) -> None:
    """Raise unless every restored leaf is bit-identical and laid out as the target asks."""
    r_leaves = jax.tree.leaves(restored)
    e_leaves = jax.tree.leaves(expected_host)
    t_leaves = jax.tree.leaves(target)
    if not (len(r_leaves) == len(e_leaves) == len(t_leaves)):
        raise AssertionError(f"{what}: {len(r_leaves)} leaves restored, {len(e_leaves)} expected")
    for r, e, t in zip(r_leaves, e_leaves, t_leaves):
        if not r.sharding.is_equivalent_to(t.sharding, len(t.shape)):
            raise AssertionError(f"{what}: sharding {r.sharding} != target {t.sharding}")
        got = np.asarray(r)
        if got.dtype != e.dtype or got.shape != e.shape:
            raise AssertionError(f"{what}: {got.dtype}{got.shape} != {e.dtype}{e.shape}")
        if got.tobytes() != np.ascontiguousarray(e).tobytes():
            raise AssertionError(f"{what}: restored bytes differ from the original")


def versions() -> dict[str, str]:
    """Versions of the libraries involved."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "optax", "numpy", "ucp_jax"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "?"
    return out


def machine_info(directory: str) -> dict[str, Any]:
    """Cores, memory, file system of `directory`, platform."""
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    fs = None
    with contextlib.suppress(OSError, IndexError):
        fs = subprocess.run(
            ["df", "-T", directory], capture_output=True, text=True, check=False
        ).stdout.splitlines()[-1]
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu,
        "memory_bytes": mem,
        "platform": platform.platform(),
        "directory": directory,
        "filesystem": fs,
        "jax_backend": jax.default_backend(),
        "jax_devices": jax.device_count(),
        "versions": versions(),
    }


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
        return statistics.median(t.wall for t in self.runs)

    @property
    def cpu(self) -> float:
        return statistics.median(t.cpu for t in self.runs)

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
    machine = machine_info(work)
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
        for rep in range(args.repeats):
            order = ["orbax", "ucp"] if rep % 2 == 0 else ["ucp", "orbax"]
            paths = {t: os.path.join(work, f"{t}-{rep}") for t in order}
            for tool in order:
                record("save", tool, "-", tools.save(tool, paths[tool]), rep)
                if rep == 0:
                    size, files = dir_bytes(paths[tool])
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


def tgt_tree(tgt: tuple[Any, Any]) -> dict[str, Any]:
    """The restore target in the {'params', 'opt_state'} layout used for both tools."""
    return {"params": tgt[0], "opt_state": tgt[1]}


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
    loads = [t.load for r in results.values() for t in r.runs]
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
        f"Load average at the start of the runs: median {statistics.median(loads):.1f}, max "
        f"{max(loads):.1f} on {cores} cores"
        + (
            " -- other work shared the machine; expect noisy wall times"
            if statistics.median(loads) > cores
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
            "save_mesh": {"shape": [2, 4], "axes": ["data", "model"], "specs": _spec_json(0)},
            "reshard_mesh": {"shape": [4, 2], "axes": ["data", "model"], "specs": _spec_json(1)},
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


def _spec_json(which: int) -> dict[str, str]:
    """The PartitionSpec of each parameter kind in layout `which`, as text."""
    return {kind: str(specs[which]) for kind, specs in _SPECS.items()}


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
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out} ({res['wall_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
