"""Whole chunks read straight into their place in a strided buffer, each checked by its CRC32C.

A restore's target shard rarely holds a stored chunk as one run of bytes: its rows land apart.
Reading such a chunk into a per-thread buffer, checking it and copying it into place passes over
its bytes three times; `_scatter_read` (C, the GIL released) reads it with one `preadv` whose
iovecs are the rows' places and takes the CRC32C over those rows with the CPU's CRC instruction:
one pass, as a plain read makes. No library offers a CRC32C over scattered rows. Optional: where
the extension was not built, or the CPU has no CRC instruction, `usable` says no and
format/direct.py reads through its buffer as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..util import config

_native: Any
try:
    from . import _scatter_read as _native
except ImportError:  # not built here (a source tree without a compiler): the buffered path
    _native = None


def built() -> bool:
    """The extension is built and runs its CRC32C on the CPU's CRC instruction.

    >>> isinstance(built(), bool)
    True
    """
    return _native is not None and bool(_native.hardware())


def _byte_bounds(a: np.ndarray) -> tuple[int, int]:
    """The first and one-past-the-last byte addresses `a` spans (numpy's byte_bounds moved)."""
    lo = hi = int(a.__array_interface__["data"][0])
    for n, st in zip(a.shape, a.strides):
        lo, hi = (lo + (n - 1) * st, hi) if st < 0 else (lo, hi + (n - 1) * st)
    return lo, hi + a.itemsize


def _root(a: np.ndarray) -> np.ndarray | None:
    """The C-contiguous, writable array whose memory `a` views, or None."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not (root.flags.c_contiguous and root.flags.writeable):
        return None
    lo, hi = _byte_bounds(a)
    rlo, rhi = _byte_bounds(root)
    return root if rlo <= lo and hi <= rhi else None


def usable(out: np.ndarray, dtype: np.dtype) -> bool:
    """Chunks of `dtype` can be read into `out` this way: its last axis is contiguous, its
    memory is a plain writable array's, and `UCP_SCATTER_READ` is not 0."""
    return (
        out.ndim > 0
        and out.dtype == dtype
        and out.strides[-1] == dtype.itemsize
        and config.scatter_read()
        and built()
        and _root(out) is not None
    )


def read_whole(
    fd: int,
    file_offsets: Sequence[int],
    starts: Sequence[Sequence[int]],
    chunk: Sequence[int],
    out: np.ndarray,
) -> bool:
    """Read whole chunks of shape `chunk` (raw C-order bytes, then a 4-byte crc32c) into `out`.

    Args:
        fd: the open file.
        file_offsets: where each chunk's bytes start.
        starts: where each chunk goes in `out` (an index per axis; the chunk fits there).
        chunk: the chunk shape.
        out: where they go; `usable(out, ...)` said yes.

    Returns:
        True when every chunk was read whole and matched its crc32c; False otherwise (a read
        error, an early end of file, a checksum that disagrees): what is in `out` is then not to
        be used, and the caller reads those chunks another way.
    """
    root = _root(out)
    assert root is not None and out.ndim == len(chunk)
    base = out.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    st = np.asarray(out.strides, np.int64)
    dst_offsets = base + np.asarray(starts, np.int64).reshape(-1, out.ndim) @ st
    bad, _err = _native.read_chunks(
        fd,
        root.reshape(-1).view(np.uint8),
        np.ascontiguousarray(file_offsets, np.int64),
        np.ascontiguousarray(dst_offsets, np.int64),
        np.asarray(chunk[:-1], np.int64),
        np.ascontiguousarray(st[:-1]),
        int(chunk[-1]) * out.dtype.itemsize,
    )
    return bool(bad < 0)
