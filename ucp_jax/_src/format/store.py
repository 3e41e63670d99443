"""Where checkpoints live: kvstore URLs, zarr3 array specs with crc32c, chunking, the commit protocol."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import tensorstore as ts

from ..errors import ChecksumError, NotACheckpointError
from ..untrusted.limits import MAX_MANIFEST_BYTES
from ..untrusted.paths import read_together, refuse_symlinks
from ..util.dtypes import zarr_dtype
from . import remote
from .folders import checkpoint_entry, listdir, orbax_mark
from .manifest import COMMIT, MANIFEST, Manifest, SlotInfo

# One context for the whole process, so that `memory://` stores are shared between calls.
CONTEXT = ts.Context(
    {
        "file_io_concurrency": {"limit": 64},
        "data_copy_concurrency": {},
        # B-tree nodes of the aggregated layout's OCDBT databases (format/aggregate.py)
        "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
    }
)
# For writers that make their files durable themselves, all at once (see sync_tree): TensorStore
# then neither fsyncs each file nor waits for it.
DEFERRED_SYNC_CONTEXT = ts.Context({"file_io_sync": False}, CONTEXT)

MAX_SHARD_BYTES = 256 << 20  # one file never holds more than this
# Version 3 (aggregated) shards are values in a process's OCDBT data files, encoded here and handed
# to TensorStore as one bytes value each, which it copies: values over glibc's largest dynamic
# mmap threshold (32 MiB) get fresh pages for every copy (page faults: 0.9 GB/s into TensorStore
# at 32 MiB, 3.7 GB/s at 8 MiB, here). At most this many bytes a shard keeps them reused.
AGGREGATED_SHARD_BYTES = 8 << 20
INNER_CHUNK_BYTES = 1 << 20  # inner chunks (unit of partial reads and checksums) hold at most this
MIN_INNER_CHUNK_BYTES = 64 << 10  # ... and, when they split a shard at all, at least this
RESTORE_SPLITS = (8, 4, 2)  # a restore that splits any axis by one of these reads whole chunks
_BYTES = [{"name": "bytes", "configuration": {"endian": "little"}}]
_CODECS: list[dict[str, Any]] = [*_BYTES, {"name": "crc32c"}]


@dataclasses.dataclass(frozen=True)
class Location:
    """A checkpoint directory as a TensorStore kvstore spec (any URL: file, gs, s3, memory).

    Accepted wherever a checkpoint path is (`ucp.save`, `ucp.restore`, `ucp.open`, ...), as is
    its kvstore spec as a dict: `ucp.Location({"driver": "s3", "bucket": "b", "path": "run/step_1",
    "endpoint": "http://127.0.0.1:9000"})`. See docs/object-stores.md.
    """

    kvstore: dict[str, Any]
    # The TensorStore context its kvstores and arrays open in (None: the process-wide CONTEXT).
    # The aggregated layout gives each save and each opened checkpoint its own (fresh caches).
    context: ts.Context | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, path: Any) -> Location:
        """Accept a local path, any TensorStore kvstore URL, a kvstore spec (a dict or JSON text
        starting with `{`) or a Location; s3 and gs specs are completed from the environment.

        >>> Location.parse("memory://ckpt/step_1").kvstore
        {'driver': 'memory', 'path': 'ckpt/step_1/'}
        >>> Location.parse('{"driver": "memory", "path": "ckpt/step_2"}').url
        'memory://ckpt/step_2'
        >>> Location.parse("memory://ckpt//step_3/").kvstore["path"]
        'ckpt/step_3/'
        """
        spec = remote.spec_of(path)  # a dict, JSON text or Location
        if spec is not None:
            spec = ts.KvStore.Spec(spec).to_json()  # validated and normalised
        else:
            s = os.fspath(path)
            if "://" not in s:
                spec = {"driver": "file", "path": os.path.abspath(os.path.expanduser(s))}
            else:
                spec = ts.KvStore.Spec(s).to_json()
        folder = spec.get("path", "")
        if spec.get("driver") != "file":  # one folder per name, as on a local disk: a root with
            folder = re.sub("/{2,}", "/", folder).lstrip("/")  # a slash + "/step_1" is root/step_1
        folder = folder.rstrip("/")
        # a bucket's top: the empty path (not "/", under which nothing is listed)
        spec["path"] = folder + "/" if folder or spec.get("driver") == "file" else ""
        return cls(remote.complete(spec))

    @property
    def remote(self) -> bool:
        """Whether the store is reached over the network (s3, gcs, http)."""
        return remote.is_remote(self.kvstore)

    @property
    def local_path(self) -> str | None:
        """The directory on the local file system, or None for other kvstores."""
        return self.kvstore["path"].rstrip("/") if self.kvstore["driver"] == "file" else None

    @property
    def url(self) -> str:
        """Human-readable location for messages (a local folder as its path)."""
        return remote.url_of(self.kvstore)

    def __str__(self) -> str:
        return self.url

    def child(self, rel: str) -> Location:
        """A location below this one."""
        spec = dict(self.kvstore)
        spec["path"] = self.kvstore["path"] + rel.strip("/") + "/"
        return Location(spec, self.context)

    def sibling(self, name: str) -> Location:
        """A location next to this one (same parent)."""
        spec = dict(self.kvstore)
        parent = self.kvstore["path"].rstrip("/").rsplit("/", 1)
        spec["path"] = (parent[0] + "/" if len(parent) == 2 else "") + name + "/"
        return Location(spec, self.context)

    @property
    def name(self) -> str:
        return self.kvstore["path"].rstrip("/").rsplit("/", 1)[-1]

    @property
    def ctx(self) -> ts.Context:
        return CONTEXT if self.context is None else self.context

    def kv(self) -> ts.KvStore:
        """The open kvstore; a remote one answers a first request within `UCP_STORE_TIMEOUT_S`.

        Raises:
            StoreUnreachableError: a remote store that does not answer.
        """
        opening = ts.KvStore.open(self.kvstore, context=self.ctx)
        if not self.remote:
            return opening.result()
        kv = remote.wait(opening, self.kvstore, "the opening of its kvstore")
        remote.probe(kv, self.kvstore)
        return kv

    def _wait(self, future: Any, what: str) -> Any:
        """A small request's result; within `UCP_STORE_TIMEOUT_S` on remote stores."""
        return remote.wait(future, self.kvstore, what) if self.remote else future.result()

    def read(self, key: str) -> bytes | None:
        """The value under `key`, or None when missing."""
        r = self._wait(self.kv().read(key), f"a read of {key!r}")
        return bytes(r.value) if r.state == "value" else None

    def write(self, key: str, data: bytes) -> None:
        self._wait(self.kv().write(key, data), f"a write of {key!r}")

    def delete(self, key: str) -> None:
        """Remove one key (no error when missing)."""
        self._wait(
            self.kv().delete_range(ts.KvStore.KeyRange(key, key + "\0")), f"a delete of {key!r}"
        )

    def list_keys(self, start: str = "", stop: str = "") -> list[str]:
        """The keys under this location (relative to it), all or those in [start, stop) (in
        object stores only those are listed); no deadline: a listing may be long."""
        listing = self.kv().list(ts.KvStore.KeyRange(start, stop))
        try:
            return [k.decode() for k in listing.result()]
        except ValueError as e:
            remote.raise_translated(e, self.kvstore, "a listing")

    def exists(self, key: str) -> bool:
        return self.read(key) is not None

    def has_any(self) -> bool:
        """Whether anything at all is stored under this location."""
        if self.local_path is not None:
            return os.path.exists(self.local_path)
        return bool(self.list_keys())

    def remove_all(self) -> None:
        """Delete everything under this location."""
        if self.local_path is not None:
            shutil.rmtree(self.local_path, ignore_errors=True)
        else:
            self.kv().delete_range(ts.KvStore.KeyRange()).result()


def choose_chunks(
    shape: Sequence[int],
    itemsize: int,
    boundaries: Sequence[set[int]],
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Pick the zarr3 shard shape and inner chunk shape of one stored array.

    Shard files never straddle the boundaries of the regions that different writers own (so no
    two processes ever write one file), and hold at most `max_shard_bytes`. Inner chunks cut every
    axis at the multiples of dim/8 (or dim/4, dim/2: the largest that divides it), so a restore
    that splits any axis by 1, 2, 4 or 8 reads whole inner chunks; they are merged back while
    smaller than MIN_INNER_CHUNK_BYTES and halved while bigger than INNER_CHUNK_BYTES.

    Args:
        shape: the array's shape.
        itemsize: bytes per element.
        boundaries: per axis, the offsets where one writer's region ends and another's begins.
        max_shard_bytes: the most bytes of one shard (AGGREGATED_SHARD_BYTES for version 3).

    Returns:
        (shard shape, inner chunk shape or None when one chunk per file).
    """
    if not shape:
        return (), None
    outer = []
    for dim, cuts in zip(shape, boundaries):
        outer.append(max(math.gcd(int(dim), *map(int, cuts)), 1))  # one C call: cuts can be many
    _halve(outer, itemsize, max_shard_bytes)
    if math.prod(outer) * itemsize <= MIN_INNER_CHUNK_BYTES:
        return tuple(outer), None
    inner = []
    for dim, o in zip(shape, outer):
        split = next((k for k in RESTORE_SPLITS if dim % k == 0), 1)
        inner.append(math.gcd(o, int(dim) // split))
    _merge_up(inner, outer, itemsize, MIN_INNER_CHUNK_BYTES)
    _halve(inner, itemsize, INNER_CHUNK_BYTES)
    return tuple(outer), (tuple(inner) if inner != outer else None)


def _merge_up(chunk: list[int], outer: Sequence[int], itemsize: int, floor: int) -> None:
    """Double the least-cut axis while the chunk is under `floor` bytes (staying a divisor)."""
    while math.prod(chunk) * itemsize < floor:
        grow = [j for j, c in enumerate(chunk) if outer[j] % (2 * c) == 0]
        if not grow:
            return
        j = min(grow, key=lambda a: outer[a] // chunk[a])
        chunk[j] *= 2


def _halve(chunk: list[int], itemsize: int, limit: int) -> None:
    while math.prod(chunk) * itemsize > limit:
        even = [j for j, c in enumerate(chunk) if c % 2 == 0]
        if not even:
            return
        j = max(even, key=lambda a: chunk[a])
        chunk[j] //= 2


def array_spec(loc: Location, shape: Sequence[int], info: SlotInfo) -> dict[str, Any]:
    """The TensorStore zarr3 spec of one stored array, with crc32c checksums on every chunk."""
    chunks = list(info.chunks) if shape else []
    if info.inner_chunks is not None:
        codecs: list[dict[str, Any]] = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": list(info.inner_chunks),
                    "codecs": _CODECS,
                    "index_codecs": _CODECS,
                },
            }
        ]
    else:
        codecs = _CODECS
    return {
        "driver": "zarr3",
        "kvstore": loc.child(info.path).kvstore,
        # Write every chunk, zeros too: a missing chunk file then always means a damaged checkpoint.
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "data_type": zarr_dtype(info.dtype),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            "codecs": codecs,
        },
    }


def open_array(
    loc: Location, shape: Sequence[int], info: SlotInfo, *, write: bool = False
) -> ts.TensorStore:
    """Open a stored array; writers trust the manifest's metadata (no read, no race)."""
    return open_array_async(loc, shape, info, write=write).result()


def open_array_async(
    loc: Location, shape: Sequence[int], info: SlotInfo, *, write: bool = False
) -> ts.Future:
    """`open_array` as a future, so that many arrays open concurrently.

    An array in an OCDBT database (the aggregated layout) is read through the caches of the
    context that opened that checkpoint (`aggregate.fresh_context`, one per open): a committed
    database does not change, so its manifest is not asked for again before each read (on an
    object store that was a conditional GET of `manifest.ocdbt` per read: 50-58 of ~350
    requests of a 16-leaf reshard restore, tests/test_listing.py).
    """
    spec = array_spec(loc, shape, info)
    if write:
        return ts.open(spec, assume_metadata=True, context=loc.ctx)
    if loc.kvstore.get("driver") == "ocdbt":
        return ts.open(spec, open=True, context=loc.ctx, recheck_cached=False)
    return ts.open(spec, open=True, context=loc.ctx)


def chunk_key(index: Sequence[int]) -> str:
    """The key of the chunk (shard) file at grid `index`, relative to its array's directory.

    >>> chunk_key((2, 0)), chunk_key(())
    ('c/2/0', 'c')
    """
    return "/".join(["c", *map(str, index)])


def chunk_grid(
    shape: Sequence[int], chunks: Sequence[int]
) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """Every chunk of a regular grid over an array: (grid index, its region as slices).

    A 0-d array has one chunk, an array with an empty axis none.

    >>> [idx for idx, _ in chunk_grid((3, 4), (2, 4))]
    [(0, 0), (1, 0)]
    >>> [box for _, box in chunk_grid((3,), (2,))]
    [(slice(0, 2, None),), (slice(2, 3, None),)]
    """
    if any(int(d) == 0 for d in shape):
        return
    counts = [-(-int(d) // int(c)) for d, c in zip(shape, chunks)]
    for idx in itertools.product(*(range(n) for n in counts)):
        box = tuple(slice(i * c, min((i + 1) * c, d)) for i, c, d in zip(idx, chunks, shape))
        yield tuple(idx), box


def expected_chunk_keys(shape: Sequence[int], info: SlotInfo) -> set[str]:
    """Keys of every chunk (shard) file a complete stored array has, relative to its directory."""
    return {chunk_key(idx) for idx, _ in chunk_grid(shape, info.chunks)}


def wrap_io_error(e: Exception, where: str) -> Exception:
    """A TensorStore read error as a ChecksumError when it means corrupt or truncated bytes.

    Other errors are returned as they are. `where` names the array for the message.

    >>> type(wrap_io_error(ValueError("DATA_LOSS: Digest mismatch"), "atom 'w'")).__name__
    'ChecksumError'
    """
    msg = str(e)
    # "Not enough data": a truncated chunk file (tensorstore says FAILED_PRECONDITION, not DATA_LOSS)
    # OUT_OF_RANGE: a value or byte range past the end of its (truncated, swapped) data file;
    # in an OCDBT database (format version 3) a missing data file or an undecodable B-tree node
    # means the same (network errors say UNAVAILABLE, DEADLINE_EXCEEDED, ...: not these).
    ocdbt = "OCDBT" in msg or "ocdbt" in msg
    if "NOT_FOUND" in msg and ("Byte range" in msg or ocdbt):  # a data file a B-tree names
        return ChecksumError(
            f"{where}: a data file of the checkpoint is missing ({msg}); the checkpoint is "
            "incomplete (a file or folder was deleted or not copied): copy it again whole or "
            "restore an earlier checkpoint"
        )
    if (
        "Digest mismatch" in msg
        or "checksum" in msg.lower()
        or "DATA_LOSS" in msg
        or "Not enough data" in msg
        or "OUT_OF_RANGE" in msg
        or (ocdbt and any(c in msg for c in ("FAILED_PRECONDITION", "INVALID_ARG")))
        or "Error decoding" in msg  # an OCDBT manifest or B-tree node that does not decode
        or "Configuration mismatch" in msg  # an OCDBT database replaced under its reader
    ):
        return ChecksumError(
            f"{where}: stored bytes fail their crc32c checksum ({msg}); the checkpoint is "
            "corrupt: restore an earlier checkpoint"
        )
    return e


def committed_below(folder: str, names: list[str], depth: int = 2, limit: int = 64) -> list[str]:
    """Folders under `folder` (at most `depth` levels down, `limit` entries a level) holding a
    committed checkpoint: a CheckpointManager's `<step>/<item>` saved by ucp's handler."""
    out = []
    for name in sorted(names)[:limit]:
        sub = os.path.join(folder, name)
        if os.path.isfile(os.path.join(sub, COMMIT)):
            out.append(sub)
        elif depth > 1 and os.path.isdir(sub) and not os.path.islink(sub):
            with contextlib.suppress(OSError):
                out += committed_below(sub, os.listdir(sub), depth - 1, limit)
    return out


def load_manifest(loc: Location) -> Manifest:
    """Read the manifest of a committed checkpoint.

    Raises:
        NotACheckpointError: nothing there, or a save that never committed.
    """
    local = loc.local_path  # local: both read through one folder handle (old pair or new pair)
    if local is not None and os.path.exists(local) and not os.path.isdir(local):
        raise NotACheckpointError(f"{local}: a file, not a checkpoint (a checkpoint is a folder)")
    marker, data = (read_together(local, (COMMIT, MANIFEST), MAX_MANIFEST_BYTES) if local
                    else (loc.read(COMMIT), None))  # fmt: skip
    if marker is None:
        hint = "no such checkpoint"
        names = listdir(local) if local is not None else []
        mark = orbax_mark(names)
        bare = local is not None and os.path.isdir(local) and not any(map(checkpoint_entry, names))
        # the checkpoints in it: a CheckpointManager's step (of ucp items) or its root
        below = committed_below(local, names) if local is not None and (mark or bare) else []
        listed = ", ".join(below[:3]) + (f", ... ({len(below)})" if len(below) > 3 else "")
        if mark and below:
            hint = f"an Orbax step ({mark}) whose items are universal checkpoints: {listed}"
        elif mark:
            hint = (f"an Orbax checkpoint ({mark}), not a universal one; import it with "
                    "`ucp convert orbax` (ucp.import_orbax)")  # fmt: skip
        elif bare:
            hint = "a folder that holds no checkpoint (no manifest.json, no COMMIT)"
            if below:
                hint += f"; these folders in it are checkpoints: {listed}"
        elif loc.has_any():
            hint = "a save to it did not finish (no COMMIT marker); it is not a checkpoint"
        elif loc.local_path is not None and os.path.exists(
            os.path.join(os.path.dirname(loc.local_path), f".{loc.name}.ucp-tmp")
        ):
            hint = "a save to it is in progress or was killed before it committed"
        raise NotACheckpointError(f"{loc.url}: {hint}; pass the path of a committed checkpoint")
    if local is not None:
        for name, what in ((COMMIT, "COMMIT marker"), (MANIFEST, "manifest"),
                           ("atoms", "atoms folder (the arrays of the checkpoint)")):  # fmt: skip
            refuse_symlinks(local, name, what)
    data = loc.read(MANIFEST) if local is None else data
    if data is None:
        raise NotACheckpointError(f"{loc.url}: COMMIT present but manifest.json missing")
    return Manifest.loads(data, loc.url, marker)


class ArrayHandles(dict[tuple[str, str], Any]):
    """The slots' arrays for TensorStore's array writes, each opened on first use; opening for
    writing trusts the manifest's metadata (no read, nothing to wait for)."""

    def __init__(self, db: Location, slots: dict[tuple[str, str], Any]) -> None:
        super().__init__()
        self.db, self.slots = db, slots

    def __missing__(self, key: tuple[str, str]) -> Any:
        shape, info = self.slots[key]
        arr = self[key] = open_array(self.db, shape, info, write=True)
        return arr


def create_array(loc: Location, shape: tuple[int, ...], info: SlotInfo, txn: Any = None) -> Any:
    """Create a slot's array (the per-array layout, version 2), in transaction `txn` if given."""
    spec = array_spec(loc, shape, info)
    return ts.open(spec, create=True, context=loc.ctx, transaction=txn)
