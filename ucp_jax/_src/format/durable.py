"""Making written files durable: early, in the background, and all at once before COMMIT.

Writers that write their data files without an fsync each (`store.DEFERRED_SYNC_CONTEXT`: saves
and imports into local folders) make them durable with one parallel pass, `sync_tree`, before
their COMMIT. Left to the end, that pass is the whole cost of durability, paid after the last
byte is written. `EarlySync` pays most of it while the writer goes on: each data file is
`fdatasync`ed on a background thread as soon as a transaction has landed in it. That matters
where the disk has a volatile cache in front of it (a VM's virtual disk, a drive's write cache):
writing back to that cache is quick, but its flush, which `fsync` asks for, runs at the disk's own
speed, and it then overlaps the rest of the write instead of following it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..util import config
from ..util.libc import libc
from .folders import PROCESS_PREFIX

EARLY_SYNC_THREADS = 2  # one flush waiting on the disk while the next is asked for


class EarlySync:
    """Make data files durable as they land, on background threads; `wait` before COMMIT.

    Used by one writing thread. An error of an early `fdatasync` is raised by `wait` (a write
    error reported to one fsync is not reported again to a later one on a new descriptor, so
    `sync_tree` would not see it). With `UCP_EARLY_SYNC=0`, `start` only asks the kernel to
    begin writing the file back (`start_writeback`).

    >>> syncs = EarlySync()
    >>> syncs.start(__file__)
    >>> syncs.wait()
    """

    def __init__(self) -> None:
        self.enabled = config.early_sync()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []

    def start(self, path: str) -> None:
        """Start making `path`'s data durable (again, if it has grown since the last call)."""
        if not self.enabled:
            start_writeback(path)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(EARLY_SYNC_THREADS, thread_name_prefix="ucp-sync")
        self._pending.append(self._pool.submit(_datasync, path))

    def wait(self) -> None:
        """Wait for every early sync; raise the first one's error (an OSError naming the file)."""
        pending, self._pending = self._pending, []
        pool, self._pool = self._pool, None
        first: BaseException | None = None
        for fut in pending:
            try:
                fut.result()
            except BaseException as e:
                first = first or e
        if pool is not None:
            pool.shutdown(wait=True)
        if first is not None:
            raise first


def _datasync(path: str) -> None:
    """fdatasync one file; a file removed meanwhile (a failed save's cleanup) is nothing to do."""
    _synced(path, os.fdatasync, "fdatasync", gone_ok=True)


def _synced(
    path: str, sync: Callable[[int], None] | None = None, name: str = "fsync", *,
    gone_ok: bool = False,
) -> None:  # fmt: skip
    """Open `path` (a file or a folder) and `sync` it (`name`: fsync or fdatasync; default
    `os.fsync`, looked up at the call); its error raised naming the file, and a path that does
    not exist skipped where `gone_ok`."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        if gone_ok:
            return
        raise
    try:
        (sync or os.fsync)(fd)
    except OSError as e:
        raise OSError(e.errno, f"making {path} durable ({name}): {e.strerror}", path) from e
    finally:
        os.close(fd)


def start_writeback(path: str) -> None:
    """Ask the kernel to start writing a file's dirty pages to disk now, without waiting.

    Files written without a sync then reach the disk while the writer goes on, and the `fsync` of
    `sync_tree` finds little left to do. Best effort: a no-op where unsupported.
    """
    _sync_range(path, 2)  # SYNC_FILE_RANGE_WRITE: start, do not wait


def settle_file(path: str) -> None:
    """Wait until a file's data is written to disk, then drop its pages from the page cache.

    For large sequential writers (imports): the page cache then recycles a few hot pages instead
    of taking fresh memory for every byte written, which is most of the cost of writing on
    machines where fresh memory is slow to come by (VMs). Data only; `sync_tree` still makes the
    metadata durable. A write error the wait reports is raised (an OSError naming the file): it
    would not be reported again to `sync_tree`'s fsync. With `UCP_EARLY_SYNC` (the default) the
    wait is an `fdatasync`, which flushes the disk's cache too (see `EarlySync`).
    """
    if config.early_sync():
        _datasync(path)
    else:  # WAIT_BEFORE | WRITE | WAIT_AFTER: all of the file's dirty pages written, waited on
        _sync_range(path, 1 | 2 | 4, check=True)
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _sync_range(path: str, flags: int, *, check: bool = False) -> None:
    """sync_file_range(2) over a whole file; its error raised with `check`."""
    sync_file_range = _libc_sync_file_range()
    if sync_file_range is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        if sync_file_range(fd, 0, 0, flags) != 0 and check:
            err = ctypes.get_errno()
            raise OSError(err, f"writing back {path}: {os.strerror(err)}", path)
    finally:
        os.close(fd)


@functools.cache
def _libc_sync_file_range() -> Any:
    """libc's sync_file_range (Linux), looked up on first use; None elsewhere."""
    fn = getattr(libc(), "sync_file_range", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return fn


def sync_tree(root: str, *, threads: int = 16) -> int:
    """fsync every file, then every directory, under `root` (in parallel); returns files synced.

    The durability step of writers that use DEFERRED_SYNC_CONTEXT: one pass over the files at the
    end, with many fsyncs in flight, instead of a blocking fsync per file as each is written.
    """
    files, dirs = [], []
    for d, _, fs in os.walk(root):
        dirs.append(d)
        files += [os.path.join(d, f) for f in fs]
    with ThreadPoolExecutor(threads, thread_name_prefix="ucp-fsync") as pool:
        list(pool.map(_synced, files))
        list(pool.map(fsync_dir, dirs))
    return len(files)


def fsync_dir(path: str) -> None:
    """fsync a directory (its entries durable); a directory gone is nothing to do."""
    _synced(path, gone_ok=True)


def sync_landed(syncs: EarlySync, local: str | None, me: int, requested: dict[str, int]) -> None:
    """Start making this process's data files written so far durable (a local save): those not
    in `requested` (name -> size when started) or grown since (a commit still writing it).

    Data files are written without an fsync each (`durable.sync_tree` makes them durable before
    COMMIT); below the kernel's dirty-page thresholds nothing would reach the disk until then, so
    the disk would sit idle while shards are encoded and then take the whole save at the end.
    Syncing each as its transaction lands overlaps the disk's writes and its cache's flushes with
    the rest of the save (large states on a VM: 0.78-0.88x the save's time, docs/performance.md).
    """
    if local is None:
        return
    d = os.path.join(local, f"{PROCESS_PREFIX}{me}", "d")
    try:
        entries = list(os.scandir(d))
    except OSError:
        return
    for e in entries:
        try:
            size = e.stat().st_size
        except OSError:
            continue
        if requested.get(e.name) != size:
            syncs.start(e.path)
            requested[e.name] = size
