"""Host buffers that devices can take over without a copy."""

from __future__ import annotations

import math
import mmap

import numpy as np

ALIGN = 64  # XLA:CPU places host buffers aligned to this without a copy
PREFAULT_MIN = 1 << 20  # with prefault, buffers this big are mapped with their pages populated


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, *, prefault: bool = False) -> np.ndarray:
    """An uninitialised array whose data starts on an ALIGN-byte boundary.

    TensorStore (or a copy) fills it and, on CPU, `jax.device_put` then uses it in place instead
    of copying: one copy of the restored bytes fewer, and no second allocation. With `prefault`,
    a buffer of PREFAULT_MIN bytes or more is a fresh anonymous mapping with its pages populated
    up front (page aligned), which is faster to fill than pages faulted in one by one.

    >>> a = aligned_empty((3, 5), np.dtype(np.float32))
    >>> a.shape, a.ctypes.data % ALIGN
    ((3, 5), 0)
    """
    n = math.prod(shape) * dtype.itemsize
    if prefault and n >= PREFAULT_MIN and hasattr(mmap, "MAP_POPULATE"):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        mm = mmap.mmap(-1, n, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return np.frombuffer(mm, np.uint8).view(dtype).reshape(shape)
    raw = np.empty(n + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + n].view(dtype).reshape(shape)
