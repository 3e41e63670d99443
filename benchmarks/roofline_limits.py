"""The machine's own limits for moving a train state: memcpy, parallel write+fsync, parallel read,
placing host shards on devices. Plain numpy, os and jax only; no checkpoint library.

Each limit moves exactly the bytes the checkpoint tools move: the unique device shards of the
state (one per distinct index of each leaf), with the same number of threads, on the same disk.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import gc
import mmap
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import harness
import jax
import numpy as np


@dataclass
class Shard:
    """One unique device shard of a leaf, as a host array, and where it is written."""

    data: np.ndarray
    path: str = ""


def unique_shards(tree: Any) -> list[np.ndarray]:
    """The host copies of every distinct shard (by index) of every jax.Array leaf of `tree`."""
    out = []
    for leaf in jax.tree.leaves(tree):
        seen = set()
        for s in leaf.addressable_shards:
            key = tuple((sl.start, sl.stop) for sl in s.index)
            if key in seen:
                continue
            seen.add(key)
            out.append(np.asarray(s.data))
    return out


def needed_bytes(targets: Any) -> int:
    """Bytes of the distinct shards the target shardings of `targets` (ShapeDtypeStructs) need."""
    total = 0
    for t in jax.tree.leaves(targets):
        idx = t.sharding.devices_indices_map(t.shape)
        uniq = {tuple((s.start, s.stop) for s in ix) for ix in idx.values()}
        for key in uniq:
            n = 1
            for (start, stop), dim in zip(key, t.shape):
                n *= (stop if stop is not None else dim) - (start or 0)
            total += n * t.dtype.itemsize
    return total


def memcpy_gbps(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """GB/s of one large copy into an already-touched buffer (best of `repeats`)."""
    a = np.ones(nbytes // 8, np.float64)
    b = np.empty_like(a)
    b[:] = 0
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def _pwrite_all(fd: int, buf: memoryview, offset: int = 0) -> None:
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def write_fsync(shards: Sequence[np.ndarray], folder: str, threads: int) -> tuple[float, list[str]]:
    """Seconds to pwrite every shard to its own file and fsync it (and the folder), in parallel."""
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"s{i}") for i in range(len(shards))]

    def one(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _pwrite_all(fd, memoryview(np.ascontiguousarray(shards[i]).reshape(-1).view(np.uint8)))
            os.fsync(fd)
        finally:
            os.close(fd)

    t = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(shards))))
    dfd = os.open(folder, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    return time.perf_counter() - t, paths


def fresh_buffer(shape: tuple[int, ...], dtype: np.dtype, huge: bool = False) -> np.ndarray:
    """An uninitialised host array; with `huge` and 2 MiB or more, an anonymous mapping advised
    to be backed by transparent huge pages (one page fault per 2 MiB instead of per 4 KiB)."""
    count = int(np.prod(shape))
    if not huge or count * dtype.itemsize < 2 << 20:  # a huge page for less would zero more
        return np.empty(shape, dtype)
    size = -(-count * dtype.itemsize // (2 << 20)) * (2 << 20)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shared memory
    with contextlib.suppress(AttributeError, OSError):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mm, dtype, count=count).reshape(shape)


def read_back(
    paths: Sequence[str], shards: Sequence[np.ndarray], threads: int, *, huge: bool = False
) -> float:
    """Seconds to read every file into a fresh host buffer of its shard's shape, in parallel.

    Fresh pages: the heap is trimmed first (as `accounting` does before each tool's operation),
    or the buffers would reuse the pages the last operation freed. With `huge`, the buffers are
    on transparent huge pages (`fresh_buffer`), as ucp's restore buffers are.
    """

    def one(i: int) -> np.ndarray:
        out = fresh_buffer(shards[i].shape, shards[i].dtype, huge)
        view = memoryview(out.reshape(-1).view(np.uint8))
        with open(paths[i], "rb", buffering=0) as f:
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{paths[i]}: short read")
                got += n
        return out

    gc.collect()
    trim_heap()
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(paths))))
    return time.perf_counter() - t


def drop_caches() -> bool:
    """Drop the page cache (root, where the kernel allows it); False where it cannot."""
    return harness.drop_caches()


def aligned_copy(a: np.ndarray, align: int = 64) -> np.ndarray:
    """A C-contiguous copy of `a` whose data starts on an `align`-byte boundary.

    XLA's CPU client can take such a buffer without copying it; placing an unaligned one copies.
    """
    raw = np.empty(a.nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def host_shards(tree: Any, targets: Any) -> list[list[tuple[Any, np.ndarray]]]:
    """Per leaf of `tree` (jax.Arrays): (device, aligned host copy of the region it holds under
    the target sharding), without a global host copy of the state."""
    out = []
    for a, tgt in zip(jax.tree.leaves(tree), jax.tree.leaves(targets)):
        moved = jax.device_put(a, tgt.sharding)
        out.append([(s.device, aligned_copy(np.asarray(s.data))) for s in moved.addressable_shards])
        del moved
    return out


def placement_seconds(
    shards: list[list[tuple[Any, np.ndarray]]], targets: Any, memory_kind: str | None = None
) -> float:
    """Seconds to place host shards (`host_shards`) on their devices and build the arrays.

    With `memory_kind="pinned_host"` each shard goes to its device's pinned host memory.
    """
    t = time.perf_counter()
    outs = []
    for per_dev, tgt in zip(shards, jax.tree.leaves(targets)):
        sh = tgt.sharding if memory_kind is None else tgt.sharding.with_memory_kind(memory_kind)
        arrs = [
            jax.device_put(
                x, d if memory_kind is None else jax.sharding.SingleDeviceSharding(
                    d, memory_kind=memory_kind))
            for d, x in per_dev
        ]  # fmt: skip
        outs.append(jax.make_array_from_single_device_arrays(tgt.shape, sh, arrs))
    jax.block_until_ready(outs)
    return time.perf_counter() - t


def pinned_host_supported() -> bool:
    """Whether the first device offers the `pinned_host` memory kind."""
    with contextlib.suppress(Exception):
        return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}
    return False


# ------------------------------------------------------------------- freed pages on a VM guest


def free_page_reporting() -> bool:
    """This machine is a VM guest whose balloon device reports freed pages to its host.

    With VIRTIO_BALLOON_F_REPORTING (feature bit 5) the guest kernel tells the host, a few
    seconds after a large block of memory is freed, that it may take the block back; the host
    discards it, and the first write to each of those pages later faults into the host again.
    Measured on this project's KVM guests: writing 768 MiB into the page cache took 0.16 s with
    pages freed just before, 0.73-1.86 s with pages freed 3-6 s before. Bare metal has no such cost.
    """
    root = "/sys/bus/virtio/drivers/virtio_balloon"
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            with contextlib.suppress(OSError), open(os.path.join(root, name, "features")) as f:
                bits = f.read().strip()
                if len(bits) > 5 and bits[5] == "1":
                    return True
    return False


def warm_free_pages(nbytes: int) -> float:
    """Write to `nbytes` of fresh memory and free it again; return the seconds it took.

    Freed pages go back to the head of the kernel's free lists, so the next operation's
    allocations (its buffers, the page cache of the files it writes or reads) take pages the
    host backs now, not pages it reclaimed (see `free_page_reporting`). Run before every timed
    operation, limits included, it puts each on the footing of a host without page reporting.
    """
    t = time.perf_counter()
    if nbytes > 0:
        block = np.ones(nbytes, np.uint8)
        del block
    trim_heap()
    return time.perf_counter() - t


# ------------------------------------------------------------------------- process accounting


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trim_heap() -> None:
    """Return the allocator's free pages to the kernel (glibc `malloc_trim`; no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def read_chars() -> int:
    """Bytes this process has read through read/pread calls (page cache included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


@contextlib.contextmanager
def accounting() -> Iterator[dict[str, float]]:
    """Measure an operation: wall seconds, peak RSS above the start, bytes read."""
    out: dict[str, float] = {}
    gc.collect()
    trim_heap()  # freed heap pages back to the kernel: new allocations show in the peak
    base, r0 = rss_bytes(), read_chars()
    harness.reset_peak_rss()
    t = time.perf_counter()
    yield out
    out["seconds"] = time.perf_counter() - t
    out["peak_above_start"] = max(0, harness.peak_rss() - base)
    out["read_bytes"] = read_chars() - r0
