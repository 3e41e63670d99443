"""Whole chunks read straight into their place in a strided buffer, each checked by its CRC32C.

A restore's target shard rarely holds a stored chunk as one run of bytes: its rows land apart.
Reading such a chunk into a per-thread buffer, checking it and copying it into place passes over
its bytes three times; `_scatter_read` (C, the GIL released) reads it with one `preadv` whose
iovecs are the rows' places and takes the CRC32C over those rows with the CPU's CRC instruction:
one pass, as a plain read makes. No library offers a CRC32C over scattered rows. For a
`sharding_indexed` shard, `Target.read_shard` does the whole shard in one call: its index (checked),
its inner chunks into place, and the trailers its fingerprint takes; the reading threads then hold
the interpreter lock for a few microseconds a shard, not for a loop over its chunks. Optional: where
the extension was not built, or the CPU has no CRC instruction, `target` says no and
format/direct.py reads through its buffer as before.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..util import config

_native: Any
try:
    from . import _scatter_read as _native
except ImportError:  # not built here (a source tree without a compiler): the buffered path
    _native = None


BOUNCE_BYTES = (1 << 20) + 64  # each reading thread's bounce buffer in the extension (its C twin)


def can_seal() -> bool:
    """`seal_chunks` is here: the extension is built (a build older than it lacks it).

    >>> isinstance(can_seal(), bool)
    True
    """
    return built() and hasattr(_native, "seal_chunks")


def seal_chunks(buf: Any, count: int, body: int, stride: int) -> bytes:
    """CRC32C trailers of `count` chunks of `body` bytes at `stride` in `buf`, written in place
    after each chunk and returned one after another (see `_scatter_read.seal_chunks`; `can_seal()`
    must be true).

    >>> b = bytearray(b"123456789" + bytes(4)); seal_chunks(b, 1, 9, 13).hex() if can_seal() else "839206e3"
    '839206e3'
    """
    return bytes(_native.seal_chunks(buf, count, body, stride))


def gather_chunks(data: np.ndarray, inner: Sequence[int], out: Any, stride: int) -> bool:
    """Lay `data` (one shard) out in `out` as its inner chunks of shape `inner`, chunk k at byte
    k * stride (C order inside each), walking `data` in its own order (see
    `_scatter_read.gather_chunks`). False, with nothing written, where the extension lacks it or
    `data` is not a view of plain memory with a contiguous last axis: the caller copies another way.

    >>> d = np.arange(8, dtype=np.int16).reshape(2, 4); out = bytearray(16)
    >>> gather_chunks(d, (2, 2), out, 8) and np.frombuffer(out, np.int16).tolist()
    [0, 1, 4, 5, 2, 3, 6, 7]
    """
    if not (built() and hasattr(_native, "gather_chunks")) or data.ndim == 0:
        return False
    if data.strides[-1] != data.itemsize or data.dtype.byteorder == ">":
        return False
    root = _root(data, writable=False)  # the source is read only: it may be a jax buffer's view
    if root is None:
        return False
    base = data.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    i64 = lambda v: np.asarray(v, np.int64)  # noqa: E731
    flat = root.reshape(-1).view(np.uint8)
    _native.gather_chunks(
        flat, base, i64(data.strides), i64(data.shape), i64(inner), data.itemsize, out, stride
    )
    return True


def built() -> bool:
    """The extension is built and runs its CRC32C in hardware (carry-less folding or the CPU's
    CRC instruction).

    >>> isinstance(built(), bool)
    True
    """
    return _native is not None and bool(_native.hardware())


def folds() -> bool:
    """The extension takes its CRC32C by carry-less folding here (its fastest way; tests may set
    another with `_scatter_read.crc_way`).

    >>> isinstance(folds(), bool)
    True
    """
    return _native is not None and hasattr(_native, "crc_way") and _native.crc_way(-1) == 2


def crc32c(buf: Any) -> int:
    """The CRC32C of a C-contiguous bytes-like object, the GIL released (`built()` must be true).

    >>> crc32c(b"123456789") == 0xE3069283 if built() else True
    True
    """
    return int(_native.crc32c(buf))


def _byte_bounds(a: np.ndarray) -> tuple[int, int]:
    """The first and one-past-the-last byte addresses `a` spans (numpy's byte_bounds moved)."""
    lo = hi = int(a.__array_interface__["data"][0])
    for n, st in zip(a.shape, a.strides):
        lo, hi = (lo + (n - 1) * st, hi) if st < 0 else (lo, hi + (n - 1) * st)
    return lo, hi + a.itemsize


def _root(a: np.ndarray, *, writable: bool = True) -> np.ndarray | None:
    """The C-contiguous array (writable, unless `writable` is False) whose memory `a` views, or
    None."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not (root.flags.c_contiguous and (root.flags.writeable or not writable)):
        return None
    lo, hi = _byte_bounds(a)
    rlo, rhi = _byte_bounds(root)
    return root if rlo <= lo and hi <= rhi else None


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the elements of a strided array lie in the plain buffer under it.

    Computed once per restored piece (`target`), then moved to each shard's part of it
    (`shifted`): the checks and the walk to the root buffer are not repeated for every shard.

    Attributes:
        root: the buffer's bytes (flat uint8, writable).
        base: byte offset in `root` of the array's first element.
        strides: the array's byte strides (int64; the last is the item size).
        steps: the same strides as Python ints.
    """

    root: np.ndarray
    base: int
    strides: np.ndarray
    steps: tuple[int, ...]

    def shifted(self, start: Sequence[int]) -> Target:
        """The target of the sub-array that starts at index `start` of this one."""
        base = self.base + sum(i * s for i, s in zip(start, self.steps))
        return Target(self.root, base, self.strides, self.steps)

    def read(
        self,
        fd: int,
        file_offsets: Any,
        starts: Any,
        chunk: Sequence[int],
        trailers: bytearray | None = None,
    ) -> bool:
        """Read whole chunks of shape `chunk` (raw C-order bytes, then a 4-byte crc32c) into
        this target.

        Args:
            fd: the open file.
            file_offsets: where each chunk's bytes start.
            starts: where each chunk goes (an index per axis, relative to this target; the
                chunk fits there).
            chunk: the chunk shape.
            trailers: 4 bytes per chunk; when given and every chunk matched, each chunk's
                trailer as read (in the order of `file_offsets`).

        Returns:
            True when every chunk was read whole and matched its crc32c; False otherwise (a
            read error, an early end of file, a checksum that disagrees): what is in the target
            is then not to be used, and the caller reads those chunks another way.
        """
        ndim = len(self.strides)
        assert len(chunk) == ndim
        dst_offsets = self.base + np.asarray(starts, np.int64).reshape(-1, ndim) @ self.strides
        bad, _err = _native.read_chunks(
            fd,
            self.root,
            np.ascontiguousarray(file_offsets, np.int64),
            np.ascontiguousarray(dst_offsets, np.int64),
            np.asarray(chunk[:-1], np.int64),
            np.ascontiguousarray(self.strides[:-1]),
            int(chunk[-1]) * int(self.strides[-1]),
            trailers,
        )
        return bool(bad < 0)

    def read_shard(
        self,
        fd: int,
        extent: tuple[int, int],
        grid: Sequence[int],
        inner: Sequence[int],
        lo: Sequence[int],
        hi: Sequence[int],
        origin: Sequence[int],
        want_listed: bool,
    ) -> tuple[bool, bytes | None, bytes | None]:
        """One `sharding_indexed` shard, read and checked in C with the GIL released: its index,
        then its inner chunks of grid indices [lo, hi) (each wholly inside this target) straight
        into their rows.

        Args:
            fd: the open file.
            extent: (offset, length) of the shard in it.
            grid: inner chunks per axis; inner: the inner chunk shape.
            lo, hi: the box of inner chunks to read, in grid indices.
            origin: the index, relative to this target, of the shard's first element (negative
                where the shard starts before it).
            want_listed: also return the trailers a fingerprint takes (format/integrity.py).

        Returns:
            (ok, index, listed): ok is False when the shard is not as expected (an index or
            chunk checksum, a missing or odd-sized chunk, a short read); index is the shard's
            index as read; listed the fingerprint's trailers (None: not taken, or a trailer
            lies outside the shard: take it the exact way).
        """
        base = self.base + sum(o * s for o, s in zip(origin, self.steps))
        return _native.read_shard(
            fd,
            extent[0],
            extent[1],
            np.asarray(grid, np.int64),
            np.asarray(inner, np.int64),
            self.steps[-1],
            np.asarray(lo, np.int64),
            np.asarray(hi, np.int64),
            self.root,
            base,
            self.strides,
            want_listed,
        )


def enabled() -> bool:
    """The extension is built and `UCP_SCATTER_READ` is not 0.

    >>> enabled() == (built() and config.scatter_read())
    True
    """
    return config.scatter_read() and built()


def target(out: np.ndarray, dtype: np.dtype, *, checked: bool = False) -> Target | None:
    """`out`'s Target when chunks of `dtype` can be read into it this way, else None: its last
    axis is contiguous, its memory is a plain writable array's, and `enabled()` (or `checked`:
    the caller has seen `enabled()` say yes, once for many targets).
    """
    if not (out.ndim > 0 and out.dtype == dtype and out.strides[-1] == dtype.itemsize):
        return None
    if not (checked or enabled()):
        return None
    root = _root(out)
    if root is None:
        return None
    base = out.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    st = tuple(out.strides)
    return Target(root.reshape(-1).view(np.uint8), base, np.asarray(st, np.int64), st)


def read_at(fd: int, offsets: Any, length: int) -> bytes | None:
    """`length` bytes from each of `offsets` of the file, joined; None when one read fails or
    the file ends first. One call, the GIL released, however many offsets.

    >>> import os, tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(b"abcdefgh"); f.flush()
    ...     read_at(f.fileno(), [6, 0], 2)
    b'ghab'
    """
    offs = np.ascontiguousarray(offsets, np.int64)
    out = bytearray(len(offs) * length)
    if _native is None:
        try:
            for k, o in enumerate(offs.tolist()):
                got = os.pread(fd, length, o)
                if len(got) != length:
                    return None
                out[k * length : (k + 1) * length] = got
        except OSError:
            return None
        return bytes(out)
    return bytes(out) if _native.read_at(fd, offs, length, out) else None
