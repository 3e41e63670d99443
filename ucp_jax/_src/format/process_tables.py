"""Format version 3's fingerprint tables: one per process, all arrays it wrote in one object.

Each writing process of an aggregated-layout save or import records the fingerprints (see
`integrity`) of every chunk it wrote in `digests/p<k>.json` of its own OCDBT database
(`{"format": "ucp-digests/2", "writer": "p<k>", "arrays": {path: {key: fingerprint}}}`); readers
merge them and check each against the sha256 sealed in the manifest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import tensorstore as ts

from ..errors import ChecksumError
from ..untrusted.json import read_json
from .integrity import DIGEST_DIR, array_fingerprints, check_sealed, extent_fingerprints
from .manifest import SlotInfo

PROCESS_DIGEST_FORMAT = "ucp-digests/2"


def write_process_table(
    db: Any,
    keys: Mapping[SlotInfo, Iterable[str]],
    writer: str,
    extents: Mapping[str, tuple[str, int, int] | None] | None = None,
    *,
    known: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """Format version 3: the fingerprints of every chunk `writer` wrote, all arrays in one object.

    `db` is the writer's database (a `store.Location`); the table goes to `digests/<writer>.json`
    in it, written even when empty (process 0's merge takes it as the sign the writer finished).
    `extents`: where chunks lie in local data files (full key -> (path, offset, length), see
    format/direct.py); those are fingerprinted with a few `pread`s each. `known`: array path ->
    chunk key -> fingerprint the writer already took (through the database, after the last write
    of that chunk committed). The other chunks are read through OCDBT, all arrays in one batch.
    """
    kv = db.kv()
    known = known or {}
    arrays: dict[str, dict[str, str]] = {}
    todo = []
    for info, ks in keys.items():
        ks = sorted(set(ks))
        if not ks:
            continue
        have = known.get(info.path, {})
        cut = len(info.path) + 1
        full = [f"{info.path}/{k}" for k in ks if k not in have]
        got = extent_fingerprints({k: extents.get(k) for k in full}, info) if extents else {}
        arrays[info.path] = {**{k: have[k] for k in ks if k in have},
                             **{k[cut:]: v for k, v in got.items()}}  # fmt: skip
        todo.append((info, [k[cut:] for k in full if k not in got]))
    for path, fps in array_fingerprints(kv, todo).items():
        arrays[path].update(fps)
    doc = {"format": PROCESS_DIGEST_FORMAT, "writer": writer, "arrays": arrays}
    kv.write(f"{DIGEST_DIR}/{writer}.json", json.dumps(doc, sort_keys=True).encode()).result()


def read_process_tables(
    kv: ts.KvStore, where: str, committed: Mapping[str, str] | None = None
) -> dict[str, dict[str, str]]:
    """Format version 3: every process's table, merged: array path -> chunk key -> fingerprint.

    `committed`: the manifest's `tables` (each table's sha256 is checked against it).

    Raises:
        ChecksumError: a table is unreadable, two tables disagree on a chunk, or one is not the
            one sealed in the manifest.
    """
    from .store import wrap_io_error

    try:
        listed = kv.list(ts.KvStore.KeyRange(DIGEST_DIR + "/", DIGEST_DIR + "0")).result()
    except ValueError as e:
        raise wrap_io_error(e, f"{where}: the fingerprint tables") from e
    names = [k.decode() for k in listed]
    with ts.Batch() as batch:
        futs = [kv.read(k, batch=batch) for k in names]
    results = []
    for name, f in zip(names, futs):
        try:
            results.append(f.result())
        except ValueError as e:
            raise wrap_io_error(e, f"{where}: {name}") from e
    out: dict[str, dict[str, str]] = {}
    for name, r in zip(names, results):
        try:
            doc = read_json(bytes(r.value), f"{where}: {name}", error=ChecksumError)
            ok = (
                isinstance(doc, dict)
                and doc.get("format") == PROCESS_DIGEST_FORMAT
                and isinstance(doc.get("arrays"), dict)
                and all(
                    isinstance(t, dict) and all(isinstance(v, str) for v in t.values())
                    for t in doc["arrays"].values()
                )
            )
        except ChecksumError as e:
            raise ChecksumError(f"{where}: {name} is not a readable fingerprint table ({e})") from e
        if not ok:
            raise ChecksumError(f"{where}: {name} is not a readable fingerprint table; damaged")
        for path, chunks in doc["arrays"].items():
            table = out.setdefault(path, {})
            for k, v in chunks.items():
                if table.setdefault(k, v) != v:
                    raise ChecksumError(
                        f"{where}: two fingerprint tables disagree on {path}/{k}; damaged"
                    )
    check_sealed({n: bytes(r.value) for n, r in zip(names, results)}, committed, "", where)
    return out
