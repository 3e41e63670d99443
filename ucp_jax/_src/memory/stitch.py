"""Zero-copy assembly: byte ranges of snapshot files mapped back to back into one array.

A shard whose slabs sit in different blobs (no redundancy: each data-parallel replica kept one
slab; or a restore that reads a slab from each of two nodes) would otherwise be copied into fresh
memory. When every slab starts on a page boundary of its file and all but the last are whole
pages, the slabs are mapped read-only, in order, into one reserved virtual range
(`mmap(MAP_FIXED)`): the shard is one contiguous array and nothing is copied. The range is
unmapped when the last array using it is gone.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..util.libc import libc

PAGE = mmap.PAGESIZE
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


@functools.cache
def _lib() -> Any:
    """libc with mmap/munmap typed, or None where there is none (then: no stitching)."""
    lib = libc()
    if lib is None or not hasattr(lib, "mmap") or not hasattr(lib, "munmap"):
        return None
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_int, ctypes.c_int, ctypes.c_long]  # fmt: skip
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


def can_stitch(parts: Sequence[tuple[Path, int, int]]) -> bool:
    """Whether (file, offset, nbytes) ranges can be mapped back to back (page-aligned starts,
    whole pages but for the last)."""
    return (
        os.name == "posix"
        and len(parts) > 1
        and all(off % PAGE == 0 for _, off, _ in parts)
        and all(n % PAGE == 0 and n > 0 for _, _, n in parts[:-1])
        and _lib() is not None
    )


def stitch(parts: Sequence[tuple[Path, int, int]]) -> np.ndarray:
    """The ranges (file, offset, nbytes), in order, as one read-only uint8 array (no copy).

    >>> arr = stitch([(a, 0, 4096), (b, 8192, 100)])  # doctest: +SKIP

    Raises:
        OSError: a file cannot be opened or mapped.
    """
    lib = _lib()
    total = sum(n for _, _, n in parts)
    span = -(-total // PAGE) * PAGE
    none = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    base = lib.mmap(None, span, 0, none, -1, 0)  # PROT_NONE: reserved, nothing mapped
    if base in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"cannot reserve {span} bytes of address space")
    try:
        pos = 0
        for path, off, n in parts:
            fd = os.open(path, os.O_RDONLY)
            try:
                flags = mmap.MAP_SHARED | _MAP_FIXED | getattr(mmap, "MAP_POPULATE", 0)
                length = -(-n // PAGE) * PAGE
                got = lib.mmap(base + pos, length, mmap.PROT_READ, flags, fd, off)
            finally:
                os.close(fd)
            if got != base + pos:
                raise OSError(ctypes.get_errno(), f"cannot map {n} bytes at {off} of {path}")
            pos += n
    except BaseException:
        lib.munmap(base, span)
        raise
    raw = (ctypes.c_ubyte * total).from_address(base)
    weakref.finalize(raw, lib.munmap, base, span)  # every view of it keeps `raw` alive
    arr = np.frombuffer(memoryview(raw), np.uint8)
    arr.flags.writeable = False  # the pages are mapped read-only
    return arr
