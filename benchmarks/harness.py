"""The machinery every benchmark in this folder shares, written once.

* devices: `force_cpu_devices` (N forced CPU devices, before jax is imported) and `child_env`
  (the environment of a worker process: its device count, platform, PYTHONPATH);
* timing: `timed` (wall + CPU seconds of this process + the load average at the start, after a
  GC and a sync), `child_cpu_seconds` (CPU seconds of the children it waited for),
  `interleaved` (the tools' order in each repeat, alternating so that a busy moment of a shared
  machine hits every tool), `Spread` (median, min, max), `p99`;
* memory: `peak_rss` / `reset_peak_rss` (this process's high-water mark) and `run_measured` (a
  command's wall time and the peak resident memory of its whole process tree);
* disk: `sync` (timed), `drop_caches`, `evict_pages`, `dir_bytes`;
* machine: `machine_info` (CPU model, cores, memory, platform, load, jax's devices when jax is
  loaded, library versions), `free_port`, `sibling_executable`;
* output: `markdown_table` (stdout tables) and `write_json` (results + machine info).

Nothing here imports jax: a benchmark calls `force_cpu_devices` first, then imports jax; the
helpers that wait for jax arrays use the jax a benchmark has already loaded.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")

GB = 1e9  # throughput unit: 1 GB = 1e9 bytes
MiB = 2**20
GiB = 2**30
BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent  # this checkout: its ucp_jax comes before any installed one in workers
DEFAULT_VERSIONS = ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "optax", "numpy", "ucp_jax")

# ------------------------------------------------------------------------------------ devices


def force_cpu_devices(n: int = 8) -> None:
    """Ask XLA for `n` host (CPU) devices and jax for the CPU platform.

    Call it before jax is imported: XLA reads its flags once. An XLA_FLAGS that already forces a
    device count, and a JAX_PLATFORMS already set, are left as they are.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def child_env(
    devices: int | None = None,
    *,
    platform: str | None = "cpu",
    pythonpath: Sequence[str | os.PathLike[str]] = (),
    base: Mapping[str, str] | None = None,
    **extra: str,
) -> dict[str, str]:
    """The environment of a worker process: a copy of `base` (default: this one's).

    `devices`: XLA_FLAGS becomes exactly `n` forced CPU devices (None: inherited). `platform`:
    JAX_PLATFORMS (None: inherited). `pythonpath`: folders put before the inherited PYTHONPATH.
    `extra`: further variables, set as given (XLA_FLAGS="" clears the flags).
    """
    env = dict(os.environ if base is None else base)
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if platform is not None:
        env["JAX_PLATFORMS"] = platform
    if pythonpath:
        parts = [str(p) for p in pythonpath] + [env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------- timing


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child_cpu_seconds() -> float:
    """User + system CPU time of this process's finished (waited-for) children and their own
    waited-for descendants: the difference around `run_measured` is the command's CPU time."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
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


def wait_ready(out: Any) -> Any:
    """Wait until the jax arrays in `out` are computed (a no-op when jax is not loaded)."""
    jax = sys.modules.get("jax")
    return jax.block_until_ready(out) if jax is not None else out


def timed(fn: Callable[[], T], *, settle: bool = True, ready: bool = True) -> tuple[Timing, T]:
    """Run `fn` and time it until its result is ready.

    `settle`: a GC and a sync first, so that neither lands inside the measurement. `ready`: wait
    for the jax arrays in the result (`wait_ready`) before the clock stops.
    """
    if settle:
        gc.collect()
        os.sync()
    load = load_average()
    c0, t0 = cpu_seconds(), time.perf_counter()
    out = fn()
    if ready:
        wait_ready(out)
    return Timing(time.perf_counter() - t0, cpu_seconds() - c0, load), out


def interleaved(
    tools: Sequence[T], repeats: int, *, alternate: bool = True
) -> Iterator[tuple[int, list[T]]]:
    """(repeat index, the tools in the order to run them) for each of `repeats` rounds.

    Every tool runs once per round, so a busy moment of a shared machine hits all of them;
    with `alternate` the order is reversed every other round (A B, B A, A B, ...).
    """
    for rep in range(repeats):
        order = list(tools)
        yield rep, order[::-1] if alternate and rep % 2 else order


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        """The spread of `values` (at least one)."""
        xs = list(values)
        return cls(statistics.median(xs), min(xs), max(xs), len(xs))

    def __str__(self) -> str:
        if self.n == 1:
            return f"{self.median:.3f}"
        return f"{self.median:.3f} ({self.min:.3f}..{self.max:.3f}, n={self.n})"


def paired_ratio_ci(
    a_blocks: Sequence[Sequence[float]],
    b_blocks: Sequence[Sequence[float]],
    *,
    resamples: int = 4000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """How much slower A is than B: median over block pairs of median(A_i) / median(B_i) - 1,
    with a bootstrap interval (pairs resampled with replacement) at `level`.

    Blocks i of A and B ran next to each other (interleaved), so the machine's drift cancels
    within a pair; the interval says how sure the estimate is despite the noise between pairs.
    Returns (estimate, low, high).
    """
    import random

    ratios = [
        statistics.median(a) / statistics.median(b) - 1
        for a, b in zip(a_blocks, b_blocks, strict=True)
        if a and b
    ]
    est = statistics.median(ratios)
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    lo = boots[int((1 - level) / 2 * resamples)]
    hi = boots[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return est, lo, hi


def p99(values: Iterable[float]) -> float:
    """The 99th percentile (nearest rank) of `values`."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, -(-99 * len(xs) // 100) - 1)]


# ------------------------------------------------------------------------------------- memory


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM) in bytes; 0 where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss() -> None:
    """Reset this process's VmHWM to its current RSS (Linux: /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class ChildRun(NamedTuple):
    """What `run_measured` saw of one command."""

    wall: float  # seconds from start to exit
    peak_rss: int  # bytes: the largest sum of RSS over the process tree at one sample
    tail: str  # the last 400 characters of its output


def run_measured(
    cmd: Sequence[str], env: Mapping[str, str] | None = None, *, interval: float = 0.02
) -> ChildRun:
    """Run `cmd` to completion: its wall time and the peak RSS of its process tree.

    The tree (the process and all its descendants) is sampled every `interval` seconds by a
    thread, with psutil. Raises RuntimeError with the output's tail when the command fails.
    """
    import psutil

    t0 = time.perf_counter()
    p = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        try:
            root = psutil.Process(p.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for q in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += q.memory_info().rss
            peak = max(peak, total)
            stop.wait(interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, _ = p.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    th.join()
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.decode()[-4000:]}")
    return ChildRun(wall, peak, out.decode()[-400:])


# --------------------------------------------------------------------------------------- disk


def sync() -> float:
    """Write all dirty pages to disk (sync(2)); returns the seconds it took."""
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False when not permitted (needs root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict_pages(path: str | os.PathLike[str]) -> bool:
    """Drop the pages of every file under `path` from the page cache (posix_fadvise DONTNEED),
    so that the next read comes from the disk; False where the kernel refused one."""
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


def dir_bytes(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(total bytes, number of files) under `path`."""
    total = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            total += os.path.getsize(os.path.join(root, n))
            files += 1
    return total, files


# ------------------------------------------------------------------------------------ machine


def run_job(
    script: str | os.PathLike[str], procs: int, cfg: dict[str, Any], out: Path, env: dict[str, str]
) -> dict[str, Any]:
    """Run `script --worker i --config <cfg as JSON>` for i < procs (a jax.distributed job of
    worker processes), wait for all, and return the `result.json` that worker 0 wrote into `out`.

    Worker 0 prints to this process's stdout; each worker's stderr goes to `out/stderr_<i>.txt`,
    whose tails make the error when any worker fails.
    """
    procs_ = [
        subprocess.Popen(
            [sys.executable, os.fspath(script), "--worker", str(i), "--config", json.dumps(cfg)],
            env=env,
            stdout=subprocess.DEVNULL if i else None,
            stderr=open(out / f"stderr_{i}.txt", "w"),  # noqa: SIM115
        )
        for i in range(procs)
    ]
    codes = [p.wait() for p in procs_]
    if any(codes):
        tail = "\n".join((out / f"stderr_{i}.txt").read_text()[-3000:] for i in range(procs))
        raise SystemExit(f"benchmark job failed (exit codes {codes}):\n{tail}")
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sibling_executable(name: str) -> str:
    """The console script `name` of this interpreter's environment (an unactivated venv's),
    else the one on PATH, else `name` itself."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else shutil.which(name) or name


def versions(packages: Iterable[str] = DEFAULT_VERSIONS) -> dict[str, str]:
    """Python's and the installed `packages`' versions ('?' for a missing one)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "?"
    return out


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
    except OSError:
        return None


def machine_info(
    directory: str | os.PathLike[str] | None = None, packages: Iterable[str] = DEFAULT_VERSIONS
) -> dict[str, Any]:
    """What the numbers were measured on: cores, CPU model, memory, platform, load average, the
    file system of `directory` (when given), jax's backend, device count and device kind (when
    a benchmark has loaded jax; this never imports it), and the versions of `packages`."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "memory_bytes": _meminfo_total(),
        "platform": platform.platform(),
    }
    if directory is not None:
        fs = None
        with contextlib.suppress(OSError, IndexError):
            fs = subprocess.run(
                ["df", "-T", os.fspath(directory)], capture_output=True, text=True, check=False
            ).stdout.splitlines()[-1]
        info.update(directory=os.fspath(directory), filesystem=fs)
    jax = sys.modules.get("jax")
    if jax is not None:
        with contextlib.suppress(Exception):  # a backend that fails to start: no device fields
            info.update(
                jax_backend=jax.default_backend(),
                jax_devices=jax.device_count(),
                jax_device_kind=jax.devices()[0].device_kind,
            )
    info["load_average_1min"] = load_average()
    info["versions"] = versions(packages)
    return info


# ------------------------------------------------------------------------------------- output


def markdown_table(
    headers: Sequence[str] | None,
    rows: Iterable[Sequence[Any]],
    *,
    align: str | None = None,
    pad: bool = False,
) -> str:
    """A Markdown table (no trailing newline).

    `headers`: the column names (None: rows only, no header lines). `align`: one letter per
    column, 'l' or 'r' (default all 'l': `---`, 'r' gives `---:`). `pad`: left-justify every
    column but the last to its widest cell. An empty cell is written as a single space.
    """
    body = [[str(c) for c in r] for r in rows]
    ncols = len(headers) if headers is not None else max((len(r) for r in body), default=0)
    widths = [0] * ncols
    if pad:
        for r in [*([list(headers)] if headers else []), *body]:
            for i, c in enumerate(r[:-1]):
                widths[i] = max(widths[i], len(c))

    def line(cells: Sequence[str]) -> str:
        cells = [c.ljust(widths[i]) if i < ncols - 1 else c for i, c in enumerate(cells)]
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    out = []
    if headers is not None:
        out.append(line(list(headers)))
        marks = {"l": "---", "r": "---:"}
        out.append("|" + "|".join(marks[a] for a in (align or "l" * ncols)) + "|")
    out += [line(r) for r in body]
    return "\n".join(out)


def write_json(
    path: str | os.PathLike[str], doc: dict[str, Any], *, indent: int = 1, machine: bool = True
) -> Path:
    """Write `doc` as JSON to `path` (folders created); returns the path.

    With `machine`, doc['machine'] gets `machine_info()`'s fields that it does not hold yet (a
    benchmark's own machine fields win).
    """
    if machine:
        own = doc.get("machine", {})
        doc["machine"] = {**own, **{k: v for k, v in machine_info().items() if k not in own}}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=indent))
    return out
