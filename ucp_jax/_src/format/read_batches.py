"""Shard reads handed to a few reading threads in batches (the reads themselves: format/direct.py).

A restore issues one region read per piece of a leaf; each region meets one or more stored
shards. A model's tree has hundreds of small leaves, so a thread hand-off per shard (a wake-up,
a future) would cost more CPU than copying the shards' bytes: the restore's thread collects
shard reads into batches of about BATCH_BYTES, and each batch is read by one thread, its files
opened once. A shard the direct reader does not take (`direct.Mismatch`) is read in its place by
the piece's fallback (TensorStore), which raises the errors a damaged file deserves.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from . import direct, scatter_read
from .direct import Box, Extent, Fingerprints, Layout, Mismatch, OpenFiles, shards_in

__all__ = ["BATCH_BYTES", "Batcher", "Pieces"]

# positioned reads in flight: two per core, 2 to 8 (the roofline's plain read limit uses 4)
_THREADS = max(2, min(8, 2 * (os.cpu_count() or 1)))

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="ucp-read")
        return _pool


BATCH_BYTES = 8 << 20  # shard reads handed to a thread together: fewer wake-ups per byte


def buffer_bytes() -> int:
    """Host memory the reading threads hold besides the restored arrays: their bounce buffers
    (the C extension reads short rows through one each, kept while the thread lives).

    >>> buffer_bytes() in (0, _THREADS * scatter_read.BOUNCE_BYTES)
    True
    """
    return _THREADS * scatter_read.BOUNCE_BYTES if scatter_read.enabled() else 0


@dataclasses.dataclass(frozen=True)
class _Piece:
    """What the shard reads of one region share: see `Batcher.submit`; `place` is dst's
    `scatter_read.Target` (None: whole inner chunks go through the thread's buffer)."""

    locate: Callable[[tuple[int, ...]], Extent | None]
    lay: Layout
    dst: np.ndarray
    box: Box
    fallback: Callable[[Box, np.ndarray], None]
    fingerprints: Fingerprints | None
    place: scatter_read.Target | None


@dataclasses.dataclass
class _Job:
    """One shard's part of a piece to read; `error` is what reading it raised."""

    piece: _Piece
    index: tuple[int, ...]
    part: Box
    nbytes: int
    error: BaseException | None = None


@dataclasses.dataclass
class _Batch:
    jobs: list[_Job] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    future: Future[None] | None = None


def _run(batch: _Batch) -> None:
    files = OpenFiles()  # a data file is opened once per batch, not once per shard
    try:
        for job in batch.jobs:
            try:
                _one(job, files)
            except BaseException as e:  # raised where that piece is waited for
                job.error = e
    finally:
        files.close()


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
        self._scatter = scatter_read.enabled()  # read once, not once per piece

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
        # where whole inner chunks go in dst: worked out once for all its shards
        place = None
        if lay.inner is not None and self._scatter:
            place = scatter_read.target(dst, lay.dtype, checked=True)
        piece = _Piece(locate, lay, dst, box, fallback, fingerprints, place)
        for index in shards_in(box, lay.chunks):
            sbox = [(i * c, (i + 1) * c) for i, c in zip(index, lay.chunks)]
            part = direct.meet(sbox, box)
            if any(a >= b for a, b in part):
                continue
            nbytes = math.prod(b - a for a, b in part) * lay.dtype.itemsize
            job = _Job(piece, index, part, nbytes)
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


def _one(job: _Job, files: OpenFiles) -> None:
    p = job.piece
    ext = p.locate(job.index)
    if ext is not None:
        try:
            direct.read_shard(
                ext, p.lay, job.index, job.part, p.dst, p.box, p.fingerprints, files, p.place
            )
            direct.record("direct")
            return
        except Mismatch:
            pass  # TensorStore reads it: the same bytes, its checks, its errors
    direct.record("fallback")
    p.fallback(job.part, p.dst[direct.region_index(job.part, [a for a, _ in p.box])])
