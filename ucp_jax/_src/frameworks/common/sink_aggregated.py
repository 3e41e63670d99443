"""Format version 3 for importers (the default): every array in one OCDBT database, as `ucp.save`.

An import is one writing process: its arrays and chunks go to `ocdbt.p0/` under the staging
folder (`aggregate.process_db`), its fingerprint table to `digests/p0.json` in that database, and
`commit.Staging.commit` merges it into the root database before the manifest and COMMIT, exactly
as for a save (see format/aggregate.py). Writes go into TensorStore transactions of about a quarter
of the in-flight budget; a transaction is committed (its chunks written as one data file) once it
is that full and every shard it touched is whole, so a shard file is written once, not rewritten
by the next transaction; up to MAX_COMMITTING transactions write their data files while the next
one fills, as long as what they hold and the next one's share stay within the budget (a transaction
as large as the budget, one shard of 32 MiB under a smaller budget, lands before the next fills).
Local data files are written without an fsync each: as each transaction lands, the
writeback of its new data files starts, and a background thread fingerprints its shards (their
pages still hot) and then waits for that writeback and drops the pages (`durable.settle_file`: hot
pages are recycled instead of fresh memory taken for every byte written, which is most of the cost
of writing on a VM); one `durable.sync_tree` pass over the database makes everything durable before
the table is final and COMMIT is written.

With `encode_shards` (an importer's choice: `AtomWriter(encode_whole_shards=True)`), a write that
covers whole shards is encoded here, as a save does (format/encode.py: hardware CRC32C, the
fingerprint known, nothing read back), on a thread of its own into reused buffers, and handed to
the open transaction as raw values in the order written. TensorStore does not order a raw value
and an array write of the same shard within one transaction (its chunk's pending writes are
applied where the first of them was), so a write of the other kind to a shard the open
transaction already holds commits that transaction first.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import tensorstore as ts

from ...format import aggregate, durable, encode, integrity, process_tables, store, zarr_json
from ...format.manifest import SlotInfo
from ...mapping.boxes import Box, to_slices
from .write_order import WriteOrder

TXN_SHARE = 4  # a transaction is committed once it holds budget / TXN_SHARE bytes and every
# shard it touched is whole, or once it holds the whole budget (a shard left open is rewritten)
ENCODING = 2  # regions of whole shards encoded ahead (each at most writer.IMPORT_SHARD_BYTES)
ENCODE_BUFFERS = 2 * ENCODING + 1  # encoded shards held at most: those ahead, one more, the pool
MAX_COMMITTING = 2  # transactions writing their data files while the next one fills (at most:
# their bytes and the next one's budget / TXN_SHARE stay within the budget)
SETTLE_MIN_BYTES = 1 << 20  # data files smaller than this (B-tree nodes, small values) stay cached

Shard = tuple[str, tuple[int, ...]]  # (array path, shard grid index)
Fingerprints = dict[str, dict[str, str]]  # array path -> chunk key -> fingerprint
Landing = tuple[Any, set[Shard], int, Fingerprints]


class _Closed:
    """A transaction closed to new writes: committed once the shards it sent to be encoded are
    in it (`pending` of them are not yet)."""

    __slots__ = ("creating", "pending", "raw", "staged", "touched", "txn")

    def __init__(self, txn: Any, kv: Any) -> None:
        self.txn = txn
        self.touched: set[Shard] = set()
        self.staged = 0
        self.raw = encode.RawWriter(kv)  # its raw shards' writes (`raw.known`: their fingerprints)
        self.raw.bind(txn)
        self.creating: list[Any] = []
        self.pending = 0


class AggregatedSink:
    """Where an `AtomWriter` of format version 3 puts its arrays (this process: `p0`)."""

    version = aggregate.AGGREGATED_VERSION

    def __init__(self, target: store.Location, budget: int, *, encode_shards: bool = False) -> None:
        self.target = target
        self.local = target.local_path
        self.budget = max(int(budget), 1)
        ctx = aggregate.fresh_context(deferred_sync=self.local is not None)
        self.db = aggregate.process_db(target, 0, ctx)
        self._base: dict[str, Any] = {}  # array path -> array (no transaction; writes bind it)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._txn = ts.Transaction()
        self._bound: dict[str, Any] = {}  # array path -> array bound to the open transaction
        self._dirty = False
        self._staged = 0  # bytes written into the open transaction
        # (write future, its source, bytes) until copied: a transaction commits once its copies
        # are done (TensorStore waits for them), so committing does not wait here
        self._copies: collections.deque[tuple[Any, Any, int]] = collections.deque()
        self._copying = 0  # bytes of sources not copied yet
        self._order = WriteOrder()  # a write overlapping one still copying waits for it
        self._touched: set[Shard] = set()  # shards the open transaction writes into
        # With `encode_shards`, whole shards are encoded here (hardware CRC32C, fingerprint known)
        # and written as raw values into the open transaction; the rest through TensorStore's
        # array write.
        self._encodes = encode_shards and encode.available()
        self._kv = self.db.kv()
        self._raw_open: set[Shard] = set()  # shards the open transaction writes raw
        # Encoding runs on a thread of its own (its copies and checksums release the GIL) while
        # this thread hands earlier shards to TensorStore (a copy that holds the GIL), in order,
        # each into the transaction that was open when it was written; a transaction closed
        # meanwhile commits once its last shard is in (`_pump`):
        # (future of the encoded shards, the array's slot info, its transaction's record)
        self._encoder: ThreadPoolExecutor | None = None
        self._pool = encode.BufferPool(ENCODING)
        self._encoding: collections.deque[tuple[Future[Any], SlotInfo, _Closed]] = (
            collections.deque()
        )
        self._open = _Closed(self._txn, self._kv)  # the open transaction's record
        self._closed: collections.deque[_Closed] = collections.deque()
        self._left: dict[Shard, int] = {}  # elements of a shard not written yet (when > 0)
        # (commit future, shards it wrote, bytes it holds, fingerprints of its raw shards) of the
        # transactions landing
        self._committing: collections.deque[Landing] = collections.deque()
        self._landing = 0  # bytes the landing transactions hold
        self._creating: list[Any] = []  # array creations of the open transaction
        self._infos: dict[str, SlotInfo] = {}
        # array path -> chunk key -> fingerprint taken after the chunk's last write landed
        self._fps: Fingerprints = {}
        self._files = (os.path.join(self.local, f"{aggregate.PROCESS_PREFIX}0", "d")
                       if self.local is not None else None)  # fmt: skip
        self._seen: set[str] = set()  # data files already handed to the settler
        self._settler: ThreadPoolExecutor | None = None
        self._settling: collections.deque[Future[None]] = collections.deque()

    # ---------------------------------------------------------------------------- arrays

    def create(self, items: Sequence[tuple[tuple[int, ...], SlotInfo]]) -> None:
        """Create arrays (shape, slot info) in the open transaction.

        Each array's zarr.json (the bytes TensorStore writes for such an array, asked once per
        distinct kind: `zarr_json.zarr_json_bytes`) is written as a value of the open
        transaction: a model's hundreds of arrays cost microseconds each, not a
        `tensorstore.open(create=True)` each on this thread. The destination is this import's
        own fresh database, so nothing is there to collide with. Array handles, for writes that
        go through TensorStore (partial shards), are opened on first use (`array`).
        """
        kv = self._kv.with_transaction(self._txn)
        for shape, info in items:
            self._creating.append(kv.write(f"{info.path}/zarr.json",
                                           zarr_json.zarr_json_bytes(shape, info)))  # fmt: skip
            self._shapes[info.path] = tuple(shape)
            self._infos[info.path] = info
            self._dirty = True

    def array(self, info: SlotInfo) -> Any:
        """A created slot's array (it reads what has landed: see `flush`); opened on first use,
        trusting the metadata written (no read)."""
        arr = self._base.get(info.path)
        if arr is None:
            arr = self._base[info.path] = store.open_array(
                self.db, self._shapes[info.path], info, write=True
            )
        return arr

    # ---------------------------------------------------------------------------- writing

    def write(self, info: SlotInfo, box: Box, data: Any, keep: Any) -> None:
        """Write `data` into `box` of `info`'s array, in the open transaction.

        Whole shards are encoded here and handed over as raw values (`data` is free once this
        returns); other boxes go through TensorStore's array write, which copies `data` in the
        background (`data` and `keep` are held until then). A shard is never written both ways
        in one transaction: the open one is committed first.
        """
        shards = self._shards(info, box)
        if self._encodes and encode.covers_whole_shards(self._shapes[info.path], info, box):
            if not shards.isdisjoint(self._touched - self._raw_open):
                self._commit_open()
            self._order.before(info.path, box)  # an earlier array write of it is copied
            self._encode(info, box, data)
            self._raw_open |= shards
        else:
            if not shards.isdisjoint(self._raw_open):
                self._commit_open()
            self._write_array(info, box, data, keep)
        self._dirty = True
        self._staged += data.nbytes
        self._cover(info, box, shards)
        if self._staged >= self.budget // TXN_SHARE and (
            self._staged >= self.budget or not self._open_shards()
        ):
            self._commit_open()

    def _encode(self, info: SlotInfo, box: Box, data: Any) -> None:
        """Encode whole shards in the background; hand over those encoded, in order."""
        if self._encoder is None:
            self._encoder = ThreadPoolExecutor(1, thread_name_prefix="ucp-encode")
        fut = self._encoder.submit(encode.encode_region, info, box, data, self._pool)
        self._encoding.append((fut, info, self._open))
        self._open.pending += 1
        while len(self._encoding) > ENCODING:
            self._put_encoded()
        self._pump()

    def _put_encoded(self) -> None:
        """Hand the oldest encoded region's shards to its transaction (waiting for them)."""
        fut, info, rec = self._encoding.popleft()
        shards = fut.result()
        rec.raw.put(info, shards)  # TensorStore has copied the values: their buffers are free
        for _, value, _ in shards:
            self._pool.give(value)
        rec.pending -= 1

    def _pump(self, *, wait: bool = False) -> None:
        """Hand over the regions encoded so far (with `wait`: every one), then commit the
        closed transactions that have all their shards."""
        while self._encoding and (wait or self._encoding[0][0].done()):
            self._put_encoded()
        while self._closed and self._closed[0].pending == 0:
            self._land(self._closed.popleft())

    @staticmethod
    def _shards(info: SlotInfo, box: Box) -> set[Shard]:
        """The shards `box` of `info`'s array touches."""
        ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, info.chunks)]
        return {(info.path, idx) for idx in itertools.product(*ranges)}

    def _write_array(self, info: SlotInfo, box: Box, data: Any, keep: Any) -> None:
        arr = self._bound.get(info.path)
        if arr is None:
            arr = self._bound[info.path] = self.array(info).with_transaction(self._txn)
        self._order.before(info.path, box)
        fut = arr[to_slices(box)].write(data)
        self._order.issued(info.path, box, fut.copy)
        self._copies.append((fut, (data, keep), data.nbytes))
        self._copying += data.nbytes
        while self._copies and (self._copies[0][0].copy.done() or self._copying > self.budget):
            self._copied()

    def _cover(self, info: SlotInfo, box: Box, shards: set[Shard]) -> None:
        """Count the elements of each shard `box` writes (`shards`: those it touches; a shard
        is whole at zero left)."""
        shape = self._shapes[info.path]
        chunks = info.chunks
        for key in shards:
            idx = key[1]
            lo_hi = [(i * c, min((i + 1) * c, d)) for i, c, d in zip(idx, chunks, shape)]
            left = self._left.get(key)
            if left is None:
                left = math.prod(b - a for a, b in lo_hi)
            got = math.prod(max(0, min(hi, b) - max(lo, a)) for (lo, hi), (a, b) in zip(box, lo_hi))
            if left - got > 0:
                self._left[key] = left - got
            else:
                self._left.pop(key, None)
            self._touched.add(key)

    def _open_shards(self) -> bool:
        return any(k in self._left for k in self._touched)

    def release_sources(self) -> None:
        """Every write issued so far has been copied out of its source (which may be released);
        the writes land when their transaction commits (see `flush`)."""
        self._pump(wait=True)
        while self._copies:
            self._copied()
        self._order.forget()  # every copy is done

    def _copied(self) -> None:
        """Wait until the oldest write's source is copied; drop it."""
        fut, _, n = self._copies.popleft()
        self._copying -= n
        fut.copy.result()

    def _commit_open(self) -> None:
        """Close the open transaction and open the next one; the closed one commits (in the
        background) once the shards it sent to be encoded are in it."""
        if not self._dirty:
            return
        rec = self._open
        rec.touched, rec.staged, rec.creating = self._touched, self._staged, self._creating
        self._closed.append(rec)
        self._landing += self._staged
        self._txn, self._bound, self._touched, self._creating = ts.Transaction(), {}, set(), []
        self._staged, self._dirty, self._raw_open = 0, False, set()
        self._open = _Closed(self._txn, self._kv)
        self._pump()

    def _land(self, rec: _Closed) -> None:
        """Commit a closed transaction (in the background)."""
        # A shard this transaction shares with one still committing: that one lands first, so
        # the read-modify-write of the shard starts from what it wrote.
        last = max((i for i, (_, keys, *_) in enumerate(self._committing) if keys & rec.touched),
                   default=-1)  # fmt: skip
        for _ in range(last + 1):
            self._retire()
        for opening in rec.creating:
            opening.result()
        self._committing.append((rec.txn.commit_async(), rec.touched, rec.staged, rec.raw.known))
        # The landing transactions hold their bytes until written (and encode them on the way):
        # bounded by count and by bytes, so that the next one's share still fits the budget.
        while len(self._committing) > MAX_COMMITTING or (
            self._committing and self._landing > self.budget - self.budget // TXN_SHARE
        ):
            self._retire()

    def _retire(self) -> None:
        """Wait until the oldest landing transaction has committed; its shards then go to the
        settle thread (fingerprints, writeback)."""
        fut, shards, n, raw_fps = self._committing.popleft()
        self._landing -= n
        fut.result()
        if self._files is None:
            self._record(shards, raw_fps, {})  # the others are read by `finish`
            return
        if self._settler is None:
            self._settler = ThreadPoolExecutor(1, thread_name_prefix="ucp-settle")
        self._settling.append(self._settler.submit(self._fingerprint_and_settle, shards, raw_fps))
        while self._settling and self._settling[0].done():
            self._settling.popleft().result()

    def _record(self, shards: set[Shard], raw_fps: Fingerprints, got: dict[str, str]) -> None:
        """Take a landed transaction's fingerprints, in landing order: those its raw shards
        came with, those read back (`got`, full key -> fingerprint); a shard it wrote with
        neither loses an earlier one (`finish` reads it)."""
        for path, idx in shards:
            key = store.chunk_key(idx)
            fp = raw_fps.get(path, {}).get(key) or got.get(f"{path}/{key}")
            if fp is None:
                self._fps.get(path, {}).pop(key, None)
            else:
                self._fps.setdefault(path, {})[key] = fp

    def _fingerprint_and_settle(self, shards: set[Shard], raw_fps: Fingerprints) -> None:
        """Background: start the writeback of the data files a landed transaction wrote,
        fingerprint the shards it wrote through TensorStore while their pages are hot (raw
        shards came with theirs), then wait for the writeback and drop the pages."""
        assert self._files is not None
        new = sorted(set(store.listdir(self._files)) - self._seen)
        self._seen.update(new)
        paths = [os.path.join(self._files, n) for n in new]
        for path in paths:
            durable.start_writeback(path)
        by_array: dict[str, list[str]] = {}
        for path, idx in shards:
            key = store.chunk_key(idx)
            if key not in raw_fps.get(path, {}):
                by_array.setdefault(path, []).append(f"{path}/{key}")
        items = [(self._infos[p], keys) for p, keys in by_array.items()]
        got = integrity.fingerprints_many(self._kv, items) if items else {}
        self._record(shards, raw_fps, got)
        for path in paths:
            try:
                size = os.path.getsize(path)
            except OSError:  # (gone: nothing to settle)
                continue
            if size >= SETTLE_MIN_BYTES:
                durable.settle_file(path)  # its write error raised: it is not reported twice

    def _stop_encoding(self) -> None:
        for fut, *_ in self._encoding:
            fut.cancel()
        self._encoding.clear()
        if self._encoder is not None:
            self._encoder.shutdown(wait=True)
            self._encoder = None

    def _stop_settling(self) -> None:
        try:
            while self._settling:
                self._settling.popleft().result()
        finally:
            self._settling.clear()
            if self._settler is not None:
                self._settler.shutdown(wait=True)
                self._settler = None

    def flush(self) -> None:
        """Every write issued so far has landed (the open transaction is committed, and every
        transaction has committed) and no longer holds its source."""
        self._commit_open()
        self._pump(wait=True)
        while self._committing:
            self._retire()
        self.release_sources()  # copied before their transactions committed: nothing to wait for

    # ----------------------------------------------------------------------------- finish

    def finish(self, written: dict[SlotInfo, set[str]]) -> None:
        """Land everything, write this process's fingerprint table, then (local files) fsync the
        process database once, before the caller's COMMIT."""
        self.flush()
        self._stop_encoding()
        self._stop_settling()
        process_tables.write_process_table(self.db, written, "p0", known=self._fps)
        if self.local is not None:
            durable.sync_tree(os.path.join(self.local, f"{aggregate.PROCESS_PREFIX}0"))

    def abort(self) -> None:
        """Drop the open transaction and let the committing ones end, quietly."""
        self._creating.clear()
        self._stop_encoding()
        self._order.forget()
        for txn in [rec.txn for rec in self._closed] + [self._txn]:
            with contextlib.suppress(Exception):
                txn.abort()
        self._closed.clear()
        while self._committing:
            with contextlib.suppress(Exception):
                self._retire()
        with contextlib.suppress(Exception):
            self._stop_settling()
