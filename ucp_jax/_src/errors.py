"""Exception types of ucp_jax: every error names the leaf, what was expected, what was found, the fix."""

from __future__ import annotations

import pickle
from typing import Any


class UcpError(Exception):
    """Base class of all ucp_jax errors."""


class NotACheckpointError(UcpError, FileNotFoundError):
    """The path holds no committed universal checkpoint (missing, partial or foreign)."""


class FormatVersionError(UcpError):
    """The checkpoint was written by a newer format version than this library reads."""


class _LeafError(UcpError):
    """An error about one leaf: `leaf` names it, `kind` says what is wrong (for `ucp.plan`)."""

    def __init__(self, *args: object, leaf: str | None = None, kind: str | None = None) -> None:
        super().__init__(*args)
        self.leaf = leaf
        self.kind = kind


class MismatchError(_LeafError, ValueError):
    """A target leaf does not match the checkpoint (shape, dtype, atom, slot or tree)."""


class PatternError(_LeafError, ValueError):
    """A rule or pattern cannot be applied to a leaf (sizes, axes or names do not reconcile)."""


class RestorePlanError(MismatchError, PatternError):
    """The targets do not fit the checkpoint: every problem `ucp.plan` found, in one message.

    Attributes:
        plan: the `RestorePlan` (its `.problems`, `.missing`, `.unexpected`, suggested rules).
    """

    def __init__(self, message: str, plan: object) -> None:
        super().__init__(message)
        self.plan = plan


class ChecksumError(UcpError):
    """Stored bytes are missing or do not match their checksum: the checkpoint is corrupt."""


class UnsafePathError(UcpError, ValueError):
    """A name from a checkpoint or source folder would lead outside it (`..`, absolute, a link)."""


class LimitError(UcpError, ValueError):
    """A size in untrusted input (shape, element count, chunk grid, header) is out of bounds."""


class StoreError(UcpError, OSError):
    """An object store refused a request: no such bucket, access denied, bad credentials."""


class StoreUnreachableError(StoreError, ConnectionError):
    """An object store did not answer in time (`UCP_STORE_TIMEOUT_S`) or refused the connection."""


class StorageFullError(UcpError, OSError):
    """The storage a checkpoint (or an export) is written to is full: no space left on the device,
    or over a quota. Nothing was committed; what the failed write left was removed."""


def in_background(err: BaseException, prefix: str) -> BaseException:
    """The error of a background job (an async save, a persist), raised where the caller waits.

    A UcpError keeps its class (a caller catching `StorageFullError` or `StoreError` catches it),
    with `prefix` before its message; any other error becomes a RuntimeError saying so.
    """
    if isinstance(err, UcpError):
        try:
            out = type(err)(f"{prefix}: {err}")
        except TypeError:  # a class that takes more than a message
            pass
        else:
            if isinstance(err, OSError) and isinstance(out, OSError):
                out.errno = err.errno
            return out
    return RuntimeError(f"{prefix}: {err}")


class WriterConflictError(UcpError):
    """Another save to the same checkpoint path is in progress (two jobs saving one step to one
    folder or bucket path); this save stopped without committing anything."""


class AnotherProcessFailedError(UcpError, RuntimeError):
    """Another process of the job failed during a save all of them make (its error is in the
    message); this process stopped with it, and nothing was committed."""


class DeviceCountError(UcpError, ValueError):
    """A mesh or parallel layout needs more devices than there are: `needed` and `available` say
    how many (restore onto a layout that fits, or run with more devices)."""

    def __init__(self, *args: object, needed: int, available: int) -> None:
        super().__init__(*args)
        self.needed = needed
        self.available = available


def check_device_count(what: str, needed: int, devices: list[Any], fix: str | None = None) -> None:
    """Raise DeviceCountError unless `devices` holds at least `needed` devices for `what`
    (`fix`: what to do, default: sizes whose product is at most the devices available)."""
    if len(devices) < needed:
        kinds = sorted({d.platform for d in devices}) or ["none"]
        fix = fix or f"choose sizes whose product is at most {len(devices)}"
        raise DeviceCountError(
            f"{what} needs {needed} devices, {len(devices)} available ({', '.join(kinds)}); "
            f"{fix}, or run with more devices",
            needed=needed,
            available=len(devices),
        )


def check_inflight_bytes(value: Any, where: str) -> int | None:
    """`max_inflight_bytes` as given: None (the default) or a positive int of bytes.

    >>> check_inflight_bytes(1 << 20, "restore")
    1048576

    Raises:
        ArgumentError: another value (0, a negative number, a float, "1GiB").
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ArgumentError(
        f"{where}(max_inflight_bytes={value!r}): expected a positive number of bytes (an int, "
        "e.g. 1 << 30 for 1 GiB) or None for the default (UCP_INFLIGHT_BYTES, 1 GiB)"
    )


class HostMemoryError(UcpError, MemoryError):
    """A restore or a conversion needs more host memory than this process can allocate (its
    address-space or cgroup limit, or the machine's memory); nothing was read."""


class ArgumentError(UcpError, ValueError):
    """An argument asks for what the operation cannot do (a dtype a model cannot take, ...)."""


class DestinationExistsError(UcpError, FileExistsError):
    """The destination of a save, import or export holds a checkpoint or files already: pass
    ``overwrite=True`` (``--overwrite``) or choose another."""


class UnsafePickleError(UcpError, pickle.UnpicklingError):
    """A torch file asks for a global that is not on the allow-list; nothing of it was run."""
