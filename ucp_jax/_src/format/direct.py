"""Local chunk reads straight into their place: positioned reads and a hardware CRC32C.

TensorStore reads a chunk of a local checkpoint into a buffer of its own, checks its crc32c with
absl's portable CRC (what `perf` shows the PyPI wheel running on this x86 VM), decodes it into
another buffer and copies that into the restore's: three passes over every byte where a plain read
makes one, which kept warm restores at a third of the machine's read limit. For the arrays ucp
writes itself (zarr3, raw little-endian bytes and a crc32c per chunk, inner chunks in a
`sharding_indexed` shard; `checkpoint._check_metadata` has already proved the zarr.json is that),
a restore from a local folder instead reads each shard's byte ranges with `preadv` (into the
restore buffer itself where the chunk is a contiguous part of it, else into a small per-thread
buffer that stays in cache), checks every chunk's crc32c with the CPU's CRC instructions
(`crc32c`, released GIL), and copies it into place. Every check TensorStore makes is made here
too; anything this reader does not expect (an inline value, a missing inner chunk, a size or a
checksum that disagrees) sends that piece back through TensorStore, so a damaged checkpoint
raises the same errors as before and no value is ever taken from bytes that failed a check.

Where the bytes are: version 2, one file per shard; version 3, an OCDBT value (a byte range of a
data file), located by format/ocdbt_index.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..util import config
from . import crc, scatter_read
from .integrity import fingerprint_range
from .manifest import SlotInfo
from .ocdbt_index import Extent, OcdbtIndex

__all__ = ["Batcher", "Extent", "Layout", "OcdbtIndex", "Pieces", "available", "counts"]

Box = Sequence[tuple[int, int]]

# positioned reads in flight: two per core, 2 to 8 (the roofline's plain read limit uses 4)
_THREADS = max(2, min(8, 2 * (os.cpu_count() or 1)))
_SCRATCH = 4 << 20  # bytes of one thread's buffer: runs of inner chunks are read this much at once
_NO_CHUNK = (1 << 64) - 1  # a shard index entry of an inner chunk that was never written


class Mismatch(Exception):
    """The bytes are not laid out as this reader expects; TensorStore reads the piece instead."""


def available() -> bool:
    """This host reads ucp's chunks directly: a hardware CRC32C, little-endian memory, positioned
    reads (not on Windows), and `UCP_DIRECT_READ` is not 0."""
    return config.direct_read() and crc.hardware() and hasattr(os, "preadv")


# shards read by this reader / sent to TensorStore; calls that read chunks into scattered rows
_counts = {"direct": 0, "fallback": 0, "scatter": 0}


def counts() -> dict[str, int]:
    """Shards this process read directly and through TensorStore, and the calls that read whole
    chunks straight into their rows (format/scatter_read.py), since it started.

    >>> sorted(counts())
    ['direct', 'fallback', 'scatter']
    """
    with _pool_lock:
        return dict(_counts)


def _count(kind: str) -> None:
    with _pool_lock:
        _counts[kind] += 1


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_local = threading.local()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="ucp-read")
        return _pool


def _scratch(n: int) -> np.ndarray:
    """This thread's reusable read buffer of at least `n` bytes."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.nbytes < n:
        buf = np.empty(max(n, _SCRATCH), np.uint8)
        _local.buf = buf
    return buf[:n]


def _bytes_of(a: np.ndarray) -> memoryview:
    """A writable byte view of a C-contiguous array."""
    return memoryview(a.reshape(-1).view(np.uint8).data)


def _read_exact(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill `views` from `offset` of `fd`, or raise Mismatch at the end of the file."""
    while views:
        got = os.preadv(fd, views, offset)
        if got <= 0:
            raise Mismatch("file ends early")
        offset += got
        while views and got >= views[0].nbytes:
            got -= views[0].nbytes
            views.pop(0)
        if got:
            views[0] = views[0][got:]


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise Mismatch(f"cannot open {path}: {e}") from e


# ---------------------------------------------------------------- reading one shard


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one stored array is cut: shape, shard shape, inner chunk shape (None: one chunk)."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    inner: tuple[int, ...] | None
    dtype: np.dtype
    info: SlotInfo | None = None  # with it, each shard read is also fingerprinted


Fingerprints = dict[tuple[str, int], str]  # (file, offset) of a shard -> its fingerprint


def shards_in(box: Box, chunks: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Grid indices of the shards that meet `box`.

    >>> list(shards_in([(0, 3), (2, 4)], (2, 4)))
    [(0, 0), (1, 0)]
    """
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, chunks)]
    yield from _product(ranges)


def _product(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


def _meet(a: Box, b: Box) -> list[tuple[int, int]]:
    return [(max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b)]


def _rel(box: Box, origin: Sequence[int]) -> tuple[Any, ...]:
    """Index of `box` in an array holding the region from `origin` (a view, 0-d included)."""
    return (*(slice(a - o, b - o) for (a, b), o in zip(box, origin)), Ellipsis)


def read_shard(
    ext: Extent,
    lay: Layout,
    index: tuple[int, ...],
    box: Box,
    dst: np.ndarray,
    dst_origin: Box,
    fingerprints: Fingerprints | None = None,
) -> None:
    """Read the part `box` (array coordinates, inside shard `index`) of one shard into `dst`.

    `dst` holds the region `dst_origin` of the array (its own axis order is the array's). With
    `fingerprints` (and `lay.info`), the shard's fingerprint (format/integrity.py) is recorded
    there too, from the same open file while its pages are hot.

    Raises:
        Mismatch: the shard is not as expected (size, index, a checksum): read it another way.
    """
    origin = [i * c for i, c in zip(index, lay.chunks)]
    out = dst[_rel(box, [a for a, _ in dst_origin])]
    if ext.inline is not None:
        n = math.prod(lay.chunks) * lay.dtype.itemsize
        if lay.inner is not None or len(ext.inline) != n + 4:
            raise Mismatch("an inline value of another size")
        raw = np.frombuffer(ext.inline, np.uint8)
        if not crc.matches(raw[:n], ext.inline[n:]):
            raise Mismatch("crc32c")
        out[...] = raw[:n].view(lay.dtype).reshape(lay.chunks)[_rel(box, origin)]
        return
    fd = _open(ext.path)
    try:
        if lay.inner is None:
            _read_chunk(fd, ext.offset, ext.length, lay.chunks, lay.dtype, origin, box, out)
        else:
            _read_sharded(fd, ext, lay, origin, box, out)
        where = (ext.path, ext.offset)
        if fingerprints is not None and lay.info is not None and where not in fingerprints:
            fingerprints[where] = fingerprint_range(fd, ext.offset, ext.length, lay.info)
    finally:
        os.close(fd)


def _read_chunk(
    fd: int,
    offset: int,
    length: int,
    shape: Sequence[int],
    dtype: np.dtype,
    origin: Sequence[int],
    box: Box,
    out: np.ndarray,
) -> None:
    """One chunk (raw bytes + crc32c) at `offset`: its part `box` into `out`."""
    n = math.prod(shape) * dtype.itemsize
    if length != n + 4:
        raise Mismatch(f"a chunk of {length} bytes, {n + 4} expected")
    whole = all(a == o and b == o + s for (a, b), o, s in zip(box, origin, shape))
    if whole and out.flags.c_contiguous and out.dtype == dtype:
        trailer = bytearray(4)
        _read_exact(fd, [_bytes_of(out), memoryview(trailer)], offset)
        if not crc.matches(out.reshape(-1).view(np.uint8), trailer):
            raise Mismatch("crc32c")
        return
    if whole and scatter_read.usable(out, dtype):
        if not scatter_read.read_whole(fd, [offset], [[0] * len(shape)], shape, out):
            raise Mismatch("a chunk's read or crc32c")
        _count("scatter")
        return
    buf = _scratch(n + 4)
    _read_exact(fd, [_bytes_of(buf)], offset)
    if not crc.matches(buf[:n], buf[n:]):
        raise Mismatch("crc32c")
    out[...] = buf[:n].view(dtype).reshape(shape)[_rel(box, origin)]


def _read_sharded(
    fd: int, ext: Extent, lay: Layout, origin: Sequence[int], box: Box, out: np.ndarray
) -> None:
    """A `sharding_indexed` shard: its index (at the end), then the inner chunks `box` meets."""
    assert lay.inner is not None
    grid = [c // i for c, i in zip(lay.chunks, lay.inner)]
    if any(c % i for c, i in zip(lay.chunks, lay.inner)):
        raise Mismatch("inner chunks do not divide the shard")
    count = math.prod(grid)
    index_bytes = count * 16 + 4
    if ext.length < index_bytes:
        raise Mismatch("shard smaller than its index")
    raw = bytearray(index_bytes)
    _read_exact(fd, [memoryview(raw)], ext.offset + ext.length - index_bytes)
    if not crc.matches(memoryview(raw)[:-4], raw[-4:]):
        raise Mismatch("shard index crc32c")
    table = np.frombuffer(raw, "<u8", count * 2).reshape(count, 2)
    inner_bytes = math.prod(lay.inner) * lay.dtype.itemsize
    data_end = ext.length - index_bytes
    box_origin = [a for a, _ in box]
    ranges = [range((a - o) // i, -(-(b - o) // i)) for (a, b), o, i in zip(box, origin, lay.inner)]
    todo = []  # (offset in shard, inner box)
    for idx in _product(ranges):
        flat = 0
        for k, g in zip(idx, grid):
            flat = flat * g + k
        off, nbytes = int(table[flat, 0]), int(table[flat, 1])
        if off == _NO_CHUNK or nbytes != inner_bytes + 4 or off + nbytes > data_end:
            raise Mismatch("inner chunk missing or of another size")
        ibox = [(o + k * i, o + (k + 1) * i) for o, k, i in zip(origin, idx, lay.inner)]
        todo.append((off, ibox))
    todo.sort(key=lambda t: t[0])
    if scatter_read.usable(out, lay.dtype):  # whole inner chunks: straight into their rows
        inside: list[tuple[int, list[tuple[int, int]]]] = []
        partial: list[tuple[int, list[tuple[int, int]]]] = []
        for t in todo:
            whole = all(b0 <= a and b <= b1 for (a, b), (b0, b1) in zip(t[1], box))
            (inside if whole else partial).append(t)
        if inside:
            starts = [[a - o for (a, _), o in zip(t[1], box_origin)] for t in inside]
            offsets = [ext.offset + t[0] for t in inside]
            if not scatter_read.read_whole(fd, offsets, starts, lay.inner, out):
                raise Mismatch("an inner chunk's read or crc32c")
            _count("scatter")
        todo = partial
    step = inner_bytes + 4
    per_run = max(_SCRATCH // step, 1)
    i = 0
    while i < len(todo):
        j = i + 1
        while j < len(todo) and j - i < per_run and todo[j][0] == todo[j - 1][0] + step:
            j += 1
        buf = _scratch((j - i) * step)
        _read_exact(fd, [_bytes_of(buf)], ext.offset + todo[i][0])
        for k in range(i, j):
            chunk = buf[(k - i) * step : (k - i + 1) * step]
            if not crc.matches(chunk[:inner_bytes], chunk[inner_bytes:]):
                raise Mismatch("crc32c")
            ibox = todo[k][1]
            part = _meet(ibox, box)
            src = chunk[:inner_bytes].view(lay.dtype).reshape(lay.inner)
            out[_rel(part, box_origin)] = src[_rel(part, [a for a, _ in ibox])]
        i = j


BATCH_BYTES = 8 << 20  # shard reads handed to a thread together: fewer wake-ups per byte


@dataclasses.dataclass
class _Job:
    """One shard's part to read; `error` is what reading it raised."""

    args: tuple[Any, ...]
    nbytes: int
    error: BaseException | None = None


@dataclasses.dataclass
class _Batch:
    jobs: list[_Job] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    future: Future[None] | None = None


def _run(batch: _Batch) -> None:
    for job in batch.jobs:
        try:
            _one(*job.args)
        except BaseException as e:  # raised where that piece is waited for
            job.error = e


class Pieces:
    """The shard reads of one restored piece, waited for together; a shard this reader could
    not take is read by `fallback(box)` (TensorStore) in its place."""

    def __init__(self, batcher: Batcher, jobs: list[tuple[_Batch, _Job]]) -> None:
        self.batcher, self.jobs = batcher, jobs

    def result(self) -> None:
        """Wait for every shard of the piece; raise the first error one of them raised."""
        if any(b.future is None for b, _ in self.jobs):
            self.batcher.flush()
        for b, job in self.jobs:
            assert b.future is not None
            b.future.result()
            if job.error is not None:
                raise job.error


class Batcher:
    """Hands shard reads to the reading threads in batches of about BATCH_BYTES.

    Small shards (a model's many small arrays) each cost a thread hand-off otherwise, which took
    more CPU than copying their bytes. Used from one thread (the restore's); `Pieces.result`
    flushes what is still pending.
    """

    def __init__(self) -> None:
        self._open = _Batch()

    def submit(
        self,
        locate: Callable[[tuple[int, ...]], Extent | None],
        lay: Layout,
        box: Box,
        dst: np.ndarray,
        fallback: Callable[[Box, np.ndarray], None],
        fingerprints: Fingerprints | None = None,
    ) -> Pieces:
        """Read the region `box` of a stored array into `dst` (shaped as `box`), shard by shard.

        Args:
            locate: the Extent of the shard at a grid index (None: read it by `fallback`).
            lay: the stored array's layout.
            box: the region, (start, stop) per axis.
            dst: the buffer it goes into, in the array's axis order.
            fallback: reads a sub-box into its part of `dst` another way (TensorStore); it
                raises the error a damaged file deserves.
            fingerprints: where each shard read directly records its fingerprint.

        Returns:
            The pending reads; `.result()` waits for them and raises what a fallback raised.
        """
        jobs = []
        for index in shards_in(box, lay.chunks):
            sbox = [(i * c, (i + 1) * c) for i, c in zip(index, lay.chunks)]
            part = _meet(sbox, box)
            if any(a >= b for a, b in part):
                continue
            nbytes = math.prod(b - a for a, b in part) * lay.dtype.itemsize
            job = _Job((locate, lay, index, part, dst, box, fallback, fingerprints), nbytes)
            self._open.jobs.append(job)
            self._open.nbytes += nbytes
            jobs.append((self._open, job))
            if self._open.nbytes >= BATCH_BYTES:
                self.flush()
        return Pieces(self, jobs)

    def flush(self) -> None:
        """Start the pending reads."""
        if self._open.jobs:
            self._open.future = _executor().submit(_run, self._open)
            self._open = _Batch()


def _one(
    locate: Callable[[tuple[int, ...]], Extent | None],
    lay: Layout,
    index: tuple[int, ...],
    part: Box,
    dst: np.ndarray,
    box: Box,
    fallback: Callable[[Box, np.ndarray], None],
    fingerprints: Fingerprints | None,
) -> None:
    ext = locate(index)
    if ext is not None:
        try:
            read_shard(ext, lay, index, part, dst, box, fingerprints)
            _count("direct")
            return
        except Mismatch:
            pass  # TensorStore reads it: the same bytes, its checks, its errors
    _count("fallback")
    fallback(part, dst[_rel(part, [a for a, _ in box])])
