"""Every environment switch of ucp_jax, read when it is needed (not at import).

Each function reads its variable on every call, so a test or a launcher may set it at any time
before the call it affects. The "Environment switches" table of docs/cli.md lists them all.
"""

from __future__ import annotations

import os
from typing import Any

GIB = 1 << 30
MIB = 1 << 20


def _number(name: str, default: float, kind: type, unit: str) -> Any:
    """The environment variable `name` as a `kind` (int or float), or `default` when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not {'an integer' if kind is int else 'a number'}"
            f" ({unit}); unset it or give one such as {kind(default)}"
        ) from None


def inflight_bytes() -> int:
    """Host bytes a save or restore keeps in flight (`UCP_INFLIGHT_BYTES`, default 1 GiB).

    >>> inflight_bytes() > 0
    True
    """
    n = int(_number("UCP_INFLIGHT_BYTES", GIB, int, "bytes"))
    if n < 1:
        raise ValueError(
            f"environment variable UCP_INFLIGHT_BYTES={n}: bytes in flight must be at least 1; "
            f"unset it (default {GIB}) or give a positive size"
        )
    return n


def save_layout() -> str:
    """The layout saves write (`UCP_LAYOUT`): 'aggregated' (the default: format version 3, one
    OCDBT database per process, merged at commit) or 'per-array' (format version 2, one file per
    chunk).

    >>> save_layout() in ("per-array", "aggregated")
    True
    """
    raw = os.environ.get("UCP_LAYOUT", "").strip() or "aggregated"
    if raw not in ("per-array", "aggregated"):
        raise ValueError(
            f"environment variable UCP_LAYOUT={raw!r}: use 'per-array' or 'aggregated'"
        )
    return raw


def import_inflight_bytes(default: int = 64 * MIB) -> int:
    """Bytes an importer keeps in flight, reads ahead and writes (`UCP_IMPORT_INFLIGHT_BYTES`,
    else `default`: 64 MiB, as imports stream whole source files and want a small resident set;
    an importer may ask for more where it pays, see `import_deepspeed`).

    >>> import_inflight_bytes() > 0
    True
    """
    return int(_number("UCP_IMPORT_INFLIGHT_BYTES", default, int, "bytes"))


def barrier_timeout_s() -> float:
    """How long a cross-process barrier or key-value wait may take (`UCP_BARRIER_TIMEOUT_S`,
    default 1800 s).

    >>> barrier_timeout_s() > 0
    True
    """
    return float(_number("UCP_BARRIER_TIMEOUT_S", 1800.0, float, "seconds"))


def rebuild_share_timeout_s() -> float:
    """How long a process waits for the peers on its machine that share the rebuild of lost nodes
    with it before it rebuilds them alone (`UCP_REBUILD_SHARE_TIMEOUT_S`, default 60 s).

    >>> rebuild_share_timeout_s() > 0
    True
    """
    return float(_number("UCP_REBUILD_SHARE_TIMEOUT_S", 60.0, float, "seconds"))


def store_timeout_s() -> float:
    """How long a first request to an object store (s3, gcs, http) may go unanswered before
    `StoreUnreachableError` (`UCP_STORE_TIMEOUT_S`, default 60 s).

    >>> store_timeout_s() > 0
    True
    """
    return float(_number("UCP_STORE_TIMEOUT_S", 60.0, float, "seconds"))


def writer_claim_s() -> float:
    """How long a save's claim on an object-store path (`.ucp-writer`) lasts without renewal
    (`UCP_WRITER_CLAIM_S`, default 60 s): a live save renews it every quarter of that; a save
    that finds one unchanged for that long takes it over (its writer died).

    >>> writer_claim_s() > 0
    True
    """
    return max(float(_number("UCP_WRITER_CLAIM_S", 60.0, float, "seconds")), 0.1)


def sigterm_grace_s() -> float:
    """How long a process ended by SIGTERM may spend finishing its background saves, snapshots
    and persists before it dies (`UCP_SIGTERM_GRACE_S`, default 600 s; a scheduler's SIGKILL
    after its own grace period comes first where it is shorter).

    >>> sigterm_grace_s() > 0
    True
    """
    return max(float(_number("UCP_SIGTERM_GRACE_S", 600.0, float, "seconds")), 0.0)


def store_retries() -> int:
    """Attempts per object-store request on transient errors (`UCP_STORE_RETRIES`, default 8).

    >>> store_retries() >= 1
    True
    """
    return max(int(_number("UCP_STORE_RETRIES", 8, int, "attempts")), 1)


def snapshot_device_copies() -> bool:
    """Whether snapshots of CPU devices go through device-side copies, the path accelerators take
    (`UCP_SNAPSHOT_DEVICE_COPIES=1`; default off: they copy straight from the CPU buffers).

    >>> isinstance(snapshot_device_copies(), bool)
    True
    """
    return _switch("UCP_SNAPSHOT_DEVICE_COPIES", default=False)


def staging() -> str:
    """How host data reaches accelerator memory and back (`UCP_STAGING`): 'auto' (the default:
    through the devices' `pinned_host` memory where they have one and are not CPUs),
    'pinned_host' (always, CPUs too: the accelerator path, testable on CPU) or 'none' (pageable
    host buffers handed to `device_put` as they are).

    >>> staging() in ("auto", "pinned_host", "none")
    True
    """
    raw = os.environ.get("UCP_STAGING", "").strip() or "auto"
    if raw not in ("auto", "pinned_host", "none"):
        raise ValueError(f"environment variable UCP_STAGING={raw!r}: use auto, pinned_host or none")
    return raw


def _switch(name: str, default: bool = True) -> bool:
    """A switch: off when the variable is 0, false or no, on when it is anything else, and
    `default` when it is unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    return default if not raw else raw not in ("0", "false", "no")


def direct_read() -> bool:
    """Whether restores from local folders read shards themselves (`UCP_DIRECT_READ`, default
    on; 0: TensorStore reads everything, as from object stores). See format/direct.py.

    >>> isinstance(direct_read(), bool)
    True
    """
    return _switch("UCP_DIRECT_READ")


def huge_pages() -> bool:
    """Whether large host buffers that restores fill are mapped with transparent huge pages
    (`UCP_HUGE_PAGES`, default on where the kernel offers them; 0: 4 KiB pages). See
    util/buffers.py.

    >>> isinstance(huge_pages(), bool)
    True
    """
    return _switch("UCP_HUGE_PAGES")


def scatter_read() -> bool:
    """Whether direct reads put whole chunks straight into scattered rows of their target
    (`UCP_SCATTER_READ`, default on, where the C extension is built; 0: through a per-thread
    buffer). See format/scatter_read.py.

    >>> isinstance(scatter_read(), bool)
    True
    """
    return _switch("UCP_SCATTER_READ")


def direct_write() -> bool:
    """Whether version-3 saves and imports encode whole shards themselves (`UCP_DIRECT_WRITE`,
    default on; 0: TensorStore encodes every chunk). See format/encode.py.

    >>> isinstance(direct_write(), bool)
    True
    """
    return _switch("UCP_DIRECT_WRITE")


def early_sync() -> bool:
    """Whether local saves and imports fdatasync each data file as soon as a transaction has
    landed in it, on background threads (`UCP_EARLY_SYNC`, default on; 0: the kernel is only
    asked to start writing it back, and every flush waits for the fsync pass before COMMIT). See
    format/durable.py.

    >>> isinstance(early_sync(), bool)
    True
    """
    return _switch("UCP_EARLY_SYNC")


def cli_caps_malloc_arenas() -> bool:
    """Whether the `ucp` command caps glibc's malloc arenas at 2 (it does unless
    `MALLOC_ARENA_MAX` is set, in which case glibc applies that value itself).

    >>> isinstance(cli_caps_malloc_arenas(), bool)
    True
    """
    return "MALLOC_ARENA_MAX" not in os.environ
