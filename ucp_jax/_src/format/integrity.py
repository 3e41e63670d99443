"""Integrity beyond the per-chunk crc32c: which bytes belong where, and which metadata was committed.

The zarr3 `crc32c` codec proves a chunk's bytes are the bytes written, not that they are the bytes
written *for this position*: two equal-size chunk files swapped (in one array or across arrays)
pass it. So every writer records, per stored array, a **fingerprint** of each chunk file it wrote,
keyed by the file's chunk key, in `<array>/digests/<writer>.json` (`{"array": <path>, "chunks":
{key: fingerprint}}`). A fingerprint is the crc32 of the crc32c values the file already carries
(its own trailer; for a shard file, its index and every inner chunk's trailer), so it is read back
with a few small byte-range reads per file (no second pass over the data) and changes whenever any
byte of the file's content does. Readers compare the fingerprints of the files they read against
the table, after reading them and before returning any value (the small reads then hit the page
cache); a file that moved, or a table that names another array, is a `ChecksumError` naming the
atom, slot and chunk.

Format version 3 (the aggregated layout, `aggregate.py`): chunks are values of an OCDBT
database, and a fingerprint is taken the same way through it (byte-range reads of each value's
tail); each process records every array it wrote in one table, `digests/p<k>.json` in its own
database (`{"format": "ucp-digests/2", "writer": "p<k>", "arrays": {path: {key: fingerprint}}}`,
written and read by `process_tables.py`), so the tables are one object per process, not one per
array.

The tables are tied to the manifest: at commit, process 0 records the sha256 of every table in
it (`Manifest.tables`, key relative to the data root: `digests/p0.json` in version 3,
`atoms/<a>/<slot>/digests/p0.json` in version 2), and readers compare each table they read with
it (`check_sealed`). Since every chunk is checked against its table, a data folder (or a whole
database) swapped in from another save of the same tree is refused, naming the table, although
its `zarr.json` files are the same bytes.

What is not covered: a writer who rewrites a chunk *and* its crc32c *and* the table on purpose.
The checks catch damage and mix-ups, not a forger (that needs signatures, outside this format).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from ..errors import ChecksumError
from ..untrusted.json import read_json
from .manifest import SlotInfo

DIGEST_DIR = "digests"
DIGEST_FORMAT = "ucp-digests/1"
_MISSING = np.uint64(2**64 - 1)


def grid_counts(shape: Sequence[int], chunks: Sequence[int]) -> list[int]:
    """Chunk files per axis of an array (0 along an empty axis)."""
    return [-(-int(d) // int(c)) if d else 0 for d, c in zip(shape, chunks)]


def keys_in_box(box: Sequence[tuple[int, int]], chunks: Sequence[int]) -> list[str]:
    """Chunk keys (`c/i/j`) of the files that hold any element of `box` ((start, stop) per axis).

    >>> keys_in_box([(0, 4), (3, 5)], (2, 2))
    ['c/0/1', 'c/0/2', 'c/1/1', 'c/1/2']
    >>> keys_in_box([], ())
    ['c']
    """
    if any(a >= b for a, b in box):
        return []
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, chunks)]
    import itertools

    return ["/".join(["c", *map(str, idx)]) for idx in itertools.product(*ranges)]


def inner_per_shard(info: SlotInfo) -> int:
    """Inner chunks in one shard file (1 for an unsharded array)."""
    if info.inner_chunks is None:
        return 1
    return math.prod(c // i for c, i in zip(info.chunks, info.inner_chunks))


def _local_dir(kv: ts.KvStore) -> str | None:
    spec = kv.spec().to_json()
    return spec["path"] if spec.get("driver") == "file" else None


def tail_size(info: SlotInfo) -> int:
    """Bytes at the end of a chunk file that a fingerprint starts from: the crc32c trailer, or
    for a shard file its index ((offset, nbytes) per inner chunk) and the index's trailer."""
    return 16 * inner_per_shard(info) + 4 if info.inner_chunks is not None else 4


def trailer_ends(tail: bytes, info: SlotInfo) -> list[int]:
    """End offsets of the inner chunks a shard's index (in `tail`) lists, in index order."""
    index = np.frombuffer(tail[:-4], "<u8").reshape(inner_per_shard(info), 2).tolist()
    missing = int(_MISSING)
    return [off + nb for off, nb in index if off != missing and nb >= 4 and off <= 2**62]


def local_fingerprint(path: str, info: SlotInfo) -> tuple[str, int, int, int] | None:
    """(fingerprint, size, mtime_ns, inode) of one local chunk file, or None if it cannot be opened.

    Writers that drop a file's pages from the cache take it first, while they are hot, and use it
    at commit if the file's size, mtime and inode are still the same (`write_table`'s `known`;
    TensorStore replaces a file by renaming a new one over it, so a rewrite changes the inode).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        return fingerprint_range(fd, 0, st.st_size, info), st.st_size, st.st_mtime_ns, st.st_ino
    finally:
        os.close(fd)


def fingerprint_range(fd: int, base: int, size: int, info: SlotInfo) -> str:
    """The fingerprint of the chunk (shard) whose `size` bytes start at `base` of file `fd`."""
    tail = tail_size(info)
    t = os.pread(fd, tail, base + size - tail) if size >= tail else b""
    return fingerprint_of(t, size, info, lambda end: os.pread(fd, 4, base + end - 4))


def fingerprint_of(
    tail: bytes, size: int, info: SlotInfo, trailer_at: Callable[[int], bytes]
) -> str:
    """The fingerprint of a chunk (shard) of `size` bytes from its `tail` (`tail_size(info)`
    bytes, or b"" when shorter) and `trailer_at(end)`: the 4 bytes before offset `end` of it.

    A reader that has just read a shard's index and its inner chunks' trailers passes what it
    read, instead of reading them a second time (`fingerprint_range` reads them).

    >>> info = SlotInfo(dtype="float32", path="a", chunks=(2,))
    >>> fingerprint_of(b"\\x01\\x02\\x03\\x04", 12, info, lambda end: b"")
    'b63cfbcd'
    """
    crc = zlib.crc32(tail)
    if info.inner_chunks is not None and len(tail) == tail_size(info):
        for end in trailer_ends(tail, info):
            crc = zlib.crc32(trailer_at(end) if end <= size else b"?", crc)
    return f"{crc:08x}"


def extent_fingerprints(
    extents: Mapping[str, tuple[str, int, int] | None], info: SlotInfo
) -> dict[str, str]:
    """Fingerprints of chunks whose bytes lie in local files: key -> (path, offset, length).

    What `fingerprints` computes through the kvstore, read with a few `pread`s per chunk (a
    version-3 checkpoint's values, located by format/direct.py); a key without an extent, or
    whose file cannot be opened, is left out (the caller reads it through the kvstore).
    """
    out: dict[str, str] = {}
    fds: dict[str, int] = {}
    try:
        for key, ext in extents.items():
            if ext is None:
                continue
            path, base, size = ext
            if path not in fds:
                try:
                    fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                                        | getattr(os, "O_CLOEXEC", 0))  # fmt: skip
                except OSError:
                    continue
            out[key] = fingerprint_range(fds[path], base, size, info)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _local_fingerprints(local: str, info: SlotInfo, keys: Iterable[str]) -> dict[str, str]:
    found = {k: local_fingerprint(os.path.join(local, k), info) for k in keys}
    return {k: v[0] for k, v in found.items() if v is not None}


def fingerprints(kv: ts.KvStore, info: SlotInfo, keys: Iterable[str]) -> dict[str, str]:
    """Fingerprint of each chunk file `keys` of one array (its kvstore `kv`); missing: absent.

    Local files: one open and a few preads each. Other kvstores: two rounds of batched byte-range
    reads: each file's tail (trailer, or shard index + its trailer), then each inner chunk's
    4-byte trailer.
    """
    keys = list(keys)
    local = _local_dir(kv)
    if local is not None:
        return _local_fingerprints(local, info, keys)
    return fingerprints_many(kv, [(info, keys)])


def fingerprints_many(
    kv: ts.KvStore, items: Sequence[tuple[SlotInfo, Sequence[str]]]
) -> dict[str, str]:
    """`fingerprints` of the chunks of many arrays of one kvstore (keys relative to `kv`, each
    read with its array's `SlotInfo`), in the same two rounds of batched reads: one batch for
    all of them, not one per array (an OCDBT database then reads its manifest once per round).
    """
    tails: dict[str, bytes] = {}
    with ts.Batch() as batch:
        futs = [(k, kv.read(k, byte_range=slice(-tail_size(info), None), batch=batch))
                for info, keys in items for k in keys]  # fmt: skip
    for k, f in futs:
        try:
            r = f.result()
        except ValueError:  # shorter than its tail: a truncated file
            tails[k] = b""
            continue
        if r.state == "value":
            tails[k] = bytes(r.value)
    reads: dict[str, list[Any]] = {}
    with ts.Batch() as batch:
        for info, keys in items:
            if info.inner_chunks is None:
                continue
            tail = tail_size(info)
            for k in keys:
                t = tails.get(k)
                if t is None or len(t) != tail:
                    continue
                reads[k] = [
                    kv.read(k, byte_range=slice(end - 4, end), batch=batch)
                    for end in trailer_ends(t, info)
                ]
    out = {}
    for k, t in tails.items():
        crc = zlib.crc32(t)
        for f in reads.get(k, []):
            try:
                value = bytes(f.result().value)
            except ValueError:
                value = b"?"
            crc = zlib.crc32(value, crc)
        out[k] = f"{crc:08x}"
    return out


def array_fingerprints(
    kv: ts.KvStore, items: Sequence[tuple[SlotInfo, Sequence[str]]]
) -> dict[str, dict[str, str]]:
    """`fingerprints_many` of chunks named as in their own array (`info.path` inside `kv`):
    array path -> chunk key -> fingerprint (missing chunks absent; arrays without keys unread).
    """
    todo = [(info, [f"{info.path}/{k}" for k in keys]) for info, keys in items if keys]
    got = fingerprints_many(kv, todo) if todo else {}
    out: dict[str, dict[str, str]] = {}
    for info, full in todo:
        cut = len(info.path) + 1
        out.setdefault(info.path, {}).update({k[cut:]: got[k] for k in full if k in got})
    return out


def write_table(
    kv: ts.KvStore | str,
    info: SlotInfo,
    keys: Iterable[str],
    writer: str,
    known: Mapping[str, tuple[str, int, int, int]] | None = None,
    *,
    sync: bool = True,
) -> None:
    """Record the fingerprints of the chunk files `keys` this writer wrote (after they landed).

    `known`: key -> `local_fingerprint` taken earlier (local files); used when the file's size,
    mtime and inode are unchanged, else the fingerprint is taken again. `sync=False`: a local table
    is not fsynced here (the caller syncs the whole tree before COMMIT). `kv` may be the array's
    local folder instead of its kvstore (no kvstore is opened then).
    """
    keys = sorted(set(keys))
    fps: dict[str, str] = {}
    local = kv if isinstance(kv, str) else _local_dir(kv)
    if local is not None and known:
        for k in keys:
            got = known.get(k)
            if got is None:
                continue
            try:
                st = os.stat(os.path.join(local, k))
            except OSError:
                continue
            if (st.st_size, st.st_mtime_ns, st.st_ino) == got[1:]:
                fps[k] = got[0]
    rest = [k for k in keys if k not in fps]
    if local is not None:
        fps.update(_local_fingerprints(local, info, rest))
    elif not isinstance(kv, str):
        fps.update(fingerprints(kv, info, rest))
    if not fps:
        return
    doc = {"format": DIGEST_FORMAT, "array": info.path, "chunks": fps}
    data = json.dumps(doc, sort_keys=True).encode()
    if local is not None:  # a plain file: COMMIT comes after every table is durable
        folder = os.path.join(local, DIGEST_DIR)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{writer}.json"), "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        if sync:
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return
    assert not isinstance(kv, str)
    kv.write(f"{DIGEST_DIR}/{writer}.json", data).result()


def table_digests(kv: ts.KvStore, prefixes: Iterable[str]) -> dict[str, str]:
    """The sha256 of every fingerprint table under each prefix (`""` for a version-3 database,
    `"<array path>/"` for a version-2 array): what `commit.seal` records in the manifest."""
    listings = [
        (p, kv.list(ts.KvStore.KeyRange(f"{p}{DIGEST_DIR}/", f"{p}{DIGEST_DIR}0")))
        for p in prefixes
    ]
    names = sorted(k.decode() for _, f in listings for k in f.result())
    with ts.Batch() as batch:
        futs = [kv.read(k, batch=batch) for k in names]
    out = {}
    for name, f in zip(names, futs):
        r = f.result()
        if r.state == "value":
            out[name] = hashlib.sha256(bytes(r.value)).hexdigest()
    return out


def check_sealed(
    found: Mapping[str, bytes], committed: Mapping[str, str] | None, prefix: str, where: str
) -> None:
    """The fingerprint tables read (`found`: key below `prefix` -> bytes) are the ones whose sha256
    the manifest records (`committed`: key below the data root -> sha256; None: a manifest
    written before they were recorded, nothing to compare).

    Raises:
        ChecksumError: a table missing, added or other than the one sealed, naming it.
    """
    if committed is None:
        return
    want = {k[len(prefix) :]: v for k, v in committed.items() if k.startswith(prefix + DIGEST_DIR)}
    other = (
        "the data beside this manifest.json is another save's (a data folder was replaced "
        "by, or mixed with, another checkpoint's)"
    )
    fix = "restore an earlier checkpoint, or copy this one again whole"
    for name in sorted(set(found) | set(want)):
        if name not in want:
            raise ChecksumError(
                f"{where}: fingerprint table {prefix}{name} is not recorded in manifest.json: "
                f"{other}; {fix}"
            )
        if name not in found:
            raise ChecksumError(
                f"{where}: fingerprint table {prefix}{name} recorded in manifest.json is missing: "
                f"the checkpoint is incomplete or {other}; {fix}"
            )
        got = hashlib.sha256(found[name]).hexdigest()
        if got != want[name]:
            raise ChecksumError(
                f"{where}: fingerprint table {prefix}{name} is not the one sealed in manifest.json "
                f"(sha256 {got[:16]}..., recorded {want[name][:16]}...): {other}; {fix}"
            )


def read_table(
    kv: ts.KvStore,
    info: SlotInfo,
    listing: Iterable[str],
    where: str,
    committed: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The fingerprint table of one array, from every `digests/*.json` in its listing.

    `committed`: the manifest's `tables` (each table's sha256 is checked against it).

    Raises:
        ChecksumError: a table is unreadable, names another array, two tables disagree, or one
            is not the one sealed in the manifest.
    """
    names = sorted(k for k in listing if k.startswith(DIGEST_DIR + "/") and k.endswith(".json"))
    with ts.Batch() as batch:
        futs = [kv.read(k, batch=batch) for k in names]
    results = [f.result() for f in futs]
    table: dict[str, str] = {}
    for name, r in zip(names, results):
        try:
            doc = read_json(bytes(r.value), f"{where}: {name}", error=ChecksumError)
            ok = (
                isinstance(doc, dict)
                and doc.get("format") == DIGEST_FORMAT
                and isinstance(doc.get("chunks"), dict)
                and all(isinstance(v, str) for v in doc["chunks"].values())
            )
        except ChecksumError:
            ok = False
        if not ok:
            raise ChecksumError(f"{where}: {name} is not a readable fingerprint table; damaged")
        if doc.get("array") != info.path:
            raise ChecksumError(
                f"{where}: {name} holds the fingerprints of array {doc.get('array')!r}, not "
                f"{info.path!r}: files were moved between arrays; the checkpoint is corrupt"
            )
        for k, v in doc["chunks"].items():
            if table.setdefault(k, v) != v:
                raise ChecksumError(f"{where}: two fingerprint tables disagree on {k}; damaged")
    found = {n: bytes(r.value) for n, r in zip(names, results) if r.state == "value"}
    check_sealed(found, committed, info.path + "/", where)
    return table


def check(
    kv: ts.KvStore | Callable[[], ts.KvStore],
    info: SlotInfo,
    keys: Sequence[str],
    table: Mapping[str, str],
    where: str,
    extents: Mapping[str, tuple[str, int, int] | None] | None = None,
    known: Mapping[str, str] | None = None,
) -> None:
    """Refuse chunk files whose fingerprint is not the one recorded for their position.

    `kv`: the array's kvstore, or a function that opens it (called only if some chunk is
    neither `known` nor in `extents`); `extents`: where chunks lie in local files (key ->
    (path, offset, length)), read there; `known`: fingerprints taken already (while the chunks
    were read, format/direct.py).

    Raises:
        ChecksumError: a file has no recorded fingerprint, or another one (naming the file).
    """
    missing = [k for k in keys if k not in table]
    if missing:
        raise ChecksumError(
            f"{where}: no fingerprint recorded for chunk file {missing[0]!r} "
            f"({len(missing)} in all); the digests of this array are damaged or missing"
        )
    got = dict(known or {})
    if extents:
        got.update(extent_fingerprints({k: e for k, e in extents.items() if k not in got}, info))
    rest = [k for k in keys if k not in got]
    if rest:
        got.update(fingerprints(kv() if callable(kv) else kv, info, rest))
    for k in keys:
        if got.get(k) != table[k]:
            raise ChecksumError(
                f"{where}: chunk file {k!r} does not hold the bytes written for that position "
                f"(fingerprint {got.get(k, 'missing')}, recorded {table[k]}): it was swapped, "
                "replaced or rewritten; the checkpoint is corrupt: restore an earlier one"
            )
