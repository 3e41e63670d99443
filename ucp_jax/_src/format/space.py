"""Running out of room: full disks (an error that says so and where, the space of a failed write
given back), and host memory (`require_memory` before a conversion starts, `memory_error` for a
MemoryError or ENOMEM during one).

A save, a persist, an import or an export that runs out of space (ENOSPC, or EDQUOT over a quota)
surfaces as TensorStore's `RESOURCE_EXHAUSTED ... No space left on device` or Python's
`OSError(28)`, deep in a chain of errors; `full_error` turns it into a `StorageFullError` naming
the destination, the file system and its free space, and what the user can do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from typing import Any

from ..errors import AnotherProcessFailedError, HostMemoryError, StorageFullError

_CODES = (errno.ENOSPC, errno.EDQUOT)
EXPORT_FIX = "free host memory or raise the limit (exports hold a block of a tensor at a time)"
IMPORT_FIX = (
    "lower UCP_IMPORT_INFLIGHT_BYTES (the writes in flight), free host memory or raise the limit"
)
NEARLY_FULL = 256 << 10
_MARKS = ("No space left on device", "Disk quota exceeded", "os_error_code='28'",
          "os_error_code='122'")  # fmt: skip


def is_full(e: BaseException) -> bool:
    """Whether `e` (or an error it was raised from) says the storage is full."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen or len(seen) > 16:
            continue
        seen.add(id(x))
        if isinstance(x, StorageFullError):
            return True
        if isinstance(x, OSError) and x.errno in _CODES:
            return True
        if any(m in str(x) for m in _MARKS):
            return True
        todo += [x.__cause__, x.__context__]
    return False


def _existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def nearly_full(path: str) -> bool:
    """Whether the file system holding `path` has less than NEARLY_FULL bytes left (for writers
    whose errors do not say why: numpy's `tofile` says "requested and written", torch.save "iostream
    error")."""
    try:
        return shutil.disk_usage(_existing(path)).free < NEARLY_FULL
    except OSError:
        return False


def _usage(path: str) -> str:
    """'<free> of <total> free on <mount point>' for the file system holding `path`."""
    p = _existing(path)
    try:
        u = shutil.disk_usage(p)
    except OSError:
        return "its file system"
    mount = p
    while not os.path.ismount(mount) and os.path.dirname(mount) != mount:
        mount = os.path.dirname(mount)
    mib = 1 << 20
    return f"{u.free / mib:.1f} MiB of {u.total / mib:.1f} MiB free on {mount} now"


def full_error(
    e: BaseException, dest: Any, what: str, kept: str, *, removed: bool = True
) -> StorageFullError | None:
    """A StorageFullError for `e` if it says the storage is full (or, an OSError or RuntimeError
    that says nothing of why, if the local destination is nearly full), else None. Call it before
    the partial files are removed.

    Args:
        dest: the destination (a local path, a URL or a Location), named in the message.
        what: what was being written ("the checkpoint", "the export").
        kept: what the user still has ("earlier checkpoints are intact").
        removed: the partial files are removed (False: several processes wrote them, and the
            next save to the path removes them).
    """
    if isinstance(e, StorageFullError):
        return e
    if isinstance(e, AnotherProcessFailedError):  # (its message may quote the other's full disk)
        return None
    url = getattr(dest, "url", None) or os.fspath(dest)
    local = getattr(dest, "local_path", None) if hasattr(dest, "url") else url
    if local is not None and "://" in local:
        local = None
    unsaid = isinstance(e, OSError | RuntimeError) and local is not None and nearly_full(local)
    if not (is_full(e) or unsaid):
        return None
    where = _usage(local) if local is not None else "the store"
    err = StorageFullError(
        f"{url}: the disk is full (no space left on the device; {where}) while writing {what}; "
        + (
            "nothing was committed and the partial files were removed"
            if removed
            else "nothing was committed; the partial files (written by several "
            "processes) stay until the next save to this path removes them"
        )
        + f", {kept}: free space (delete old checkpoints, or keep fewer) or write elsewhere, "
        f"then try again ({e})"
    )
    err.errno = errno.ENOSPC
    return err


@contextlib.contextmanager
def folder_in_place(dst: str, what: str) -> Iterator[str]:
    """Write a local folder all or nothing (the exporters): yields `<dst>.ucp-tmp` to fill; when
    the block ends it replaces `dst` (an earlier `dst` is removed only then), and on any error it
    is removed, its space given back; a full disk is a `StorageFullError`."""
    tmp = dst + ".ucp-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        yield tmp
        if os.path.exists(dst):
            shutil.rmtree(dst)
        os.rename(tmp, dst)
    except BaseException as e:
        kept = "the source checkpoint and an earlier folder at the destination are intact"
        full = full_error(e, dst, what, kept) or memory_error(e, f"{dst}: {what}", EXPORT_FIX)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from e
        raise


def require_memory(need: int, what: str, fix: str) -> None:
    """Raise HostMemoryError now if this process cannot allocate `need` more bytes (its
    address-space or cgroup limit, or the machine's memory): past it, a buffer TensorStore
    cannot allocate ends the process with no Python exception."""
    from ..util.hostmem import allocatable

    have = allocatable()
    if have is not None and need > have[0]:
        raise HostMemoryError(
            f"{what} needs about {need >> 20} MiB of host memory in this process, but only "
            f"{have[0] >> 20} MiB can be allocated under {have[1]}; nothing was written: {fix}"
        )


def memory_error(e: BaseException, what: str, fix: str) -> HostMemoryError | None:
    """A HostMemoryError for a MemoryError or an ENOMEM OSError `e` (else None)."""
    if isinstance(e, HostMemoryError):
        return e
    if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM):
        return HostMemoryError(f"{what}: ran out of host memory ({e}); {fix}")
    return None
