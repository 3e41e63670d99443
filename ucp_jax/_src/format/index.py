"""Listing the checkpoints of a folder: one key per checkpoint in object stores, not every object.

TensorStore lists a kvstore without a delimiter: listing `s3://bucket/run` for its checkpoints
returned every object of every checkpoint under it (format version 3: 4 + 4 per process each;
version 2: one per chunk). So every commit into a store that is not a local folder also writes a
marker beside the checkpoint, `<folder>/.ucp-index/<name>` (after COMMIT, with COMMIT's bytes),
and an overwrite deletes the marker before it deletes COMMIT: a marker never names a checkpoint
that ucp left uncommitted. A listing reads the key range `.ucp-index/` of the folder: one key per
checkpoint, plus `.ucp-index/.complete`.

`.complete` says the index holds every committed checkpoint of the folder. The first save into a
folder writes it, after one listing of every key there that adds the markers of the checkpoints
already there (saved by an older ucp_jax, or copied in); `ucp index FOLDER` does the same. Without
it a listing falls back to listing every key, as before, and logs that it did. Names read from the
index are untrusted: one path component each, not hidden, else skipped with a warning.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from ..errors import UnsafePathError
from ..untrusted.paths import check_component
from . import remote
from .manifest import COMMIT, MANIFEST
from .store import Location, listdir

log = logging.getLogger("ucp_jax")
INDEX = ".ucp-index"  # the folder of markers, beside the checkpoints
COMPLETE = ".complete"  # in it: the index holds every checkpoint of the folder


def list_checkpoints(root: Any) -> list[Any]:
    """Committed checkpoints directly under `root`, in name order with numbers by value
    (`step_9` before `step_10`, so the last is the latest step); partial saves are skipped.

    Paths (str) for a path or URL `root`; `Location`s for a kvstore spec or a Location (they
    keep its endpoint and options).

    >>> list_checkpoints("/nonexistent")
    []
    """
    loc = Location.parse(root)
    if isinstance(root, Location) or remote.spec_of(root) is not None:
        return [loc.child(n) for n in committed_names(loc)]
    if loc.local_path is not None:
        return [os.path.join(loc.local_path, n) for n in committed_names(loc)]
    return [loc.child(n).url for n in committed_names(loc)]  # (memory://: no path to join)


def committed_names(loc: Location) -> list[str]:
    """Names of the committed checkpoints directly under `loc`, in `natural` order.

    A local folder: its entries holding a COMMIT and a manifest (one with COMMIT but no manifest
    is what a plain `rm -r` interrupted midway leaves: skipped, with a warning). Another store: its
    index (one key per checkpoint), or, where the folder has no complete index, every key under it.
    """
    if loc.local_path is not None:
        return [n for n in sorted(listdir(loc.local_path), key=natural)
                if not n.startswith(".") and _whole(loc.local_path, n)]  # fmt: skip
    names = indexed(loc)
    if names is not None:
        return names
    log.info(
        "%s has no complete checkpoint index (%s/%s): listing every key under it; a save into "
        "it or `ucp index %s` builds the index",
        loc.url, INDEX, COMPLETE, loc.url,
    )  # fmt: skip
    return scanned(loc)


def natural(name: str) -> list[Any]:
    """Sort key of a checkpoint name: runs of digits compare as numbers (step_9 < step_10).

    >>> sorted(["step_10", "step_9", "step_100", "best"], key=natural)
    ['best', 'step_9', 'step_10', 'step_100']
    >>> sorted(["notes_1²", "step_2"], key=natural)  # '²' is a digit to isdigit, not to int
    ['notes_1²', 'step_2']
    """
    # the runs `\d` splits off are exactly the decimal ones (isdecimal), which int() reads
    return [int(t) if t.isdecimal() else t for t in re.split(r"(\d+)", name)]


def _whole(folder: str, name: str) -> bool:
    """Whether local entry `name` holds a COMMIT and the manifest it seals."""
    path = os.path.join(folder, name)
    if not os.path.exists(os.path.join(path, COMMIT)):
        return False
    if os.path.exists(os.path.join(path, MANIFEST)):
        return True
    log.warning(
        "%s holds COMMIT but no %s (a deletion interrupted midway?): not listed as a checkpoint; "
        "remove it with `ucp rm %s`",
        path, MANIFEST, path,
    )  # fmt: skip
    return False


def indexed(loc: Location) -> list[str] | None:
    """The names the index of folder `loc` holds, sorted; None when it is not complete."""
    prefix = INDEX + "/"
    complete, names = False, []
    for key in loc.list_keys(prefix, INDEX + "0"):
        name = key[len(prefix) :]
        if name == COMPLETE:
            complete = True
        elif _usable(name, loc):
            names.append(name)
    return sorted(names, key=natural) if complete else None


def scanned(loc: Location) -> list[str]:
    """Names of the committed checkpoints under `loc` from a listing of every key there."""
    keys = loc.list_keys()
    marked = {k.split("/")[0] for k in keys if k.count("/") == 1 and k.endswith("/" + COMMIT)}
    sealed = {k.split("/")[0] for k in keys if k.count("/") == 1 and k.endswith("/" + MANIFEST)}
    for n in sorted(marked - sealed, key=natural):  # as `_whole` skips such a local folder
        log.warning(
            "%s/%s holds COMMIT but no %s (a deletion interrupted midway?): not listed as a "
            "checkpoint; remove it with `ucp rm %s/%s`",
            loc.url, n, MANIFEST, loc.url, n,
        )  # fmt: skip
    return sorted((n for n in marked & sealed if not n.startswith(".")), key=natural)


def _usable(name: str, loc: Location) -> bool:
    """Whether an index entry is a checkpoint name: one path component, not hidden."""
    try:
        check_component(name, f"checkpoint name in {loc.url}/{INDEX}")
    except UnsafePathError as e:
        log.warning("skipping an index entry that is not a checkpoint name: %s", e)
        return False
    if name.startswith("."):
        log.warning("skipping index entry %r of %s: checkpoint names are not hidden", name, loc.url)
        return False
    return True


def parent(loc: Location) -> tuple[Location, str]:
    """(the folder holding checkpoint `loc`, its name in it)."""
    spec = dict(loc.kvstore)
    path = spec["path"].rstrip("/")
    spec["path"] = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
    return Location(spec, loc.context), loc.name


def add(final: Location, marker: bytes) -> None:
    """After COMMIT: the index entry of checkpoint `final` (stores that are not local folders)."""
    if final.local_path is None:
        folder, name = parent(final)
        folder.write(f"{INDEX}/{name}", marker)


def drop(final: Location) -> None:
    """Before COMMIT is deleted (an overwrite): remove the index entry of checkpoint `final`."""
    if final.local_path is None:
        folder, name = parent(final)
        folder.delete(f"{INDEX}/{name}")


def ensure_complete(final: Location) -> None:
    """Before a save into an object store writes anything: make the index of the folder that
    will hold `final` complete, if it is not yet (once per folder: `build`)."""
    if final.local_path is None:
        folder, _ = parent(final)
        if folder.read(f"{INDEX}/{COMPLETE}") is None:
            build(folder)


def heal(final: Location, marker: bytes) -> None:
    """A committed checkpoint found without its index entry (a save killed between COMMIT and
    the entry): add it, so that listings show what a save to the path would refuse to replace."""
    if final.local_path is None:
        folder, name = parent(final)
        if folder.read(f"{INDEX}/{name}") is None:
            folder.write(f"{INDEX}/{name}", marker)


def build(folder: Location) -> list[str]:
    """Index every committed checkpoint under `folder` from a listing of every key there (and
    drop the entries of any other), then mark the index complete; return the names indexed
    (`ucp index`; the first save into a folder).

    Raises:
        ValueError: `folder` is a local folder (listed directly, it has no index).
    """
    if folder.local_path is not None:
        raise ValueError(
            f"{folder.url} is a local folder: it is listed directly and has no index; pass an "
            "object-store folder (s3://, gs://, memory://)"
        )
    names = scanned(folder)
    kv = folder.kv()
    commits = [(n, kv.read(f"{n}/{COMMIT}")) for n in names]  # concurrent requests
    writes = {}
    for n, f in commits:
        r = _wait(folder, f, f"a read of {n}/{COMMIT}")
        if r.state == "value":  # (deleted meanwhile: not indexed)
            writes[n] = kv.write(f"{INDEX}/{n}", bytes(r.value))
    for n, w in writes.items():
        _wait(folder, w, f"a write of {INDEX}/{n}")
    for key in folder.list_keys(INDEX + "/", INDEX + "0"):  # entries of deleted checkpoints
        if key[len(INDEX) + 1 :] not in writes and key != f"{INDEX}/{COMPLETE}":
            folder.delete(key)
    folder.write(f"{INDEX}/{COMPLETE}", b"ucp-index/1\n")
    return list(writes)


def _wait(loc: Location, future: Any, what: str) -> Any:
    """A small request's result; within `UCP_STORE_TIMEOUT_S` on remote stores."""
    return remote.wait(future, loc.kvstore, what) if loc.remote else future.result()
