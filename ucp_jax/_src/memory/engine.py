"""SnapshotManager: asynchronous in-memory snapshots of a train state, in per-node shared memory."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import jax
import numpy as np

from ..errors import in_background
from ..mapping.keys import data_leaves
from ..mapping.rules import Rule
from ..util.at_exit import close_at_exit
from . import copies, persist, recovery
from . import extra as extras
from .layout import SnapshotLayout, make_groups
from .prepared import Prepared, SnapshotStats, plan_snapshot
from .redundancy import copy_out, roll, xor_fill
from .runid import agree_run_id, default_namespace
from .schemes import RedundancyScheme, scheme_for
from .shm import NodeStore, huge_pages, namespace_root

log = logging.getLogger("ucp_jax")


class SnapshotManager:
    """In-memory snapshots of (params, opt_state), kept in shared memory outside the trainer.

    One manager per process; each process is one node. `snapshot()` returns at once: it dispatches
    the device-side copies (and, for redundancy without data-parallel replicas, the exchange) and
    starts the device-to-host copies; a background thread writes this node's share into
    `<shm_dir>/ucp-<namespace>/<process_index>/step_<n>/` and commits it (COMMIT written last).
    The newest `keep` committed snapshots are kept (a snapshot of an earlier step than the newest,
    after a rollback, removes those newer ones); every `persist_every`-th one is also written,
    in the background, as a universal checkpoint `directory_for_persist/step_<n>` from the host
    copy. `restore()` takes the newest step complete (or decodable) on every node, onto any mesh,
    else the newest persisted checkpoint. A manager left open when the script ends is closed
    before the interpreter exits: the snapshot and persist in flight are finished.

    Args:
        directory_for_persist: folder (or kvstore URL) for persisted universal checkpoints, and the
            fallback of `restore()`; None: memory only.
        every: snapshot when `step % every == 0` (other calls return False at once).
        persist_every: persist every this many snapshots (`step % (every * persist_every) == 0`);
            None: never.
        redundancy: None, 'replica' (each node also keeps the previous node of its group's share),
            'xor' (one parity lane per node of a group) or 'rs2' (two, P and Q: any two lost
            nodes of a group rebuilt; docs/fault_tolerance_rs2.md); any of `schemes.SCHEMES`.
        namespace: names the job's shared-memory folder; a restarted job with the same namespace
            reattaches. Default: derived from `directory_for_persist`.
        shm_dir: where namespaces live (default /dev/shm). On a tmpfs mounted with huge pages
            (`huge=within_size` or `huge=advise`) the snapshots are 2 MiB pages and a restore
            maps them ~100x faster than 4 KiB pages; `huge_pages` says which this is.
        keep: committed snapshots kept per node (at least 1).
        group_size: nodes per redundancy group (default 2 for 'replica', up to 4/6 for 'xor'/'rs2');
            at least 2 (3 for 'rs2'), or a ValueError.
        donation_safe: True (default): `snapshot()` makes device-side copies of what it copies
            (one computation per device; on CPU devices it copies into shared memory instead),
            so the caller may donate or delete the arrays as soon as it returns; costs up to
            this node's share of device memory until the host copy is done. False: it holds
            references only; the caller must not donate or delete them before `wait()` or the
            next `snapshot()` returns (for training steps that do not donate their state); no
            device work at all for whole shards, and on CPU devices no work on the caller's
            thread.
        rules: rules for the persisted universal checkpoints (and for restoring them).

    On accelerators, `snapshot()` dispatches the device-side copies and starts their
    device-to-host DMA, which overlaps the next steps; the background thread copies the host
    buffers into shared memory. On CPU devices, device memory is host memory: with
    `donation_safe=True`, `snapshot()` copies this node's share straight into (recycled) shared
    memory before it returns, one memcpy on the training thread, the least a state that the next
    step may overwrite allows; with `donation_safe=False` the background thread does that copy
    while the next steps run. On CPU, restored arrays may map the snapshot's pages directly (no
    copy); such snapshot files are never rewritten in place.

    >>> mgr = ucp.memory.SnapshotManager("/ckpt", persist_every=100, redundancy="replica")  # doctest: +SKIP
    >>> mgr.snapshot(step, params, opt_state)  # doctest: +SKIP
    >>> params, opt_state = mgr.restore(params_target, opt_state_target)  # doctest: +SKIP
    """

    def __init__(
        self,
        directory_for_persist: Any = None,
        *,
        every: int = 1,
        persist_every: int | None = None,
        redundancy: str | None = "replica",
        namespace: str | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        keep: int = 2,
        group_size: int | None = None,
        donation_safe: bool = True,
        rules: tuple[Rule, ...] | list[Rule] = (),
    ) -> None:
        scheme = scheme_for(redundancy)  # a ValueError names the schemes there are
        if int(every) < 1 or int(keep) < 1:
            raise ValueError(f"every ({every}) and keep ({keep}) must be at least 1")
        if persist_every is not None and int(persist_every) < 1:
            raise ValueError(f"persist_every must be at least 1 or None, not {persist_every}")
        if persist_every is not None and directory_for_persist is None:
            raise ValueError("persist_every needs a directory_for_persist")
        self.directory = directory_for_persist
        self.every = int(every)
        self.persist_every = None if persist_every is None else int(persist_every)
        self.redundancy = redundancy
        self.namespace = namespace or default_namespace(directory_for_persist)
        self.root = namespace_root(self.namespace, shm_dir)
        self.keep = int(keep)
        nodes = jax.process_count()
        scheme = scheme or RedundancyScheme()
        if group_size is None:
            group_size = scheme.default_group_size(nodes)
        elif (isinstance(group_size, bool) or not isinstance(group_size, int | np.integer)
              or group_size < (scheme.min_group_size if redundancy else 1)):  # fmt: skip
            least = scheme.min_group_size if redundancy else 1
            raise ValueError(
                f"group_size={group_size!r}: redundancy {redundancy!r} needs groups of at least "
                f"{least} nodes, an integer (a group of one keeps no redundancy for its node); "
                f"leave it None for the default ({scheme.default_group_size(nodes)} here)"
            )
        self.groups = make_groups(nodes, group_size, scheme.min_group_size)
        self.donation_safe = donation_safe
        self.rules = tuple(rules)
        self.node = jax.process_index()
        self.run = agree_run_id()
        self.store = NodeStore(self.root, self.node)
        self.store.ensure()
        self.huge_pages = huge_pages(self.root)
        log.info(
            "ucp.memory: snapshots in %s, %s", self.root,
            "2 MiB pages" if self.huge_pages else
            "4 KiB pages (a tmpfs mounted with huge=within_size restores ~100x faster per GiB)",
        )  # fmt: skip
        self.stats = SnapshotStats()
        self.restored: recovery.RestoreInfo | None = None
        self._cache: dict[Any, Prepared] = {}
        self._lock = threading.Lock()  # the store, pins and errors
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ucp-snap")
        self._persister = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ucp-pers")
        self._inflight: concurrent.futures.Future[Any] | None = None
        self._persisting: concurrent.futures.Future[Any] | None = None
        self._pinned: set[Path] = set()
        close_at_exit(self, "ucp.memory's snapshot and persist in flight")  # (`util.at_exit`)
        self._error: BaseException | None = None
        self._closed = False
        self._restores = 0
        self._plans = 0
        self._extra: Any = None
        self._peers = extras.PeerExchange(f"ucp-memory/{self.namespace}/{self.run}/extra")
        self._fill_s = 0.0
        self._started = 0  # snapshots started: the same count on every process

    # ------------------------------------------------------------------------------- snapshot

    def snapshot(self, step: int, params: Any, opt_state: Any = None, *, extra: Any = None) -> bool:
        """Snapshot the state of `step` (if `step % every == 0`); returns as soon as it is started.

        Waits first for the previous snapshot's host copy (one in flight at a time). Every process
        must call it with the same steps (the redundancy exchange is a collective). `extra`:
        this process's non-tensor state of this step (JSON-able, or bytes such as a data
        loader's state); a restore gives it back as `restored.extra` (see `memory/extra.py`).

        Returns:
            Whether a snapshot was started.

        Raises:
            RuntimeError: an earlier background snapshot or persist failed
                (`AnotherProcessFailedError`: another process's, whose redundancy this one
                keeps; see docs/fault-tolerance.md).
            ValueError: `step` is negative (a snapshot of it could not be found again).
        """
        self._check_open()
        step = int(step)
        if step < 0:
            raise ValueError(
                f"snapshot: step {step} is negative; steps count from 0 (snapshots are found and "
                "ordered by their step)"
            )
        if step % self.every:
            return False
        self._wait_copy()
        self._reraise()
        self._extra = extras.encode(extra)  # read by this snapshot's _fill (after the wait)
        self._started += 1
        snap = f"{self._started}.{step}"  # its name in the exchanges between processes
        t0 = time.perf_counter()
        leaves = data_leaves(params) + data_leaves(opt_state)  # typed PRNG keys: their data
        prep = self._prepare(params, opt_state, leaves)
        rolled: dict[tuple[int, int], jax.Array] = {}
        for shift, lis in prep.rolls.items():
            rolled.update(
                zip(
                    [(li, shift) for li in lis],
                    roll([leaves[li] for li in lis], shift, prep.layout),
                )
            )
        job = None
        if self.persist_every and step % (self.every * self.persist_every) == 0:
            job = persist.make_job(self.directory, step, params, opt_state, self.rules,
                                   self._extra, self._persist_tag(snap))  # fmt: skip
        if prep.host_memory and not self.donation_safe:
            # CPU devices, references held: the background thread waits for the step's outputs
            # and copies them while the next steps are dispatched and run.
            self._inflight = self._copier.submit(
                self._write_views, snap, step, prep, leaves, rolled, job, time.perf_counter() - t0
            )
            return True
        if prep.host_memory:
            # CPU devices, the caller may donate: the state is in host memory that the next step
            # may reuse, so it is copied out now, straight into shared memory: one copy, into
            # recycled pages, instead of a device copy into fresh memory and a second copy; and
            # XORed into the parities now (staging the sources to XOR them in the background
            # costs the step more: docs/fault_tolerance_rs2.md).
            datas = copies.host_views(prep.fetches, leaves, rolled)  # waits for the step's outputs
            t1 = time.perf_counter()
            try:
                writer, copied = self._fill(step, prep, datas, xor_now=True)
            except Exception as e:  # reported like a background failure, on every platform
                self._inflight = self._copier.submit(self._abandon, snap, step, prep, job, e)
                return True
            copy_s = time.perf_counter() - t1
            self._inflight = self._copier.submit(self._finish, snap, step, prep, writer, copied,
                                                 job, time.perf_counter() - t0, copy_s)  # fmt: skip
            return True
        datas = copies.dispatch(prep.fetches, prep.groups, leaves, rolled)
        for d in datas:
            if isinstance(d, jax.Array):
                d.copy_to_host_async()
        dispatch_s = time.perf_counter() - t0
        self._inflight = self._copier.submit(self._write, snap, step, prep, datas, job, dispatch_s)
        return True

    def _prepare(self, params: Any, opt_state: Any, leaves: list[Any]) -> Prepared:
        sig = (
            jax.tree_util.tree_structure(params),
            jax.tree_util.tree_structure(opt_state),
            tuple(
                (
                    type(x),
                    np.shape(x),
                    str(getattr(x, "dtype", type(x))),
                    getattr(x, "sharding", None),
                )
                for x in leaves
            ),
        )
        prep = self._cache.get(sig)
        if prep is None:
            prep = self._cache[sig] = self._plan(params, opt_state)
        return prep

    def _plan(self, params: Any, opt_state: Any) -> Prepared:
        """Plan the snapshots of one state structure (`prepared.plan_snapshot`)."""
        self._plans += 1
        tag = f"ucp-memory/{self.namespace}/{self.run}/plan-{self._plans}/rolls"
        return plan_snapshot(params, opt_state, self.groups, self.redundancy, self.node,
                             self.donation_safe, tag)  # fmt: skip

    def _write_views(self, snap: str, step: int, prep: Prepared, leaves: list[Any],
                     rolled: dict[Any, Any], job: Any, dispatch_s: float) -> None:  # fmt: skip
        """Background: `_write` straight from the CPU buffers of the held arrays."""
        try:
            datas = copies.host_views(prep.fetches, leaves, rolled)
        except BaseException as e:
            self._abandon(snap, step, prep, job, e)
        self._write(snap, step, prep, datas, job, dispatch_s)

    def _write(self, snap: str, step: int, prep: Prepared, datas: list[Any], job: Any,
               dispatch_s: float) -> None:  # fmt: skip
        """Background: copy into this node's shared memory, commit, retire, maybe persist."""
        t0 = time.perf_counter()
        try:
            writer, copied = self._fill(step, prep, datas)
        except BaseException as e:
            self._abandon(snap, step, prep, job, e)
        self._finish(snap, step, prep, writer, copied, job, dispatch_s, time.perf_counter() - t0)

    def _abandon(
        self, snap: str, step: int, prep: Prepared, job: Any, err: BaseException
    ) -> NoReturn:
        """Background: this process's snapshot `snap` failed before it committed. The processes
        that wait for its extra or digest learn it at once (`PeerExchange.fail`), and a persist
        of the step is declined by every process (this one's verdict says why: none persists a
        step some process has no snapshot of). Raises `err` (`snapshot()` raises it next).
        """
        why = f"{type(err).__name__}: {err}"
        with contextlib.suppress(Exception):
            self._peers.fail(prep.layout, self.node, snap, why)
        if job is not None:
            self._start_persist(snap, job, None, prep.layout,
                                f"process {self.node}'s snapshot of step {step} failed ({why})")  # fmt: skip
        raise err

    def _fill(
        self, step: int, prep: Prepared, datas: list[Any], xor_now: bool = False
    ) -> tuple[Any, int]:
        """Begin this node's blob of `step` and copy the fetches' data into it; its redundancy
        area is written now (`xor_now`) or by `_finish` (from `writer.xors`)."""
        layout = prep.layout
        index = {"format": "ucp-mem/1", "step": step, "run": self.run, "plan": layout.digest,
                 "node": self.node, "nbytes": prep.nbytes}  # fmt: skip
        if self._extra is not None:
            index["extra"] = self._extra
        with self._lock:
            self.store.write_plan(layout.digest, prep.text)
            writer = self.store.begin(step, index, prep.nbytes)
            self._pinned.add(writer.path)
        try:
            t0 = time.perf_counter()
            copied, writer.xors = copy_out(writer.blob.array, prep.layout, self.node, prep.fetches,
                                           prep.gaps, datas)  # fmt: skip
            if xor_now:
                xor_fill(writer.blob.array[prep.layout.primary[self.node] :], writer.xors)
                writer.xors = None  # (written: `_finish` must not zero it again)
            self._fill_s = time.perf_counter() - t0
        except BaseException:
            with self._lock:
                self._pinned.discard(writer.path)
            raise
        return writer, copied

    def _finish(self, snap: str, step: int, prep: Prepared, writer: Any, copied: int, job: Any,
                dispatch_s: float, copy_s: float) -> None:  # fmt: skip
        """Background: commit a filled blob, retire old snapshots, maybe persist."""
        t0 = time.perf_counter()
        entry = None
        try:
            # This node's extra goes to its peers from here, not from the training thread (a
            # coordination-service write: 6-7 ms of `snapshot()` measured with 4 processes).
            exchanged = self._peers.publish(prep.layout, self.node, snap, self._extra)
            if writer.xors is not None:  # the redundancy area, unless written on the step
                xor_fill(writer.blob.array[prep.layout.primary[self.node] :], writer.xors)
                writer.xors = None
            self._fill_s += time.perf_counter() - t0
            if exchanged:  # the peers' digests and extras this node keeps
                self._peers.seal(prep.layout, self.node, snap, writer.blob.array)
                writer.index["extra_kept"] = self._peers.kept(prep.layout, self.node, snap)
            with self._lock:
                entry = writer.commit()
                abandoned = sorted({e.step for e in self.store.drop_newer(entry, self._pinned)})
            if abandoned:  # a rollback: the newest snapshot is this one, on every node
                log.warning("ucp.memory: step %d snapshotted after steps %s: the run rolled "
                            "back; those snapshots (and their persisted copies) are removed",
                            step, abandoned)  # fmt: skip
                if self.directory is not None and self.node == 0:
                    persist.remove_steps(self.directory, abandoned)
        except BaseException as e:
            if entry is None:  # not committed: its peers and its persist learn it
                self._abandon(snap, step, prep, job, e)
            raise
        finally:
            with self._lock:
                self._pinned.discard(writer.path)
        copy_s += time.perf_counter() - t0
        self.stats = SnapshotStats(step, prep.nbytes, copied, dispatch_s, copy_s,
                                   sum(map(len, prep.rolls.values())), self._fill_s)  # fmt: skip
        if job is not None:
            with self._lock:
                self._pinned.add(entry.path)
            self._start_persist(snap, job, entry, prep.layout)
        self._retire()

    def _start_persist(self, snap: str, job: Any, entry: Any, layout: SnapshotLayout,
                       failed: str = "") -> None:  # fmt: skip
        """Persist committed snapshot `entry` of `job`'s step in the background, after the
        persist before it (one at a time, in step order); with `failed` (no entry: this
        process's snapshot of the step failed), take part only to decline it on every process."""
        if self._persisting is not None:
            previous, self._persisting = self._persisting, None
            try:
                previous.result()
            except BaseException as e:  # raised by the next snapshot(), as in _reraise
                self._error = self._error or e
        self._persisting = self._persister.submit(self._persist, job, entry, layout,
                                                  self._persist_tag(snap), failed)  # fmt: skip

    def _persist_tag(self, snap: str) -> str:
        """The name of snapshot `snap`'s persist in the exchanges between processes."""
        return f"ucp-memory/{self.namespace}/{self.run}/persist-{snap}"

    def _persist(self, job: Any, entry: Any, layout: SnapshotLayout, tag: str,
                 failed: str = "") -> None:  # fmt: skip
        if entry is None:
            persist.write(job, None, layout, self.node, tag=tag, failed=failed)
            return
        try:
            persist.write(job, self.store.live[entry.path], layout, self.node, entry.crc32, tag)
        finally:
            with self._lock:
                self._pinned.discard(entry.path)
            self._retire()

    def _retire(self) -> None:
        with self._lock:
            self.store.retire(self.keep, set(self._pinned))

    # ------------------------------------------------------------------------------- control

    def _wait_copy(self) -> None:
        f, self._inflight = self._inflight, None
        if f is not None:
            try:
                f.result()
            except BaseException as e:
                self._error = self._error or e

    def _reraise(self) -> None:
        if self._persisting is not None and self._persisting.done():
            f, self._persisting = self._persisting, None
            try:
                f.result()
            except BaseException as e:
                self._error = self._error or e
        if self._error is not None:
            err, self._error = self._error, None
            raise in_background(err, "ucp.memory: a background snapshot/persist failed") from err

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ucp.memory: this SnapshotManager is closed")

    def wait(self) -> None:
        """Block until the snapshot in flight is committed and any pending persist is written.

        Raises:
            RuntimeError: a background snapshot or persist failed (raised once).
        """
        self._wait_copy()
        f, self._persisting = self._persisting, None
        if f is not None:
            try:
                f.result()
            except BaseException as e:
                self._error = self._error or e
        self._reraise()

    def latest_step(self) -> int | None:
        """The step `restore()` would resume from, as this process sees it (no communication).

        The newest step committed (or decodable) on every node of its job, else the newest
        persisted checkpoint's step, else None. The blobs' CRC-32s are checked by `restore`
        only: a step found damaged there is passed over for an older one.
        """
        cands = recovery.candidates(self.root)
        if cands:
            return cands[0].step
        p = recovery.newest_persisted(self.directory)
        return None if p is None else p[1]

    def restore(self, params_target: Any, opt_state_target: Any = None) -> tuple[Any, Any]:
        """Restore the newest recoverable state onto the targets' shardings (any mesh).

        From shared memory if a step is complete or decodable on every node (every process of
        this job must agree; it is a collective), else from the newest persisted universal
        checkpoint (logged as a warning). `self.restored` says which step and from where.

        Args:
            params_target: pytree of jax.ShapeDtypeStruct with `.sharding` (or arrays).
            opt_state_target: the same for the optax state, or None.

        Returns:
            (params, opt_state); opt_state is None without a target.

        Raises:
            NotACheckpointError: nothing in memory and nothing persisted.
            MismatchError: the targets do not match the snapshot's leaves.
        """
        self._check_open()
        self.wait()
        self._restores += 1
        tag = f"ucp-memory/{self.namespace}/{self.run}/restore-{self._restores}"
        params, opt, info = recovery.recover(
            self.root, self.directory, params_target, opt_state_target, self.rules, tag
        )
        # Restored CPU arrays may map these files: never reuse their blobs in place.
        with self._lock:
            self.store.intact.update(Path(f) for f in info.files)
        self.restored = info
        return params, opt

    def close(self) -> None:
        """Finish the snapshot in flight and wait for a pending persist; keep the snapshots.

        Committed snapshots stay in shared memory for a restarted job; `free()` deletes them.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._copier.shutdown(wait=True)
            self._persister.shutdown(wait=True)
            with self._lock:
                self.store.close()

    def free(self, *, all_nodes: bool = False) -> None:
        """Close and delete this node's snapshots (all nodes' of the namespace with all_nodes)."""
        self.close()
        self.store.free()
        if all_nodes:
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SnapshotManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"SnapshotManager({str(self.directory)!r}, namespace={self.namespace!r}, "
            f"node={self.node}, redundancy={self.redundancy!r}, keep={self.keep})"
        )
