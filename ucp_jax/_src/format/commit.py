"""The commit protocol of a universal checkpoint: stage, seal, record, then COMMIT last.

Writers (`ucp.save`, the Orbax handler, the importers) write their arrays, record the fingerprints
of the chunk files they wrote (`record_fingerprints`), and process 0 seals the manifest (the sha256
of every `zarr.json`), writes it and writes `COMMIT` (with the manifest's sha256) last: a folder
without `COMMIT` is never read as a checkpoint (see `store.load_manifest`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import tensorstore as ts

from ..errors import ArgumentError, DestinationExistsError
from ..util.libc import exchange
from . import aggregate, index, integrity, space, writers
from .durable import fsync_dir
from .folders import checkpoint_entry
from .manifest import COMMIT, MANIFEST, Manifest, SlotInfo, commit_marker
from .store import Location, listdir


def write_commit(loc: Location, manifest_bytes: bytes, *, listed: bool = True) -> None:
    """Write the COMMIT marker (with the manifest's sha256): the last write of every protocol;
    in an object store, then the checkpoint's entry in its folder's index (index.py), unless
    not `listed` (an Orbax item: Orbax lists its step folder, and would take the index's
    folder for an item)."""
    marker = commit_marker(manifest_bytes)
    loc.write(COMMIT, marker)
    if listed:
        index.add(loc, marker)


def seal(target: Location, manifest: Manifest) -> bytes:
    """Record the sha256 of every array's `zarr.json` and of every fingerprint table in
    `manifest`; return the manifest's bytes.

    Process 0 calls it at commit, after every array exists (format version 2). Format version
    3: it first merges every process's database into the root one (`aggregate.merge`).
    """
    import hashlib

    if manifest.version >= aggregate.AGGREGATED_VERSION:
        aggregate.merge(target, int(manifest.source.get("process_count", 1)))
        target = aggregate.root_db(target)
    kv = target.kv()
    items = [(a, slot, info) for a in manifest.atoms.values() for slot, info in a.slots.items()]
    with ts.Batch() as batch:
        futs = [kv.read(f"{info.path}/zarr.json", batch=batch) for _, _, info in items]
    for (a, slot, info), f in zip(items, futs):
        r = f.result()
        if r.state != "value":
            raise FileNotFoundError(f"{target.url}/{info.path}/zarr.json was never written")
        sha = hashlib.sha256(bytes(r.value)).hexdigest()
        a.slots[slot] = dataclasses.replace(info, meta_sha256=sha)
    # ... and of every fingerprint table: what ties the data to this manifest (integrity.py)
    aggregated = manifest.version >= aggregate.AGGREGATED_VERSION
    prefixes = [""] if aggregated else [f"{info.path}/" for _, _, info in items]
    manifest.tables = integrity.table_digests(kv, prefixes)
    return manifest.dumps()


def record_fingerprints(
    target: Location,
    keys: dict[SlotInfo, set[str]],
    writer: str,
    known: dict[str, dict[str, tuple[str, int, int, int]]] | None = None,
    *,
    deferred_sync: bool = False,
) -> None:
    """Each array's fingerprint table of the chunk files `writer` wrote (see integrity.py).

    `known`: array path -> chunk key -> `integrity.local_fingerprint` taken while the file's pages
    were hot (used when the file is unchanged since). `deferred_sync`: the tables are not fsynced
    one by one (the caller syncs the whole tree before COMMIT, as the importers do).
    """
    from concurrent.futures import ThreadPoolExecutor

    def one(item: tuple[SlotInfo, set[str]]) -> None:
        info, ks = item
        have = (known or {}).get(info.path)
        local = target.local_path
        where = (
            os.path.join(local, info.path) if local is not None else target.child(info.path).kv()
        )
        integrity.write_table(where, info, ks, writer, have, sync=not deferred_sync)

    with ThreadPoolExecutor(8, thread_name_prefix="ucp-digest") as pool:
        list(pool.map(one, [(i, k) for i, k in keys.items() if k]))


class Staging:
    """The commit protocol of one save.

    Local files: arrays go to a hidden temporary directory, renamed onto the final path after the
    manifest and COMMIT are written. Other kvstores: arrays go to the final path, COMMIT last.
    """

    def __init__(self, final: Location, *, overwrite: bool) -> None:
        self.final = final
        self.overwrite = overwrite
        # one writer at a time (writers.py): a lock on local files, a token in object stores
        self._lock: writers.PathLock | None = None
        self._token: writers.Token | None = None
        if final.local_path is not None:
            self.target = final.sibling(f".{final.name}.ucp-tmp")
            self._lock = writers.PathLock(final.local_path)
        else:
            if not final.name:
                raise ArgumentError(
                    f"{final.url}: a checkpoint cannot be the top of a bucket (its writer's "
                    "claim and its listing entry live beside it, in its parent folder); save it "
                    f"under a name: {final.child('step_1').url}"
                )
            self.target = final
            self._token = writers.Token(final)

    def check(self) -> None:
        """Refuse to clobber an existing checkpoint unless asked, or anything that is not one
        (any process may call it)."""
        if self.final.local_path is not None:
            _check_local_folder(self.final.local_path, self.overwrite)
        marker = None if self.overwrite else self.final.read(COMMIT)
        if marker is not None:
            with contextlib.suppress(Exception):  # (the refusal below is what matters)
                index.heal(self.final, marker)
            raise DestinationExistsError(
                f"{self.final.url} already holds a committed checkpoint; pass overwrite=True "
                "(--overwrite) or save to a new path"
            )

    def prepare(self) -> None:
        """Clear the staging area (process 0 only, before arrays are created).

        In place (object stores): the folder's index entry of the path, then COMMIT go first, so
        that a save killed while the old objects are being deleted leaves no marker over a
        half-deleted checkpoint.
        """
        # One writer at a time: the path's lock, or its claim, before anything is cleared (a
        # second save touches nothing); then, as the first may have committed meanwhile, the
        # same check as `check`.
        if self._lock is not None:
            self._lock.acquire()
        if self._token is not None:
            self._token.claim()
        try:
            self.check()
            if self.final.local_path is None:
                _check_remote_prefix(self.final)
        except FileExistsError:
            self.release()
            raise
        if self.target.local_path is None:
            index.ensure_complete(self.final)  # once per folder: see index.py
            index.drop(self.final)  # a marker never names a checkpoint without COMMIT
            self.target.delete(COMMIT)
        self.target.remove_all()
        if self.final.local_path is not None:
            parent = os.path.dirname(self.final.local_path)
            os.makedirs(parent, exist_ok=True)
            # An overwrite killed during its clean-up leaves `.<name>.ucp-old-<id>`: remove it;
            # and what killed saves of other paths here left, where nobody holds their lock.
            for n in listdir(parent):
                if n.startswith(f".{self.final.name}.ucp-old-"):
                    shutil.rmtree(os.path.join(parent, n), ignore_errors=True)
            writers.sweep(parent, keep=self.final.name)

    def abandon(self) -> None:
        """After a failed save: remove its staging folder (local files, when this save holds
        the path's lock: never another writer's; the final path is left as it was). In place
        (object stores) nothing is removed: no COMMIT was written, and the next save to the path
        clears what is there."""
        if self._lock is not None and self._lock.held:
            self.target.remove_all()
        self.release()

    def release(self) -> None:
        """Let the next save of this path in (after a commit or a failure; idempotent)."""
        if self._lock is not None:
            self._lock.release()
        if self._token is not None:
            self._token.drop()

    def still_ours(self) -> None:
        """Object stores: renew this save's claim on the path, or raise WriterConflictError."""
        if self._token is not None:
            self._token.renew()

    def commit(self, manifest: Manifest) -> None:
        """Write manifest and COMMIT, then publish atomically (process 0 only)."""
        try:
            self._commit(manifest)
        finally:
            self.release()

    def _commit(self, manifest: Manifest) -> None:
        data = seal(self.target, manifest)
        self.still_ours()
        self.target.write(MANIFEST, data)
        write_commit(self.target, data)
        if self.final.local_path is None:
            return
        final = self.final.local_path
        assert self.target.local_path is not None
        if not self.overwrite and os.path.isdir(final):
            with contextlib.suppress(OSError):  # an empty folder made for the save: it goes
                os.rmdir(final)
        if os.path.exists(final):
            if not self.overwrite:
                raise DestinationExistsError(f"{final} appeared during the save; not replacing it")
            if exchange(self.target.local_path, final):  # readers find the old or the new
                shutil.rmtree(self.target.local_path, ignore_errors=True)  # now the old one
                fsync_dir(os.path.dirname(final))
                return
            trash = (
                f"{os.path.dirname(final)}/.{os.path.basename(final)}.ucp-old-{uuid.uuid4().hex}"
            )
            os.rename(final, trash)
            os.rename(self.target.local_path, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(self.target.local_path, final)
        fsync_dir(os.path.dirname(final))


def _check_local_folder(final: str, overwrite: bool) -> None:
    """Refuse a save onto a file, or onto a folder holding files no save wrote, a committed
    checkpoint's folder included (before any write).

    An empty folder is taken (made for the checkpoint); a folder of a checkpoint's own entries
    without COMMIT (a save that did not finish) is replaced with ``overwrite``, and one with
    COMMIT is left to the COMMIT check.
    """
    if not os.path.lexists(final):
        return
    if not os.path.isdir(final) or os.path.islink(final):
        raise DestinationExistsError(
            f"{final} is a file, not a checkpoint folder; save to another path (a checkpoint is "
            "a folder)"
        )
    names = listdir(final)
    if not names:
        return  # made for the checkpoint
    # also beside a COMMIT: files added to a checkpoint (an evaluation's results), or a file of
    # that name among someone's files, would go with the folder an overwrite replaces
    _refuse_foreign(final, names, "files", "the whole folder")
    if COMMIT in names:
        return  # a checkpoint: the COMMIT check decides
    if not overwrite:
        raise DestinationExistsError(
            f"{final} holds an unfinished checkpoint (no COMMIT: a save that was stopped); pass "
            "overwrite=True to replace it, or save to a new path"
        )


def _check_remote_prefix(final: Location) -> None:
    """An object store's `_check_local_folder`: refuse a save (an overwrite too) onto a path
    holding objects no save wrote, before anything there is deleted. Process 0 only (it lists
    every object under the path once; a fresh path is one request)."""
    tops = {k.split("/", 1)[0] for k in final.list_keys()}
    _refuse_foreign(final.url, tops, "objects", "everything under the path")


def _refuse_foreign(where: str, names: Any, what: str, replaced: str) -> None:
    """FileExistsError naming the entries among `names` (a folder's, or the top names under an
    object-store path) that no save writes."""
    foreign = sorted(n for n in names if not checkpoint_entry(n))
    if foreign:
        raise DestinationExistsError(
            f"{where} holds {what} that are not a checkpoint's ({foreign[:3]}"
            f"{', ...' if len(foreign) > 3 else ''}); a save replaces {replaced}, so it "
            f"refuses, even with overwrite=True: save to a new path, or move those {what}"
        )


@contextlib.contextmanager
def failing_cleanly(staging: Any, dest: Location, *, alone: bool) -> Iterator[None]:
    """Around the writes of a save: when they fail, the staging area is removed (`alone`: this
    process is the only writer, so nothing else writes there; with several, the next save's
    `prepare` clears it); a full disk is a `StorageFullError` that says so and where."""
    try:
        yield
    except BaseException as e:
        why: BaseException | None = space.full_error(
            e, dest, "the checkpoint", "earlier checkpoints are intact", removed=alone
        )
        with contextlib.suppress(Exception):
            if alone and hasattr(staging, "abandon"):
                staging.abandon()
            elif hasattr(staging, "release"):
                staging.release()
        if why is not None:
            raise why from e
        raise
