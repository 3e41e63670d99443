"""Deleting a checkpoint so that a crash at any moment leaves it whole or gone, never half.

A plain `shutil.rmtree` of a checkpoint folder (the usual clean-up of old steps) removes its files
in directory order: a trainer killed during it leaves a folder that still holds COMMIT but lost
its manifest or arrays, which every listing then names as a committed checkpoint and a restore
fails on. `delete_checkpoint` first makes the checkpoint stop being one, atomically, then removes
its bytes:

* Local files: under the path's writer lock (no save of that path runs meanwhile), the folder is
  renamed to `.<name>.ucp-old-<id>` (one rename: readers and listings see it or nothing), then
  removed. A kill during the removal leaves only that hidden trash, which the next save or
  deletion in the folder sweeps (`writers.sweep`), as it does for killed saves.
* Object stores: under the path's writer claim, the folder's index entry, then COMMIT go first
  (as an overwrite does: `Staging.prepare`), then every other object. A kill leaves objects
  without COMMIT: not listed, not restorable, cleared by the next save to the path.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

from ..errors import ArgumentError, NotACheckpointError, UnsafePathError
from . import index, writers
from .durable import fsync_dir
from .folders import ORBAX_CHECKPOINT_METADATA
from .manifest import COMMIT
from .store import Location

LOCK_WAIT_S = 5.0  # a save's sweep of the folder holds other paths' locks for a moment


def delete_checkpoint(path: Any) -> None:
    """Delete the committed checkpoint at `path`: whole or not at all, whatever interrupts it.

    Use it instead of `shutil.rmtree` to remove old checkpoints (see the module docstring).

    Args:
        path: a checkpoint's local path or kvstore URL (file://, gs://, s3://, memory://), a
            kvstore spec or a `ucp.Location`, as `ucp.list_checkpoints` returns them.

    Raises:
        NotACheckpointError: nothing committed there (a folder without COMMIT is not removed:
            it may be someone else's data).
        WriterConflictError: a save to that path is in progress.
        UnsafePathError: the local path is a symbolic link (its target is not removed).
        ArgumentError: it is an item of an Orbax CheckpointManager's step (delete the step).

    In a multi-process job, call it on one process (deleting is not a collective): two
    processes deleting one checkpoint race, and the second is told there is nothing there.

    >>> if jax.process_index() == 0:  # doctest: +SKIP
    ...     for old in ucp.list_checkpoints("/tmp/ckpt")[:-3]:
    ...         ucp.delete_checkpoint(old)
    """
    loc = Location.parse(path)
    local = loc.local_path
    if (step := _orbax_step_of(loc)) is not None:
        raise ArgumentError(
            f"{loc.url} is an item of a step an Orbax CheckpointManager saved ({step} holds its "
            f"{ORBAX_CHECKPOINT_METADATA}): deleted alone, it would leave a step Orbax lists but cannot "
            "restore; delete the whole step with the manager (`mngr.delete(step)`), which "
            "removes its items"
        )
    if local is not None:
        _delete_local(loc, local.rstrip("/") or local)
    else:
        _delete_in_store(loc)


def _orbax_step_of(loc: Location) -> str | None:
    """The step folder holding `loc`, where Orbax's CheckpointManager saved it as an item."""
    parent, _, _ = loc.kvstore["path"].rstrip("/").rpartition("/")
    if not parent:
        return None
    above = Location(dict(loc.kvstore, path=parent + "/"), loc.context)
    return above.url if above.exists(ORBAX_CHECKPOINT_METADATA) else None


def _delete_local(loc: Location, final: str) -> None:
    if os.path.islink(final):
        raise UnsafePathError(
            f"{final} is a symbolic link: not deleting what it points to; delete the link "
            "itself, or pass the checkpoint's real path"
        )
    lock = writers.PathLock(final)
    lock.acquire(wait_s=LOCK_WAIT_S)
    try:
        if not os.path.isfile(os.path.join(final, COMMIT)):
            raise _not_a_checkpoint(loc)
        parent = os.path.dirname(final)
        trash = os.path.join(parent, f".{os.path.basename(final)}.ucp-old-{uuid.uuid4().hex}")
        os.rename(final, trash)
        fsync_dir(parent)
        shutil.rmtree(trash, ignore_errors=True)
    finally:
        lock.release()
    writers.sweep(os.path.dirname(final), keep="")  # what killed deletions and saves left here


def _delete_in_store(loc: Location) -> None:
    token = writers.Token(loc, for_delete=True)
    token.claim()
    try:
        if loc.read(COMMIT) is None:
            raise _not_a_checkpoint(loc)
        index.drop(loc)  # a listing never names it again, then it stops being a checkpoint
        loc.delete(COMMIT)
        loc.remove_all()
    finally:
        token.drop()


def _not_a_checkpoint(loc: Location) -> NotACheckpointError:
    return NotACheckpointError(
        f"{loc.url}: no committed checkpoint there (no {COMMIT}); nothing deleted. "
        "Pass the path of a checkpoint (`ucp.list_checkpoints` names them)"
    )
