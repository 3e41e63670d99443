"""Restore a universal checkpoint onto any mesh: each process reads only the regions it needs, once."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from . import read_stats
from .checkpoint import Checkpoint, list_checkpoints, open_checkpoint
from .errors import (
    ChecksumError,
    HostMemoryError,
    MismatchError,
    NotACheckpointError,
    check_inflight_bytes,
)
from .format import direct, read_batches, remote
from .format.manifest import COMMIT, STEP_SLOT
from .format.store import Location, wrap_io_error
from .mapping.binding import PYTHON_NUMBERS, LeafBinding, ReadGroup, bind_state, unbind_state
from .mapping.boxes import box_shape, box_size, index_to_box, relative_slices, to_slices
from .mapping.keys import rewrap
from .mapping.rules import CompiledRules, Rule
from .placement import Placer
from .resolve import ResolvedLeaf, other_optimizer, resolve_leaf
from .save_handle import in_flight
from .util import buffers, config
from .util.dtypes import cast_loss
from .util.gcpause import gc_paused
from .util.inflight import InflightWindow

log = logging.getLogger("ucp_jax")


# ------------------------------------------------------------------------------------ restore


@gc_paused()
def restore(
    path: Any,
    params_target: Any,
    opt_state_target: Any = None,
    *,
    rules: Sequence[Rule] = (),
    cast: bool = False,
    max_inflight_bytes: int | None = None,
) -> tuple[Any, Any]:
    """Restore params (and optax state) onto the layout of the targets, from any saved layout.

    Each process reads only the distinct regions its devices need, each once, straight into the
    target layout (patterns applied per region), and builds the arrays with
    `jax.make_array_from_callback`.

    Args:
        path: a committed universal checkpoint (local path or kvstore URL).
        params_target: pytree of jax.ShapeDtypeStruct with `.sharding` (or concrete arrays).
        opt_state_target: optax state of the same kind, or None.
        rules: (regex, pattern) pairs for the target layout; when empty, the rules recorded at
            save time are used.
        cast: allow converting the stored dtype to the target's (e.g. fp32 master -> bf16).
        max_inflight_bytes: bound on host memory of reads waiting to be placed (default:
            `UCP_INFLIGHT_BYTES`, 1 GiB).

    Returns:
        (params, opt_state) with the targets' tree structures; opt_state is None when no target.
        A checkpoint overwritten while it is read (its COMMIT changed) is read again: the values
        are all the old checkpoint's or all the new one's, never a mix.

    Raises:
        RestorePlanError: the targets do not fit the checkpoint; one error (a MismatchError and a
            PatternError) listing every problem `ucp.plan` finds, raised before any array is read.
        NotACheckpointError: `path` holds no committed checkpoint.
        FormatVersionError: the checkpoint's format version is newer than this reader.
        ChecksumError: a chunk, `zarr.json` or the manifest does not match what was committed.
        StoreUnreachableError: an object store stopped answering the reads (after its retries).

    >>> params, opt_state = ucp.restore("/tmp/ckpt/step_10", abstract_params, abstract_opt)  # doctest: +SKIP
    """
    for attempt in range(_ATTEMPTS):
        try:
            ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
        except NotACheckpointError as e:
            url = Location.parse(path).url
            if in_flight(url):
                raise NotACheckpointError(
                    f"{e}; this process's async_save to {url} has not committed yet: call "
                    "its handle's wait() before restoring"
                ) from e
            raise
        try:
            return _restore(ckpt, params_target, opt_state_target, rules, cast, max_inflight_bytes)
        except ValueError as e:  # an object store that stopped answering: say so, name it
            remote.raise_translated(e, ckpt.loc.kvstore, "the restore's reads")
        except (ChecksumError, NotACheckpointError) as e:
            if isinstance(path, Checkpoint) or not _replaced(ckpt):
                raise
            if attempt + 1 == _ATTEMPTS:
                raise ChecksumError(
                    f"{ckpt.path}: the checkpoint was replaced while it was read, {_ATTEMPTS} "
                    "times in a row (a save overwrites it again and again); restore it when no "
                    f"save is writing it, or restore another step (last: {e})"
                ) from e
            log.warning("ucp.restore: %s was replaced while it was read (%s); reading it again",
                        ckpt.path, e)  # fmt: skip
    raise AssertionError("unreachable")


_ATTEMPTS = 5  # a checkpoint overwritten while it is restored is read again, this many times


def _replaced(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint's COMMIT is not the one it was opened with (an overwrite, or a
    deletion, ran while it was read): its bytes then changed under the reader, and an error is
    no evidence of damage."""
    try:
        return ckpt.loc.read(COMMIT) != ckpt.manifest.marker
    except Exception:
        return False


def _restore(
    ckpt: Checkpoint,
    params_target: Any,
    opt_state_target: Any,
    rules: Sequence[Rule],
    cast: bool,
    max_inflight_bytes: int | None,
) -> tuple[Any, Any]:
    compiled = CompiledRules(rules) if rules else CompiledRules.from_json(ckpt.manifest.rules)
    pbind, obind = bind_state(params_target, opt_state_target, compiled)
    max_inflight_bytes = check_inflight_bytes(max_inflight_bytes, "restore")
    budget = config.inflight_bytes() if max_inflight_bytes is None else max_inflight_bytes
    from .plan_report import build  # every problem in one error, before anything is read

    report = build(ckpt, pbind + obind, compiled if rules else None, cast, budget, account=False)
    report.raise_if_problems()
    if report.unexpected:  # a partial restore (a backbone only), or a leaf left out by mistake
        n = len(report.unexpected)
        log.info("restore %s: %d atom(s) of the checkpoint not read, no target leaf takes them: "
                 "%s%s", ckpt.path, n, ", ".join(report.unexpected[:8]),
                 f" (+{n - 8})" if n > 8 else "")  # fmt: skip
    if other := other_optimizer(ckpt, obind):
        log.warning("restore %s: optimizer state saved by another optax state (%s): its "
                    "statistics may mean something else there; if that was not meant, restore "
                    "params only (opt_state_target=None) and start the optimizer afresh",
                    ckpt.path, "; ".join(other))  # fmt: skip
    # an optax count from per-atom steps (a PyTorch import): resolved again, reading the steps
    # to check that they agree (the plan did not read them); no other leaf reads anything
    resolved = [
        resolve_leaf(ckpt, r.binding, cast) if STEP_SLOT in r.slot_of.values() else r
        for r in report.resolved
    ]
    regions = [
        (r.atom_of[p.atom], r.slot_of[p.atom], p.atom_box)
        for r in resolved
        for g in r.groups
        for p in g.pieces
        if p.atom is not None
    ]
    ckpt.open_arrays([(name, slot) for name, slot, _ in regions])
    ckpt.check_sizes(regions)  # before reading: no file decodes into more than its chunk
    ckpt.locate_shards(regions)  # local folders: shards read directly (format/direct.py)
    stats = read_stats.ReadStats()
    _check_memory(ckpt, resolved, budget)
    try:
        values = _read_all(ckpt, resolved, stats, budget)
    except MemoryError as e:
        raise HostMemoryError(f"{ckpt.path}: a restore buffer could not be allocated ({e}); "
                              f"{_MEMORY_FIX}") from e  # fmt: skip
    ckpt.check_fingerprints(regions)  # the files read are the ones written there, or raise
    read_stats.record(stats)
    values = rewrap(values, [r.binding.key_impl for r in resolved])
    return unbind_state(params_target, opt_state_target, values)


_READS_IN_FLIGHT = 64  # TensorStore's file I/O concurrency: chunk buffers a read holds at once
_MEMORY_FIX = (
    "restore on more processes (each reads only its share), onto accelerators (host copies go "
    "in flight, max_inflight_bytes at a time), free host memory, or raise the limit"
)


def _check_memory(ckpt: Checkpoint, resolved: list[ResolvedLeaf], budget: int) -> None:
    """Before anything is read: this process can allocate what the restore holds at once, the
    restored arrays that stay in host memory (CPU targets) or `budget` of them (accelerators,
    copied to the device as they are read), and the chunk buffers of the reads in flight.

    Raises:
        HostMemoryError: it cannot (past the limit a chunk buffer TensorStore cannot allocate
            ends the process, with no Python exception).
    """
    from .util.dtypes import np_dtype
    from .util.hostmem import allocatable

    host = accel = 0
    for r in resolved:
        n = sum(box_size(g.box) for g in r.groups) * r.binding.dtype.itemsize
        sharding = r.binding.sharding
        on_host = sharding is None or all(
            getattr(d, "platform", "cpu") == "cpu" for d in sharding.device_set
        )
        host, accel = (host + n, accel) if on_host else (host, accel + n)
    chunk = max((math.prod(s.inner_chunks or s.chunks or (1,)) * np_dtype(s.dtype).itemsize
                 for a in ckpt.atoms.values() for s in a.slots.values()), default=0)  # fmt: skip
    held = host + min(accel, budget)
    need = held + min(held, max(BLOCKS_IN_FLIGHT * READ_BLOCK, _READS_IN_FLIGHT * chunk))
    if ckpt.direct_reads():
        need += read_batches.buffer_bytes()  # the reading threads' own buffers
    have = allocatable()
    if have is not None and need > have[0]:
        mib = 1 << 20
        raise HostMemoryError(
            f"{ckpt.path}: this restore needs about {need / mib:.0f} MiB of host memory in this "
            f"process ({held / mib:.0f} MiB of arrays held at once and the chunk buffers of the "
            f"reads in flight), but only {have[0] / mib:.0f} MiB can be allocated under "
            f"{have[1]}; nothing was read: {_MEMORY_FIX}"
        )


def _read_all(
    ckpt: Checkpoint, resolved: list[ResolvedLeaf], stats: read_stats.ReadStats, budget: int
) -> list[Any]:
    """Issue reads leaf by leaf, keeping at most `budget` bytes of host data in flight.

    A leaf bound for accelerators is placed as soon as its reads are done (its transfer overlaps
    the next reads, and its host buffers are freed). A leaf on CPU devices takes its host
    buffers as they are (no copy), so placing it moves no data: those are placed after every
    read is done, when placing no longer competes with the reading threads for the interpreter
    lock (placed during the reads, each placement waited ~5x longer for the lock than it ran).
    """
    out: list[Any] = [None] * len(resolved)
    window: InflightWindow[tuple[int, list[Any]]] = InflightWindow(budget)
    placer = Placer(budget)  # accelerators: staged through pinned host memory (UCP_STAGING)
    # local shards: read in batches by the reading threads (None: everything through TensorStore)
    batcher = read_batches.Batcher() if ckpt.direct_reads() else None
    later: list[tuple[int, dict[Any, np.ndarray]]] = []  # CPU leaves, placed after the reads

    def retire(j: int, issued: list[Any]) -> None:
        r = resolved[j]
        got = _complete(ckpt, r, issued)
        if not isinstance(got, dict):
            out[j] = got
        elif placer.in_place(r.binding.sharding):
            later.append((j, got))
        else:
            out[j] = _place(r, got, placer)

    # a leaf's host regions: one huge-page mapping where together they fill one; consecutive
    # leaves too small for one share a mapping (util/buffers.packs), made at the first of them
    shapes = [[box_shape(g.box) for g in r.groups] for r in resolved]
    pack_of = {k: run for run in buffers.packs([buffers.aligned_bytes(sh, r.binding.dtype)
                                                for sh, r in zip(shapes, resolved)])
               for k in range(*run)}  # fmt: skip
    carved: dict[int, list[np.ndarray]] = {}
    for i, r in enumerate(resolved):
        if i in pack_of and i not in carved:
            run = range(*pack_of[i])
            leaves = [(shapes[k], resolved[k].binding.dtype) for k in run]
            carved.update(zip(run, buffers.aligned_empties_packed(leaves)))
        outs = carved.pop(i, None) or buffers.aligned_empties(shapes[i], r.binding.dtype)
        issued = [_issue(ckpt, r, g, out, stats, batcher) for g, out in zip(r.groups, outs)]
        nbytes = sum(box_size(g.box) for g in r.groups) * r.binding.dtype.itemsize
        for j, iss in window.push((i, issued), nbytes):
            retire(j, iss)
    for j, iss in window.drain():
        retire(j, iss)
    for j, hosts in later:
        out[j] = _place(resolved[j], hosts, placer)
    placer.finish()
    stats.bytes_staged = placer.staged_bytes
    return out


def _issue(
    ckpt: Checkpoint,
    r: ResolvedLeaf,
    g: ReadGroup,
    out: np.ndarray,
    stats: read_stats.ReadStats,
    batcher: read_batches.Batcher | None,
) -> tuple[np.ndarray, list[tuple[Any, Any, Any]]]:
    """Start filling the region `g.box` of leaf `r.binding` into `out` (an uninitialised buffer
    of its shape): (out, pending pieces).

    A piece stored with the leaf's dtype is read by TensorStore directly into its place in the
    buffer (through a view in the atom's axis order); others are read and converted on finish.
    Padding is zero-filled here.
    """
    b = r.binding
    stats.bytes_needed += box_size(g.box) * b.dtype.itemsize
    pending: list[tuple[Any, Any, Any]] = []
    for p in g.pieces:
        rel = relative_slices(p.leaf_box, g.box)
        if p.atom is None:
            stats.bytes_padding += box_size(p.leaf_box) * b.dtype.itemsize
            out[rel] = 0
            continue
        name, slot = r.atom_of[p.atom], r.slot_of[p.atom]
        shape, dtype = ckpt.stored(name, slot, leaf=b.name)
        itemsize = dtype.itemsize
        stats.bytes_read += box_size(p.atom_box) * itemsize
        stats.reads += 1
        sinfo = ckpt.atoms[name].slots[slot]
        stats.bytes_chunks += read_stats.chunk_bytes_touched(
            p.atom_box, shape, sinfo.inner_chunks or sinfo.chunks, itemsize
        )
        if dtype == b.dtype:
            whole_trailing: tuple[Any, ...] = (*rel, ...)
            dst = p.leaf_to_atom(out[whole_trailing])
            if np.may_share_memory(dst, out):  # a view: no reshape copy was needed
                if batcher is not None:
                    fut = _read_direct(ckpt, name, slot, (shape, dtype), p.atom_box, dst, batcher)
                    pending.append((p, fut, None))
                    continue
                arr = ckpt.array(name, slot, leaf=b.name)
                try:
                    view = ts.array(dst, copy=False, write=True)
                except (ValueError, TypeError):
                    pass
                else:
                    src = arr[to_slices(p.atom_box)]
                    pending.append((p, _write_in_blocks(view, src, itemsize), None))
                    continue
        arr = ckpt.array(name, slot, leaf=b.name)
        pending.append((p, arr[to_slices(p.atom_box)].read(), rel))
    return out, pending


READ_BLOCK = 16 << 20  # a large piece is read in row blocks of about this many bytes ...
BLOCKS_IN_FLIGHT = 4  # ... at most this many at once


class _AllOf:
    """The futures of one piece's block reads, waited for together."""

    def __init__(self, futures: list[Any]) -> None:
        self.futures = futures

    def result(self) -> None:
        for f in self.futures:
            f.result()


def _write_in_blocks(view: Any, src: Any, itemsize: int) -> Any:
    """`view.write(src)`, in row blocks of about READ_BLOCK bytes, BLOCKS_IN_FLIGHT at a time.

    TensorStore reads the byte ranges of one read into one buffer (adjacent ranges merged):
    read whole, a piece of a 256 MiB shard file would hold a second 256 MiB copy while it is
    decoded into its place. In blocks, what is held besides the restored arrays stays bounded.
    """
    shape = tuple(view.shape)
    rows = max(READ_BLOCK // max(math.prod(shape[1:]) * itemsize, 1), 1)
    if not shape or shape[0] <= rows:
        return view.write(src)
    src = src.translate_to[0]
    futures: list[Any] = []
    for r in range(0, shape[0], rows):
        if len(futures) >= BLOCKS_IN_FLIGHT:
            try:
                futures[-BLOCKS_IN_FLIGHT].result()
            except ValueError:
                break  # its error is raised where the piece is waited for
        end = min(r + rows, shape[0])  # TensorStore does not clip a slice to the domain
        futures.append(view[r:end].write(src[r:end]))
    return _AllOf(futures)


def _read_direct(
    ckpt: Checkpoint,
    name: str,
    slot: str,
    stored: tuple[Any, np.dtype],
    box: Any,
    dst: np.ndarray,
    batcher: read_batches.Batcher,
) -> read_batches.Pieces:
    """Read `box` of a local atom slot (of `stored` shape and dtype) into `dst` with positioned
    reads (format/direct.py); a shard that reader does not take is read by TensorStore (the
    array opened then)."""
    si = ckpt.atoms[name].slots[slot]
    lay = direct.Layout(tuple(stored[0]), si.chunks, si.inner_chunks, stored[1], si)

    def through_tensorstore(part: Any, out: np.ndarray) -> None:
        arr = ckpt.array(name, slot)
        out[...] = arr[to_slices(part)].read().result()

    locate = lambda index: ckpt.shard_extent(name, slot, index)  # noqa: E731
    return batcher.submit(locate, lay, box, dst, through_tensorstore, ckpt.fingerprints_seen)


def _complete(
    ckpt: Checkpoint, r: ResolvedLeaf, issued: list[tuple[np.ndarray, list[tuple[Any, Any, Any]]]]
) -> Any:
    """Wait for a leaf's reads: its host regions (box -> buffer) for a sharded leaf, else the
    value itself (a host leaf)."""
    b = r.binding
    hosts: dict[Any, np.ndarray] = {}
    for g, (out, pending) in zip(r.groups, issued):
        for p, fut, rel in pending:
            if rel is None:
                _result(ckpt, b, p.atom, fut)
            else:
                out[rel] = _converted(b, r.atom_of[p.atom], r.slot_of[p.atom],
                                      p.atom_to_leaf(_result(ckpt, b, p.atom, fut)))  # fmt: skip
        if b.sharding is None:
            if isinstance(b.value, PYTHON_NUMBERS):  # a Python number: its type
                return type(b.value)(out[()].item())
            return out if isinstance(b.value, np.ndarray) or b.shape else out[()]
        out.flags.writeable = False  # it may now back device buffers (CPU places it in place)
        hosts[g.box] = out
    return hosts


def _converted(b: LeafBinding, atom: str, slot: str, value: np.ndarray) -> np.ndarray:
    """A piece stored in another dtype than its leaf's (`cast=True`), refused where the cast
    would lose a value rather than round it (`cast_loss`)."""
    loss = cast_loss(value, b.dtype)
    if loss is not None:
        raise MismatchError(
            f"restore: leaf {b.name!r}: atom {atom!r} slot {slot!r}, stored as "
            f"{value.dtype.name}, {loss}; cast=True rounds values but does not lose them: "
            f"restore it into a target of dtype {value.dtype.name} (a numpy target keeps 64-bit "
            "types when JAX's are off) or of a type that holds its values",
            leaf=b.name,
            kind="dtype",
        )
    return np.real(value) if value.dtype.kind == "c" and b.dtype.kind != "c" else value


def _place(r: ResolvedLeaf, hosts: dict[Any, np.ndarray], placer: Placer) -> Any:
    """The leaf's global array, each device's shard from its host region."""
    b = r.binding
    assert b.sharding is not None
    return placer.place(
        b.shape, b.sharding, lambda index: hosts[index_to_box(index, b.shape)], b.dtype
    )


def _result(ckpt: Checkpoint, b: LeafBinding, atom: str | None, fut: Any) -> Any:
    try:
        return fut.result()
    except ValueError as e:
        raise wrap_io_error(e, f"{ckpt.path}: leaf {b.name!r} atom {atom!r}") from e


__all__ = ["Checkpoint", "NotACheckpointError", "list_checkpoints", "open_checkpoint", "restore"]
