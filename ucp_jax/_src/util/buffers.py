"""Host buffers that devices can take over without a copy.

A buffer a restore fills is fresh memory: every 4 KiB page of it faults in on first write (a
trap, a page allocated, zeroed and charged), and on a 2-core VM that cost more than the copy
itself (92k faults, over half the CPU of a 0.38 GB restore). A large buffer is therefore its own
anonymous mapping on a huge-page boundary, its whole 2 MiB pages advised to be transparent huge
pages (`MADV_HUGEPAGE`): one fault per 2 MiB; the part past the last whole huge page keeps 4 KiB
pages, so nothing is allocated beyond the buffer. A leaf's shards share one such mapping, and so
do consecutive leaves each smaller than a huge page (at most PACK_BYTES together). Below one huge
page, where the kernel offers no transparent huge pages, or with `UCP_HUGE_PAGES=0`, it is an
ordinary allocation.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
from collections.abc import Sequence

import numpy as np

from . import config

ALIGN = 64  # XLA:CPU places host buffers aligned to this without a copy
PREFAULT_MIN = 1 << 20  # with prefault, buffers this big are mapped with their pages populated
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages): a PMD-mapped transparent huge page
PACK_BYTES = 8 << 20  # the most that small leaves sharing one huge-page mapping hold together
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault in a range's pages, writable, in one call


@functools.lru_cache(maxsize=1)
def transparent_huge_pages() -> bool:
    """The kernel maps `MADV_HUGEPAGE` regions with huge pages (mode `always` or `madvise`).

    >>> isinstance(transparent_huge_pages(), bool)
    True
    """
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_page_bytes(nbytes: int) -> int:
    """How much of a buffer of `nbytes` lies on whole huge pages (0: too small for one).

    >>> huge_page_bytes(4 << 20), huge_page_bytes(3_936_256), huge_page_bytes(1 << 20)
    (4194304, 2097152, 0)
    """
    return nbytes // HUGE_PAGE * HUGE_PAGE


def _huge_pages_on() -> bool:
    return config.huge_pages() and transparent_huge_pages()


def _huge_mapping(nbytes: int, *, prefault: bool = False) -> np.ndarray:
    """`nbytes` of a fresh anonymous mapping whose whole huge pages are advised to be transparent
    huge pages; with `prefault` every page is populated.

    The mapping's length is a multiple of HUGE_PAGE, which Linux 6.7 and later place on a huge
    page boundary; elsewhere the advice covers the whole huge pages inside the buffer. Past the
    buffer's end nothing is advised, so nothing is allocated there.
    """
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
    whole = np.frombuffer(mm, np.uint8)
    first = -whole.ctypes.data % HUGE_PAGE  # 0 where the kernel aligned the mapping
    advised = huge_page_bytes(max(0, nbytes - first))
    if advised:
        mm.madvise(mmap.MADV_HUGEPAGE, first, advised)
    if prefault:
        # before Linux 5.14 there is no populate: the pages fault in as they are filled
        with contextlib.suppress(OSError):
            mm.madvise(_MADV_POPULATE_WRITE, 0, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    return whole[:nbytes]


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, *, prefault: bool = False) -> np.ndarray:
    """An uninitialised array whose data starts on an ALIGN-byte boundary.

    TensorStore (or a copy) fills it and, on CPU, `jax.device_put` then uses it in place instead
    of copying: one copy of the restored bytes fewer, and no second allocation. A large buffer
    is mapped on transparent huge pages where the kernel offers them (see the module's doc).
    With `prefault`, a buffer of PREFAULT_MIN bytes or more is a fresh anonymous mapping with its
    pages populated up front (page aligned; on huge pages where it is large enough), which is
    faster to fill than pages faulted in one by one.

    >>> a = aligned_empty((3, 5), np.dtype(np.float32))
    >>> a.shape, a.ctypes.data % ALIGN
    ((3, 5), 0)
    >>> b = aligned_empty((1024, 1024), np.dtype(np.float32))
    >>> b.nbytes, b.ctypes.data % ALIGN, b.flags.writeable
    (4194304, 0, True)
    """
    n = math.prod(shape) * dtype.itemsize
    if huge_page_bytes(n) and _huge_pages_on():
        return _huge_mapping(n, prefault=prefault).view(dtype).reshape(shape)
    if prefault and n >= PREFAULT_MIN and hasattr(mmap, "MAP_POPULATE"):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        mm = mmap.mmap(-1, n, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return np.frombuffer(mm, np.uint8).view(dtype).reshape(shape)
    raw = np.empty(n + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + n].view(dtype).reshape(shape)


def aligned_bytes(shapes: Sequence[tuple[int, ...]], dtype: np.dtype) -> int:
    """Bytes that arrays of `shapes` take carved one after another, each on an ALIGN boundary.

    >>> aligned_bytes([(3, 5), (256, 1024)], np.dtype(np.float32))
    1048640
    """
    return sum(-(-math.prod(s) * dtype.itemsize // ALIGN) * ALIGN for s in shapes)


def _carve(
    whole: np.ndarray, shapes: Sequence[tuple[int, ...]], dtype: np.dtype
) -> list[np.ndarray]:
    out, at = [], 0
    for s in shapes:
        n = math.prod(s) * dtype.itemsize
        out.append(whole[at : at + n].view(dtype).reshape(s))
        at += -(-n // ALIGN) * ALIGN
    return out


def aligned_empties(shapes: Sequence[tuple[int, ...]], dtype: np.dtype) -> list[np.ndarray]:
    """Uninitialised arrays of `shapes`, each as `aligned_empty` gives it, carved from one
    huge-page mapping where together they fill at least one huge page: a leaf's shards on this
    process (freed together with the leaf), each too small for huge pages of its own.

    >>> a, b = aligned_empties([(3, 5), (256, 1024)], np.dtype(np.float32))
    >>> a.shape, b.shape, a.ctypes.data % ALIGN, b.ctypes.data % ALIGN
    ((3, 5), (256, 1024), 0, 0)
    """
    return aligned_empties_packed([(shapes, dtype)])[0]


def aligned_empties_packed(
    leaves: Sequence[tuple[Sequence[tuple[int, ...]], np.dtype]],
) -> list[list[np.ndarray]]:
    """`aligned_empties` of each (shapes, dtype), all carved from one huge-page mapping where
    together they fill at least one: consecutive small leaves (`packs`), which then keep that
    mapping, at most PACK_BYTES, alive until the last of them is freed.

    >>> [[x.shape for x in xs] for xs in aligned_empties_packed(
    ...     [([(512, 512)], np.dtype(np.float32)), ([(4,), (2, 2)], np.dtype(np.int8))])]
    [[(512, 512)], [(4,), (2, 2)]]
    """
    total = sum(aligned_bytes(shapes, dtype) for shapes, dtype in leaves)
    if not huge_page_bytes(total) or not _huge_pages_on():  # ordinary buffers, each alone
        return [[aligned_empty(tuple(s), dtype) for s in shapes] for shapes, dtype in leaves]
    whole, at, out = _huge_mapping(total), 0, []
    for shapes, dtype in leaves:
        n = aligned_bytes(shapes, dtype)
        out.append(_carve(whole[at : at + n], shapes, dtype))
        at += n
    return out


def packs(sizes: Sequence[int], most: int = PACK_BYTES) -> list[tuple[int, int]]:
    """Runs [start, end) of consecutive items, each smaller than a huge page, that together fill
    at least one and hold at most `most` bytes: small leaves to carve from one huge-page mapping
    (`aligned_empties_packed`). Items not in a run get buffers of their own.

    >>> packs([1 << 20, 1 << 20, 5 << 20, 1 << 20, 1 << 20, 1 << 20, 100])
    [(0, 2), (3, 7)]
    """
    out, start, total = [], 0, 0
    for i, n in enumerate([*sizes, None]):
        if n is not None and n < HUGE_PAGE and total + n <= most:
            total += n
            continue
        if total >= HUGE_PAGE and i - start > 1:
            out.append((start, i))
        start, total = i, 0
        if n is not None and n < HUGE_PAGE:
            total = n
        else:
            start = i + 1
    return out
