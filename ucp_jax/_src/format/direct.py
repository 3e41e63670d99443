"""Local chunk reads straight into their place: positioned reads and a hardware CRC32C.

TensorStore reads a chunk of a local checkpoint into a buffer of its own, checks its crc32c with
absl's portable CRC (what `perf` shows the PyPI wheel running on this x86 VM), decodes it into
another buffer and copies that into the restore's: three passes over every byte where a plain read
makes one, which kept warm restores at a third of the machine's read limit. For the arrays ucp
writes itself (zarr3, raw little-endian bytes and a crc32c per chunk, inner chunks in a
`sharding_indexed` shard; `zarr_json.check_zarr_json` has already proved the zarr.json is that),
a restore from a local folder instead reads each shard directly: with the C extension
(format/scatter_read.py), one call per shard reads its index and every inner chunk that lies
wholly inside the target straight into its rows, each checked with the CPU's CRC instructions,
the GIL released; other chunks (cut by the target, or without the extension) are read with
`preadv` into a small per-thread buffer that stays in cache, checked (`crc32c`, released GIL)
and copied into place. The shard reads are handed to the reading threads in batches by
format/read_batches.py. Every check TensorStore makes is made here
too; anything this reader does not expect (an inline value, a missing inner chunk, a size or a
checksum that disagrees) sends that piece back through TensorStore, so a damaged checkpoint
raises the same errors as before and no value is ever taken from bytes that failed a check.

Where the bytes are: version 2, one file per shard; version 3, an OCDBT value (a byte range of a
data file), located by format/ocdbt_index.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import threading
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..util import config
from . import crc, scatter_read
from .integrity import fingerprint_of, fingerprint_range, tail_size, trailer_ends
from .manifest import SlotInfo
from .ocdbt_index import Extent, OcdbtIndex

__all__ = [
    "Extent",
    "Layout",
    "Mismatch",
    "OcdbtIndex",
    "OpenFiles",
    "available",
    "counts",
    "read_shard",
]

Box = Sequence[tuple[int, int]]

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


_counts_lock = threading.Lock()


def counts() -> dict[str, int]:
    """Shards this process read directly and through TensorStore, and the calls that read whole
    chunks straight into their rows (format/scatter_read.py), since it started.

    >>> sorted(counts())
    ['direct', 'fallback', 'scatter']
    """
    with _counts_lock:
        return dict(_counts)


def record(kind: str) -> None:
    """Count one shard read `kind` ("direct", "fallback") or one scattered-row read."""
    with _counts_lock:
        _counts[kind] += 1


_local = threading.local()


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


class OpenFiles:
    """Files opened once for a batch of shard reads and closed together after.

    A version-3 data file holds many shards; opening and closing it for each one cost two
    system calls per shard, each a hand-over of the interpreter lock between the reading threads.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        """The open descriptor of `path` (opened now if it is not yet), or raise Mismatch."""
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = _open(path)
        return fd

    def close(self) -> None:
        """Close every file opened."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


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
    return itertools.product(*(range(a // c, -(-b // c)) for (a, b), c in zip(box, chunks)))


def meet(a: Box, b: Box) -> list[tuple[int, int]]:
    """The intersection of two boxes (empty along an axis where stop <= start)."""
    return [(max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b)]


def region_index(box: Box, origin: Sequence[int]) -> tuple[Any, ...]:
    """Index of `box` in an array holding the region from `origin` (a view, 0-d included)."""
    return (*(slice(a - o, b - o) for (a, b), o in zip(box, origin)), Ellipsis)


class _Ask:
    """`read_shard`'s default `place`: work it out from `dst`."""


_ASK = _Ask()


def read_shard(
    ext: Extent,
    lay: Layout,
    index: tuple[int, ...],
    box: Box,
    dst: np.ndarray,
    dst_origin: Box,
    fingerprints: Fingerprints | None = None,
    files: OpenFiles | None = None,
    place: scatter_read.Target | _Ask | None = _ASK,
) -> None:
    """Read the part `box` (array coordinates, inside shard `index`) of one shard into `dst`.

    `dst` holds the region `dst_origin` of the array (its own axis order is the array's). With
    `fingerprints` (and `lay.info`), the shard's fingerprint (format/integrity.py) is recorded
    there too, from the index and trailers just read (those of inner chunks outside `box` are
    read for it). With `files`, the file is opened through it (and left open for the next
    shard); `place` is `scatter_read.target(dst, lay.dtype)` when the caller has it (None: the
    C reader is off or cannot write into `dst`).

    Raises:
        Mismatch: the shard is not as expected (size, index, a checksum): read it another way.
    """
    origin = [i * c for i, c in zip(index, lay.chunks)]
    start = [a - o for (a, _), (o, _) in zip(box, dst_origin)]
    out = dst[region_index(box, [a for a, _ in dst_origin])]
    if ext.inline is not None:
        n = math.prod(lay.chunks) * lay.dtype.itemsize
        if lay.inner is not None or len(ext.inline) != n + 4:
            raise Mismatch("an inline value of another size")
        raw = np.frombuffer(ext.inline, np.uint8)
        if not crc.matches(raw[:n], ext.inline[n:]):
            raise Mismatch("crc32c")
        out[...] = raw[:n].view(lay.dtype).reshape(lay.chunks)[region_index(box, origin)]
        return
    fd = _open(ext.path) if files is None else files.fd(ext.path)
    try:
        where = (ext.path, ext.offset)
        want = fingerprints is not None and lay.info is not None and where not in fingerprints
        if lay.inner is None:
            tail = _read_chunk(fd, ext.offset, ext.length, lay.chunks, lay.dtype, origin, box, out)
            # an unsharded chunk's fingerprint is that of its trailer alone
            info = lay.info if want else None
            fp = None if info is None else fingerprint_of(tail, ext.length, info, lambda end: b"")
        else:
            if isinstance(place, _Ask):
                place = scatter_read.target(dst, lay.dtype)
            into = None if place is None else place.shifted(start)
            fp = _read_sharded(fd, ext, lay, origin, box, out, into, want)
        if want:
            assert fingerprints is not None and fp is not None
            fingerprints[where] = fp
    finally:
        if files is None:
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
) -> bytes:
    """One chunk (raw bytes + crc32c) at `offset`: its part `box` into `out`; returns its
    crc32c trailer, as read and checked."""
    n = math.prod(shape) * dtype.itemsize
    if length != n + 4:
        raise Mismatch(f"a chunk of {length} bytes, {n + 4} expected")
    whole = all(a == o and b == o + s for (a, b), o, s in zip(box, origin, shape))
    if whole and out.flags.c_contiguous and out.dtype == dtype:
        trailer = bytearray(4)
        _read_exact(fd, [_bytes_of(out), memoryview(trailer)], offset)
        if not crc.matches(out.reshape(-1).view(np.uint8), trailer):
            raise Mismatch("crc32c")
        return bytes(trailer)
    into = scatter_read.target(out, dtype) if whole else None
    if into is not None:
        trailer = bytearray(4)
        if not into.read(fd, [offset], [[0] * len(shape)], shape, trailer):
            raise Mismatch("a chunk's read or crc32c")
        record("scatter")
        return bytes(trailer)
    buf = _scratch(n + 4)
    _read_exact(fd, [_bytes_of(buf)], offset)
    if not crc.matches(buf[:n], buf[n:]):
        raise Mismatch("crc32c")
    out[...] = buf[:n].view(dtype).reshape(shape)[region_index(box, origin)]
    return buf[n:].tobytes()


def _read_sharded(
    fd: int,
    ext: Extent,
    lay: Layout,
    origin: Sequence[int],
    box: Box,
    out: np.ndarray,
    into: scatter_read.Target | None,
    want_fingerprint: bool,
) -> str | None:
    """A `sharding_indexed` shard: its index (at the end), then the inner chunks `box` meets.

    With `into` (out's Target: the C extension is there and out's rows are contiguous), one C
    call reads the index and every inner chunk wholly inside `box` straight into its rows, the
    GIL released (a model's tree is ~1400 shards of a few inner chunks: per-chunk Python was
    most of what the reading threads held the lock for). The inner chunks `box` only cuts, and
    every chunk without `into`, go through this thread's buffer. Returns the shard's fingerprint
    (with `want_fingerprint`), from the index and the trailers just read.
    """
    assert lay.inner is not None
    grid = [c // i for c, i in zip(lay.chunks, lay.inner)]
    if any(c % i for c, i in zip(lay.chunks, lay.inner)):
        raise Mismatch("inner chunks do not divide the shard")
    count = math.prod(grid)
    if ext.length < count * 16 + 4:
        raise Mismatch("shard smaller than its index")
    rel = [a - o for (a, _), o in zip(box, origin)]  # where box starts in the shard
    meets = [
        range(r // i, -(-(b - o) // i)) for r, (_, b), o, i in zip(rel, box, origin, lay.inner)
    ]
    whole: tuple[list[int], list[int]] | None = None  # the grid box the C reader took
    listed: bytes | None = None
    if into is not None:
        lo = [-(-r // i) for r, i in zip(rel, lay.inner)]
        hi = [max((b - o) // i, k) for (_, b), o, i, k in zip(box, origin, lay.inner, lo)]
        ok, got, listed = into.read_shard(
            fd, (ext.offset, ext.length), grid, lay.inner, lo, hi, [-r for r in rel],
            want_fingerprint,
        )  # fmt: skip
        if not ok or got is None:
            raise Mismatch("the shard's index, an inner chunk or a crc32c")
        raw: bytes | bytearray = got
        if all(h > k for k, h in zip(lo, hi)):
            record("scatter")
        whole = (lo, hi)
    else:
        raw = bytearray(count * 16 + 4)
        _read_exact(fd, [memoryview(raw)], ext.offset + ext.length - len(raw))
        if not crc.matches(memoryview(raw)[:-4], raw[-4:]):
            raise Mismatch("shard index crc32c")
    table: list[int] | None = None  # offset, nbytes, offset, ...: parsed when needed
    trailers: dict[int, bytes] = {}  # end offset of an inner chunk read here -> its trailer
    todo: list[tuple[int, list[tuple[int, int]]]] = []  # (offset in the shard, inner box)
    step = math.prod(lay.inner) * lay.dtype.itemsize + 4
    data_end = ext.length - len(raw)
    took_all = whole is not None and all(
        k == m.start and h == m.stop for m, k, h in zip(meets, *whole)
    )  # the C reader took every inner chunk the box meets: nothing left to look at
    for idx in () if took_all else itertools.product(*meets):
        if whole is not None and all(k <= j < h for j, k, h in zip(idx, *whole)):
            continue  # read by the C reader
        if table is None:
            table = np.frombuffer(raw, "<u8", count * 2).tolist()
        flat = 0
        for k, g in zip(idx, grid):
            flat = flat * g + k
        off, nbytes = table[2 * flat], table[2 * flat + 1]
        if off == _NO_CHUNK or nbytes != step or off + nbytes > data_end:
            raise Mismatch("inner chunk missing or of another size")
        ibox = [(o + k * i, o + (k + 1) * i) for o, k, i in zip(origin, idx, lay.inner)]
        todo.append((off, ibox))
    todo.sort(key=lambda t: t[0])
    _read_buffered(fd, ext, lay, box, out, todo, trailers)
    if not want_fingerprint:
        return None
    assert lay.info is not None
    if listed is not None:
        return f"{zlib.crc32(listed, zlib.crc32(raw)):08x}"
    if into is not None:  # a trailer outside the shard: the exact way says what it is
        return fingerprint_range(fd, ext.offset, ext.length, lay.info)
    return _shard_fingerprint(fd, ext, lay.info, bytes(raw), trailers)


def _read_buffered(
    fd: int,
    ext: Extent,
    lay: Layout,
    box: Box,
    out: np.ndarray,
    todo: list[tuple[int, list[tuple[int, int]]]],
    trailers: dict[int, bytes],
) -> None:
    """Inner chunks (offset in the shard, inner box; by offset) read through this thread's
    buffer, runs of adjacent ones at once, each checked, then their part inside `box` copied
    into `out`; each leaves its trailer in `trailers`, keyed by the chunk's end offset."""
    assert lay.inner is not None
    inner_bytes = math.prod(lay.inner) * lay.dtype.itemsize
    step = inner_bytes + 4
    box_origin = [a for a, _ in box]
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
            off, ibox = todo[k]
            trailers[off + step] = chunk[inner_bytes:].tobytes()
            part = meet(ibox, box)
            src = chunk[:inner_bytes].view(lay.dtype).reshape(lay.inner)
            out[region_index(part, box_origin)] = src[region_index(part, [a for a, _ in ibox])]
        i = j


def _shard_fingerprint(
    fd: int, ext: Extent, info: SlotInfo, tail: bytes, trailers: dict[int, bytes]
) -> str:
    """`integrity.fingerprint_range`'s value for a shard whose index (`tail`) and some inner
    chunks' `trailers` (by end offset) were just read: the other trailers are read here, in one
    call, and `integrity.fingerprint_of` takes them all."""
    if len(tail) != tail_size(info):
        return fingerprint_range(fd, ext.offset, ext.length, info)
    missing = [e for e in trailer_ends(tail, info) if e not in trailers and e <= ext.length]
    if missing:
        got = scatter_read.read_at(fd, [ext.offset + e - 4 for e in missing], 4)
        if got is None:
            return fingerprint_range(fd, ext.offset, ext.length, info)
        trailers = trailers | {e: got[4 * n : 4 * n + 4] for n, e in enumerate(missing)}
    return fingerprint_of(tail, ext.length, info, trailers.__getitem__)
