"""The aggregated layout (format version 3): every array in one OCDBT database per checkpoint.

A checkpoint folder holds `manifest.json`, `COMMIT`, the root OCDBT database (`manifest.ocdbt`,
`d/`) and one database per writing process (`ocdbt.p<k>/`). Each process writes its chunks and its
fingerprint table (`digests/p<k>.json`, every array it wrote in one object) into its own
database, in a few large transactions (a handful of data files per process, however many arrays
and devices); process 0 then merges the per-process databases into the root one at commit
(their B-tree entries are copied, the data files stay where they are, referenced from the root).
Readers open the zarr3 arrays through the root database: byte-range reads of the chunks they
need, as with one file per chunk.
"""

from __future__ import annotations

import os
from typing import Any

import tensorstore as ts

from .folders import PROCESS_PREFIX
from .store import CONTEXT, DEFERRED_SYNC_CONTEXT, Location

AGGREGATED_VERSION = 3  # the first format version with this layout


def fresh_context(*, deferred_sync: bool = False) -> ts.Context:
    """A context with its own OCDBT caches (memory stores and thread pools shared with CONTEXT).

    Every save and every opened checkpoint uses its own: a database's manifest and B-tree nodes
    are cached per context, and a folder saved again (an overwrite, a retried save into the same
    staging folder) must never be read through the caches of its previous contents.

    Args:
        deferred_sync: local files are written without an fsync each; the writer makes them
            durable with one `durable.sync_tree` pass before its commit.
    """
    parent = DEFERRED_SYNC_CONTEXT if deferred_sync else CONTEXT
    return ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}}, parent)


# An object store's requests each cost a round trip: reads of one data file at most COALESCE_GAP
# apart are merged into one request (gathered for 1 ms), which reads the gap too. Small values
# (each array's zarr.json, the shards of small arrays) lie side by side in a writer's data files.
# The gap stays far below an inner chunk (store.MIN_INNER_CHUNK_BYTES): with 1 MiB (Orbax's), the
# fingerprint check's 4-byte reads at the end of each inner chunk merged into reads of whole
# shards, and restores downloaded 2-3x the state. Each merge reads at most COALESCE_GAP bytes
# that were not asked for, where a request costs a round trip (~2 MB of an object store's
# bandwidth). A merged request stays at most COALESCE_MERGED (range reads of 8-16 MB are what
# object stores serve fastest in parallel).
COALESCE_GAP = 16 << 10
COALESCE_MERGED = 16 << 20


def _db(folder: Location, sub: str, context: ts.Context | None) -> Location:
    base = folder.child(sub).kvstore if sub else dict(folder.kvstore)
    spec: dict[str, Any] = {
        "driver": "ocdbt", "base": base, "path": "", "cache_pool": "cache_pool#ocdbt"
    }  # fmt: skip
    if folder.local_path is None:
        spec.update({
            "experimental_read_coalescing_threshold_bytes": COALESCE_GAP,
            "experimental_read_coalescing_merged_bytes": COALESCE_MERGED,
            "experimental_read_coalescing_interval": "1ms",
        })  # fmt: skip
    return Location(spec, context if context is not None else fresh_context())


def root_db(folder: Location, context: ts.Context | None = None) -> Location:
    """The merged database of a committed checkpoint (what readers open); a fresh context by
    default."""
    return _db(folder, "", context)


def process_db(folder: Location, process: int, context: ts.Context | None = None) -> Location:
    """The database process `process` writes into during a save; a fresh context by default."""
    return _db(folder, f"{PROCESS_PREFIX}{process}", context)


def merge(folder: Location, processes: int) -> None:
    """Copy every process's database into the root database, in one atomic transaction.

    Raises:
        FileNotFoundError: a process's database is missing (that process never finished).
    """
    ctx = fresh_context()  # what is on storage now, not what a cache remembers
    root = root_db(folder, ctx).kv()
    txn = ts.Transaction(atomic=True)
    copies: list[Any] = []
    for k in range(processes):
        kv = process_db(folder, k, ctx).kv()
        if not kv.list(ts.KvStore.KeyRange("digests/", "digests0")).result():
            raise FileNotFoundError(
                f"{folder.url}/{PROCESS_PREFIX}{k} has no fingerprint table: process {k} did not "
                "finish writing its share"
            )
        copies.append(kv.experimental_copy_range_to(root.with_transaction(txn)))
    for c in copies:
        c.result()
    txn.commit_async().result()


def missing_databases(folder: Location, processes: Any) -> list[str]:
    """The database manifests of a committed version-3 checkpoint that are not there (the root's,
    `manifest.ocdbt`, and each writing process's, `ocdbt.p<k>/manifest.ocdbt`): what readers name
    when its arrays cannot be read. `processes` comes from the manifest (untrusted): only a sane
    int is used."""
    names = ["manifest.ocdbt"]
    if type(processes) is int and 1 <= processes <= 4096:
        names += [f"{PROCESS_PREFIX}{k}/manifest.ocdbt" for k in range(processes)]
    local = folder.local_path
    if local is not None:
        return [n for n in names if not os.path.isfile(os.path.join(local, n))]
    return [n for n in names if folder.read(n) is None]
