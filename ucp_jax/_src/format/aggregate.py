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

from typing import Any

import tensorstore as ts

from .store import CONTEXT, Location

PROCESS_PREFIX = "ocdbt.p"
AGGREGATED_VERSION = 3  # the first format version with this layout


def _db(folder: Location, sub: str = "") -> Location:
    base = folder.child(sub).kvstore if sub else dict(folder.kvstore)
    return Location({"driver": "ocdbt", "base": base, "path": "", "cache_pool": "cache_pool#ocdbt"})


def root_db(folder: Location) -> Location:
    """The merged database of a committed checkpoint (what readers open)."""
    return _db(folder)


def process_db(folder: Location, process: int) -> Location:
    """The database process `process` writes into during a save."""
    return _db(folder, f"{PROCESS_PREFIX}{process}")


def merge(folder: Location, processes: int) -> None:
    """Copy every process's database into the root database, in one atomic transaction.

    Raises:
        FileNotFoundError: a process's database is missing (that process never finished).
    """
    root = ts.KvStore.open(root_db(folder).kvstore, context=CONTEXT).result()
    txn = ts.Transaction(atomic=True)
    copies: list[Any] = []
    for k in range(processes):
        kv = ts.KvStore.open(process_db(folder, k).kvstore, context=CONTEXT).result()
        if not kv.list(ts.KvStore.KeyRange("digests/", "digests0")).result():
            raise FileNotFoundError(
                f"{folder.url}/{PROCESS_PREFIX}{k} has no fingerprint table: process {k} did not "
                "finish writing its share"
            )
        copies.append(kv.experimental_copy_range_to(root.with_transaction(txn)))
    for c in copies:
        c.result()
    txn.commit_async().result()
