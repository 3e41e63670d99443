"""Format version 2 for importers (`UCP_LAYOUT=per-array`): one folder per array, one file per chunk.

Writes are TensorStore writes without a transaction, bounded in bytes; local files are written
without an fsync each, their writeback started as each lands, their pages dropped a few files
later (after a fingerprint is taken while they are hot), and every file and folder is fsynced once
before COMMIT (`durable.sync_tree`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import tensorstore as ts

from ...format import commit, durable, integrity, store
from ...format.manifest import PER_ARRAY_VERSION, SlotInfo
from ...mapping.boxes import Box, to_slices
from ...util.inflight import InflightWindow
from .write_order import WriteOrder

SETTLE_LAG = 8  # files written whose pages stay cached before they are settled (see _settle)


class PerArraySink:
    """Where an `AtomWriter` of format version 2 puts its arrays."""

    version = PER_ARRAY_VERSION

    def __init__(self, target: store.Location, budget: int) -> None:
        self.target = target
        self.local = target.local_path
        # Local files: written without a sync each, their writeback started as each completes,
        # all fsynced once before COMMIT (see durable.sync_tree): durable, without a blocking
        # fsync per file.
        self._context = store.CONTEXT if self.local is None else store.DEFERRED_SYNC_CONTEXT
        self._arrays: dict[str, Any] = {}
        self._written: collections.deque[tuple[str, SlotInfo]] = collections.deque()
        # array path -> chunk key -> fingerprint taken before its pages were dropped
        self._known: dict[str, dict[str, tuple[str, int, int, int]]] = {}
        self._settler: ThreadPoolExecutor | None = None
        self._settling: list[Future[None]] = []
        # (write future, what must stay alive until it lands, (slot, box))
        self._inflight: InflightWindow[tuple[Any, Any, Any]] = InflightWindow(budget)
        self._order = WriteOrder()  # a write overlapping one still copying waits for it

    def create(self, items: Sequence[tuple[tuple[int, ...], SlotInfo]]) -> None:
        """Create arrays (shape, slot info), concurrently."""
        futs = []
        for shape, info in items:
            spec = store.array_spec(self.target, shape, info)
            futs.append((info, ts.open(spec, create=True, context=self._context)))
        for info, fut in futs:
            self._arrays[info.path] = fut.result()

    def array(self, info: SlotInfo) -> Any:
        """The TensorStore array of a created slot (it reads what has landed: see `flush`)."""
        return self._arrays[info.path]

    def write(self, info: SlotInfo, box: Box, data: Any, keep: Any) -> None:
        self._order.before(info.path, box)
        fut = self._arrays[info.path][to_slices(box)].write(data)
        self._order.issued(info.path, box, fut.copy)
        for item in self._inflight.push((fut, (data, keep), (info, box)), data.nbytes):
            self._retire(item)

    def flush(self) -> None:
        """Every write issued so far has landed (and its source may be released)."""
        for item in self._inflight.drain():
            self._retire(item)
        self._order.forget()  # every write has landed

    def release_sources(self) -> None:
        """Every write issued so far no longer reads its source: here, `flush`."""
        self.flush()

    def _retire(self, item: tuple[Any, Any, Any]) -> None:
        fut, _, (info, box) = item
        fut.commit.result()
        if self.local is not None:
            for path in self._shard_files(info, box):
                durable.start_writeback(path)
                self._written.append((path, info))
            self._settle(SETTLE_LAG)

    def _settle(self, lag: int) -> None:
        """Wait for the writeback of all but the newest `lag` files and drop their pages, on a
        background thread (see durable.settle_file)."""
        while len(self._written) > lag:
            if self._settler is None:
                self._settler = ThreadPoolExecutor(1, thread_name_prefix="ucp-settle")
            path, info = self._written.popleft()
            self._settling.append(self._settler.submit(self._fingerprint_and_settle, path, info))
        done = [f for f in self._settling if f.done()]
        for f in done:
            f.result()
            self._settling.remove(f)

    def _fingerprint_and_settle(self, path: str, info: SlotInfo) -> None:
        """Background: fingerprint a written file while its pages are hot, then settle it."""
        found = integrity.local_fingerprint(path, info)
        if found is not None and self.local is not None:
            key = os.path.relpath(path, os.path.join(self.local, info.path))
            self._known.setdefault(info.path, {})[key] = found
        durable.settle_file(path)

    def _stop_settling(self) -> None:
        try:
            for f in self._settling:
                f.result()
        finally:
            self._settling.clear()
            if self._settler is not None:
                self._settler.shutdown(wait=True)
                self._settler = None

    def _shard_files(self, info: SlotInfo, box: Box) -> list[str]:
        """The local shard files a write of `box` into a slot touched."""
        assert self.local is not None
        ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, info.chunks)]
        return [
            os.path.join(self.local, info.path, store.chunk_key(idx))
            for idx in itertools.product(*ranges)
        ]

    def finish(self, written: dict[SlotInfo, set[str]]) -> None:
        """Fingerprint tables of every array, then (local files) one fsync pass over the tree."""
        self.flush()
        if self.local is not None:
            self._settle(0)
            self._stop_settling()
        commit.record_fingerprints(
            self.target, written, "p0", self._known, deferred_sync=self.local is not None
        )  # sync_tree follows
        if self.local is not None:
            durable.sync_tree(self.local)

    def abort(self) -> None:
        """Let every write in flight land (so none reaches a retry's staging area), quietly."""
        self._order.forget()
        for fut, _, _ in self._inflight.drain():
            with contextlib.suppress(Exception):
                fut.commit.result()
        with contextlib.suppress(Exception):
            self._stop_settling()
