"""Sharded save of a train state into a universal checkpoint: replica-deduplicated, async, atomic."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from .errors import AnotherProcessFailedError, ArgumentError, check_inflight_bytes
from .format import (
    aggregate,
    commit,
    encode,
    ocdbt_index,
    process_tables,
    remote,
    store,
    zarr_json,
)
from .format.durable import EarlySync, sync_landed, sync_tree
from .format.integrity import keys_in_box
from .format.manifest import PER_ARRAY_VERSION, Manifest, SlotInfo, source_header
from .mapping.binding import LeafBinding, WriteTask, bind_state, describe_leaf
from .mapping.boxes import Box, box_size, relative_slices, to_slices
from .mapping.rules import CompiledRules, Rule
from .placement import host_staging
from .save_plan import SavePlan
from .util import config
from .util.dtypes import zarr_dtype
from .util.inflight import InflightWindow
from .util.sync import Rendezvous

log = logging.getLogger("ucp_jax")
_PADDING_WARNED: set[str] = set()  # leaves whose padding held values (logged once a process)
# A version-3 save into local files commits transactions of 1/TXN_PARTS of this process's share
# (at least TXN_MIN, at most budget / TXN_PARTS), of which MAX_COMMITTING may be writing their data
# files at once: several files written in parallel (one writer thread each), little memory held.
# Into an object store, a transaction is a quarter of the budget: each is one object, and a save's
# object count stays 3 + share / (budget / 4) per process (docs/SCALE.md).
TXN_PARTS = 16
TXN_MIN = 4 << 20
REMOTE_TXN_PARTS = 4
MAX_COMMITTING = 4
_SAVE_COUNTER = itertools.count()


def _step_value(step: Any) -> int | None:
    """The step to record: an int, a numpy integer or an integer array of one value (a
    ``TrainState.step``); a float or text is refused rather than rounded."""
    if step is None:
        return None
    if isinstance(step, int) and not isinstance(step, bool) and not -(2**63) <= step < 2**63:
        raise TypeError(f"save: step {step} is beyond int64; a step is an int64 counter")
    a = np.asarray(step)
    if a.size != 1 or a.dtype.kind not in "iu":
        raise TypeError(
            f"save: step must be an integer (an int, or an integer array of one value), found "
            f"{step!r:.60} ({type(step).__name__}, shape {a.shape}); pass int(step) if you mean it"
        )
    return int(a.reshape(()))


def _check_leaves_live(params: Any, opt_state: Any) -> None:
    """Refuse traced leaves (a save inside jit) and deleted ones (donated) before anything."""
    for path, x in jax.tree_util.tree_flatten_with_path((params, opt_state))[0]:
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                f"save: leaf {jax.tree_util.keystr(path)} is a traced value: ucp.save runs "
                "outside jit, grad or vmap; save the arrays the jitted step returns"
            )
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(
                f"save: leaf {jax.tree_util.keystr(path)} was deleted (donated to a jitted step "
                "with donate_argnums?); save the state the step returned, or save before "
                "calling the step"
            )


class SaveJob:
    """One save: the plan (computed identically on every process) and this process's share."""

    def __init__(
        self,
        path: Any,
        params: Any,
        opt_state: Any,
        *,
        step: int | None,
        rules: Sequence[Rule],
        extra: Any,
        overwrite: bool,
        max_inflight_bytes: int | None = None,
        staging: Any = None,
        layout: str | None = None,
    ) -> None:
        self.loc = store.Location.parse(path)
        layout = layout or config.save_layout()
        if layout not in ("aggregated", "per-array"):
            raise ValueError(f"save: layout must be 'aggregated' or 'per-array', not {layout!r}")
        # 'aggregated' (format version 3): one OCDBT database per process, merged at commit;
        # 'per-array' (version 2): one folder per array, one file per chunk (kept for tests).
        self.aggregated = layout == "aggregated"
        # `staging`: another commit protocol with Staging's interface (check, prepare, target,
        # commit); the Orbax handler passes one that writes in place into Orbax's own tmp folder.
        if staging is None:
            staging = commit.Staging(self.loc, overwrite=overwrite)
        self.staging = staging
        max_inflight_bytes = check_inflight_bytes(max_inflight_bytes, "save")
        if max_inflight_bytes is None:
            max_inflight_bytes = config.inflight_bytes()
        self.budget = max_inflight_bytes
        self.seq = next(_SAVE_COUNTER)
        # the same on every process of a job making the same calls (not the path's: a process
        # saving elsewhere is told so by the agreement on the arguments, not left at a barrier)
        self.tag = f"ucp-save-{self.seq}"
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as e:  # (ValueError: a circular reference)
            raise TypeError(f"save: extra must be JSON-serialisable ({e}); pass plain data") from e
        step = _step_value(step)
        _check_leaves_live(params, opt_state)
        compiled = CompiledRules(rules)
        pbind, obind = bind_state(params, opt_state, compiled)
        bindings = pbind + obind
        compiled.check_all_used([b.name for b in bindings])
        for b in bindings:
            if isinstance(b.value, jax.ShapeDtypeStruct):
                raise TypeError(f"save: leaf {b.name!r} is a ShapeDtypeStruct; save real arrays")
            zarr_json.check_storable(zarr_dtype(b.dtype), f"save: leaf {b.name!r}")
        shard_bytes = store.AGGREGATED_SHARD_BYTES if self.aggregated else store.MAX_SHARD_BYTES
        plan = SavePlan(
            self.budget,
            max_shard_bytes=shard_bytes,
            whole_shards_apart=self.aggregated and encode.available(),
        )
        for b in bindings:
            plan.add(b)
        self._host_values = [(b.name, b.value) for b in bindings
                             if not isinstance(b.value, jax.Array)]  # fmt: skip
        self.atoms, self.tasks, self.merged, self.slots = (
            plan.atoms, plan.tasks, plan.merged, plan.slots)  # fmt: skip
        self._shards: dict[int, dict[Any, Any]] = {}  # id(leaf value) -> device -> its shard
        self._staging: dict[Any, Any] = {}  # device -> the sharding its copies to host go to
        atoms = plan.atom_infos()
        self.manifest = Manifest(
            step=step,
            atoms=atoms,
            leaves={b.name: describe_leaf(b) for b in bindings},
            rules=compiled.to_json(),
            source=source_header(
                jax=jax.__version__,
                platform=jax.default_backend(),
                process_count=jax.process_count(),
                device_count=jax.device_count(),
            ),
            extra=extra,
            version=aggregate.AGGREGATED_VERSION if self.aggregated else PER_ARRAY_VERSION,
        )
        self.staging.check()

    # --------------------------------------------------------------------------- device -> host

    def _device_data(self, t: WriteTask) -> Any:
        """This task's region as an array (device slice, or host value)."""
        if t.device is None:
            return np.asarray(t.binding.value)[to_slices(t.box)]
        value = t.binding.value
        index = self._shards.get(id(value))
        if index is None:  # index the shards once per leaf, not one search per task
            index = self._shards[id(value)] = {s.device: s for s in value.addressable_shards}
        shard = index[t.device]
        local = relative_slices(t.box, t.shard_box)
        if t.box == t.shard_box:
            return shard.data
        if t.device.platform == "cpu":
            # The shard is host memory already: slice a view of it instead of running (and
            # compiling) a device slice that copies. Callers copy it where it must not alias.
            return np.asarray(shard.data)[local]
        return shard.data[local]

    def _to_host_async(self, d: Any) -> Any:
        """Start the copy of a task's data to host memory; `np.asarray` of the result takes it.

        Accelerators with pinned host memory (`placement.host_staging`, as restores and
        snapshots) copy into it: one DMA per shard. Otherwise (CPU devices, `UCP_STAGING=none`)
        a copy to pageable host memory is started (`copy_to_host_async`).
        """
        if not isinstance(d, jax.Array):
            return d
        (device,) = d.devices()
        if device not in self._staging:
            self._staging[device] = host_staging(device)
        staged = self._staging[device]
        if staged is None:
            d.copy_to_host_async()
            return d
        return jax.device_put(d, staged)

    def copy_all_to_host(self) -> list[np.ndarray]:
        """Copy this process's whole share to host memory (async saves: the source may change)."""
        datas = [self._to_host_async(self._device_data(t)) for t in self.tasks]
        out = []
        for d in datas:
            h = np.asarray(d)
            if not h.flags.owndata:
                # never alias a device buffer the trainer may donate, nor a numpy leaf it may
                # change in place once the async save has returned
                h = h.copy()
            out.append(h)
        return out

    def _stream(self) -> Iterator[tuple[WriteTask, np.ndarray]]:
        """Copy region by region, prefetching a few ahead (blocking saves)."""
        window: InflightWindow[tuple[WriteTask, Any]] = InflightWindow(self.budget // 2)
        for t in self.tasks:
            d = self._to_host_async(self._device_data(t))
            for t0, d0 in window.push((t, d), t.nbytes):
                yield t0, np.asarray(d0)
        for t0, d0 in window.drain():
            yield t0, np.asarray(d0)

    # --------------------------------------------------------------------------------- writing

    def _write_region(
        self,
        arrays: dict[tuple[str, str], Any],
        b: LeafBinding,
        box: Box,
        data: np.ndarray,
        written: dict[SlotInfo, set[str]],
        base: dict[tuple[str, str], Any] | None = None,
        txn: Any = None,
        raw: encode.RawWriter | None = None,
    ) -> list[Any]:
        """Issue the writes of one region of a leaf (`data`) to its atoms; return the futures.

        With `txn`: `arrays` caches `base`'s arrays bound to that transaction. With `raw`: the
        pieces that cover whole shards are encoded here and written as raw values through `raw`
        (bound to the same transaction), the others through TensorStore's array write.
        """
        futs = []
        for p in b.pieces(box):
            if p.atom is None:  # padding: stored nowhere, so it should hold nothing
                pad = data[relative_slices(p.leaf_box, box)]
                if b.name not in _PADDING_WARNED and np.any(pad != 0):
                    _PADDING_WARNED.add(b.name)
                    log.warning("save: leaf %r holds nonzero values in its padding %s, which no "
                                "atom stores (restored as zeros); if they are real rows, its "
                                "VocabPadded size (the true vocabulary) is too small", b.name,
                                p.leaf_box)  # fmt: skip
                continue
            chunk = p.leaf_to_atom(data[relative_slices(p.leaf_box, box)])
            key = (p.atom, b.slot)
            shape, info = self.slots[key]
            if raw is not None and encode.covers_whole_shards(shape, info, p.atom_box):
                futs += raw.write(info, p.atom_box, np.asarray(chunk))
                written.setdefault(info, set()).update(keys_in_box(p.atom_box, info.chunks))
                continue
            arr = arrays.get(key)
            if arr is None:
                assert base is not None
                arr = arrays[key] = base[key].with_transaction(txn)
            futs.append(arr[to_slices(p.atom_box)].write(chunk))
            written.setdefault(info, set()).update(keys_in_box(p.atom_box, info.chunks))
        return futs

    def write(self, host: Sequence[np.ndarray] | None) -> None:
        """Create arrays (process 0), write this process's share, then commit (process 0).

        A failed save leaves no COMMIT, and (one process) no staging folder behind. An object
        store that stopped answering or refused is said so, naming it (StoreUnreachableError,
        StoreError), for every caller: `save`, `async_save`, the Orbax handlers, the memory
        tier's persist."""
        alone = jax.process_count() == 1
        self._rendezvous = Rendezvous(
            self.tag, ["created", "written", "committed"], AnotherProcessFailedError
        )
        try:
            if not alone:  # (a summary costs a pass over the manifest: only for the others)
                self._rendezvous.agree(self._summary(), ArgumentError)
            try:
                with commit.failing_cleanly(self.staging, self.loc, alone=alone):
                    if self.aggregated:
                        self._write_aggregated(host)
                    else:
                        self._write_per_array(host)
            except (ValueError, NotImplementedError) as e:
                remote.raise_translated(e, self.loc.kvstore, "the save's writes", writing=True)
        # (said as the user sees it, translated above; the others stop at their next barrier)
        except BaseException as e:
            self._rendezvous.fail(e)
            raise

    def _summary(self) -> dict[str, Any]:
        """What every process of a job must agree on: the path, the step, the state's leaves
        (names, shapes, dtypes, layouts), the rules, `extra` and the values of small host leaves
        (numpy, Python numbers: saved from process 0)."""

        def crc(value: Any) -> str:
            return f"{zlib.crc32(json.dumps(value, sort_keys=True, default=str).encode()):08x}"

        small = [
            (n, np.asarray(v)) for n, v in self._host_values if np.asarray(v).nbytes <= 1 << 16
        ]
        values = zlib.crc32(b"".join(n.encode() + a.tobytes() for n, a in small))
        m = self.manifest
        return {"path": self.loc.url, "step": m.step, "leaves": crc(m.leaves),
                "rules": crc(m.rules), "extra": crc(m.extra),
                "values of host leaves (numpy, Python numbers)": f"{values:08x}"}  # fmt: skip

    def _write_per_array(self, host: Sequence[np.ndarray] | None) -> None:
        if jax.process_index() == 0:
            self.staging.prepare()
            creating = {
                key: store.create_array(self.staging.target, shape, info)
                for key, (shape, info) in self.slots.items()
            }
            arrays = {k: f.result() for k, f in creating.items()}
        else:
            arrays = {}
        self._rendezvous.wait("created")
        for key, (shape, info) in self.slots.items():
            if key not in arrays:
                arrays[key] = store.open_array(self.staging.target, shape, info, write=True)
        inflight: InflightWindow[list[Any]] = InflightWindow(self.budget)
        written: dict[SlotInfo, set[str]] = {}  # the chunk files this process writes, per array
        try:
            for b, box, data in self._regions(host):
                futs = self._write_region(arrays, b, box, data, written)
                for fs in inflight.push(futs, box_size(box) * b.dtype.itemsize):
                    _wait_all(fs)
            for fs in inflight.drain():
                _wait_all(fs)
        finally:
            # On an error, let every write already issued land before the error propagates, so
            # that no stale write can reach a retried save's fresh staging area.
            for fs in inflight.drain():
                _wait_all(fs, raise_first=False)
        commit.record_fingerprints(self.staging.target, written, f"p{jax.process_index()}")
        self._commit()

    def _regions(
        self, host: Sequence[np.ndarray] | None
    ) -> Iterator[tuple[LeafBinding, Box, np.ndarray]]:
        """(leaf, box, data) to write, with merged regions assembled into their box."""
        source = zip(self.tasks, host) if host is not None else self._stream()
        for t, data in source:
            group = self.merged.get(id(t))
            if group is None:
                yield t.binding, t.box, data
            elif not group.add(t, data):
                yield t.binding, group.box, group.take()

    def _write_aggregated(self, host: Sequence[np.ndarray] | None) -> None:
        """Format version 3: this process's chunks into its own OCDBT database, in a few
        transactions of at most half the in-flight budget each (a few data files per process)."""
        import tensorstore as ts

        me = jax.process_index()
        # Local files: no fsync per data file; one parallel pass over this process's database
        # before its table is final (see durable.sync_tree), so COMMIT still follows durable data.
        local = self.staging.target.local_path
        ctx = aggregate.fresh_context(deferred_sync=local is not None)
        db = aggregate.process_db(self.staging.target, me, ctx)
        if me == 0:
            self.staging.prepare()
            # Each array's zarr.json as TensorStore writes it (asked once per distinct kind), as
            # values of one transaction: microseconds an array, not a tensorstore.open each.
            txn = ts.Transaction(atomic=True)
            kv = db.kv().with_transaction(txn)
            futs = [kv.write(f"{info.path}/zarr.json", zarr_json.zarr_json_bytes(shape, info))
                    for shape, info in self.slots.values()]  # fmt: skip
            for f in futs:
                f.result()  # recorded in the transaction
            txn.commit_async().result()
        self._rendezvous.wait("created")
        arrays = store.ArrayHandles(db, self.slots)  # opened where a write goes through TensorStore
        written: dict[SlotInfo, set[str]] = {}
        in_txn: dict[tuple[str, str], Any] = {}  # the arrays bound to the open transaction
        # Whole shards are encoded here (hardware CRC32C) and written as raw values in the same
        # transaction; others (shards past the array's edge) through TensorStore's array write.
        raw = encode.RawWriter(db.kv()) if encode.available() else None
        txn_bytes = transaction_bytes(
            sum(t.nbytes for t in self.tasks), self.budget, local=local is not None
        )
        # Transactions of txn_bytes; while one fills, up to MAX_COMMITTING earlier ones
        # are being written (copies overlap the file writes; at most a third of the budget held).
        # Atomic: a transaction is written back as one commit (one data file) when we commit it.
        # A non-atomic one may be written back in parts whenever TensorStore chooses (seen: 8 to
        # 13 files for one 64-leaf save under load, 8 every time atomic).
        txn, staged, committing = ts.Transaction(atomic=True), 0, collections.deque[Any]()
        requested: dict[str, int] = {}  # data file -> its size when its sync was started
        syncs = EarlySync()  # each landed data file made durable while the save goes on
        try:
            if raw is not None:
                raw.bind(txn)
            for b, box, data in self._regions(host):
                futs = self._write_region(in_txn, b, box, data, written, arrays, txn, raw)
                for f in futs:
                    # an array write: its data copied; a raw value's: recorded in the transaction
                    (f.copy if hasattr(f, "copy") else f).result()
                staged += box_size(box) * b.dtype.itemsize
                if committing and committing[0].done():  # landed: its data file to the disk now
                    while committing and committing[0].done():
                        committing.popleft().result()
                    sync_landed(syncs, local, me, requested)
                if staged >= txn_bytes:
                    if len(committing) == MAX_COMMITTING:
                        committing.popleft().result()
                        sync_landed(syncs, local, me, requested)
                    self._still_ours(me)
                    committing.append(txn.commit_async())
                    txn, staged = ts.Transaction(atomic=True), 0
                    in_txn.clear()
                    if raw is not None:
                        raw.bind(txn)
            self._still_ours(me)
            committing.append(txn.commit_async())
            while committing:
                committing.popleft().result()
                sync_landed(syncs, local, me, requested)
            syncs.wait()
        except BaseException:
            # Nothing of the open transaction lands; what earlier ones committed stays in this
            # save's own staging area, which a retry clears (every commit is waited for here).
            with contextlib.suppress(Exception):
                txn.abort()
            for pending in committing:
                with contextlib.suppress(Exception):
                    pending.result()
            with contextlib.suppress(Exception):
                syncs.wait()
            raise
        known = raw.known if raw is not None else {}
        process_tables.write_process_table(
            db, written, f"p{me}", self._extents(local, me, written, known), known=known
        )
        if local is not None:
            sync_tree(os.path.join(local, f"{aggregate.PROCESS_PREFIX}{me}"))
        self._commit()

    @staticmethod
    def _extents(
        local: str | None,
        me: int,
        written: dict[SlotInfo, set[str]],
        known: dict[str, dict[str, str]],
    ) -> dict[str, tuple[str, int, int] | None] | None:
        """Where this process's chunks lie in its local data files (None: not local), for those
        whose fingerprint is not `known` already (array path -> chunk key -> fingerprint)."""
        if local is None:
            return None
        keys = [f"{i.path}/{k}" for i, ks in written.items()
                for k in ks if k not in known.get(i.path, ())]  # fmt: skip
        if not keys:
            return {}
        index = ocdbt_index.OcdbtIndex(os.path.join(local, f"{aggregate.PROCESS_PREFIX}{me}"))
        index.locate([k.encode() for k in keys])
        found = {k: index.found.get(k.encode()) for k in keys}
        return {k: (e.path, e.offset, e.length) for k, e in found.items()
                if e is not None and e.inline is None}  # fmt: skip

    def _still_ours(self, me: int) -> None:
        """Before a transaction lands: this save's claim on the path renewed (object stores)."""
        if me == 0 and hasattr(self.staging, "still_ours"):
            self.staging.still_ours()

    def _commit(self) -> None:
        self._rendezvous.wait("written")
        if jax.process_index() == 0:
            self.staging.commit(self.manifest)
        self._rendezvous.wait("committed")
        self._rendezvous.forget()


def transaction_bytes(share: int, budget: int, *, local: bool = True) -> int:
    """Bytes per transaction (one data file each) of a version-3 save of `share` bytes.

    >>> transaction_bytes(1 << 30, 1 << 30) >> 20, transaction_bytes(1 << 30, 1 << 30, local=False) >> 20
    (64, 256)
    """
    if not local:
        return max(TXN_MIN, budget // REMOTE_TXN_PARTS)
    return max(TXN_MIN, min(budget, share) // TXN_PARTS)


def _wait_all(futs: Sequence[Any], *, raise_first: bool = True) -> None:
    """Wait for every write future (all of them, even after one fails); raise the first error."""
    first: BaseException | None = None
    for f in futs:
        try:
            f.commit.result()
        except BaseException as e:
            first = first or e
    if first is not None and raise_first:
        raise first
