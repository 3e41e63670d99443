"""Restore a universal checkpoint onto any mesh: each process reads only the regions it needs, once."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from .checkpoint import Checkpoint, list_checkpoints, open_checkpoint
from .errors import MismatchError, NotACheckpointError, PatternError
from .format.manifest import STEP_SLOT, AtomInfo
from .format.store import wrap_io_error
from .mapping.binding import LeafBinding, ReadGroup, bind_state, read_groups, unbind_state
from .mapping.boxes import box_shape, box_size, index_to_box, relative_slices, to_slices
from .mapping.keys import rewrap
from .mapping.names import legacy_names
from .mapping.patterns import Fused, chain_from_json, fused_marks_to_json
from .mapping.rules import CompiledRules, Rule
from .mapping.stack_count import stack_overrun
from .util import config
from .util.buffers import aligned_empty
from .util.dtypes import np_dtype
from .util.gcpause import gc_paused
from .util.inflight import InflightWindow


@dataclasses.dataclass
class ReadStats:
    """What the last restore in this process read.

    Attributes:
        bytes_needed: bytes of the distinct regions this process's devices need.
        bytes_read: bytes requested from storage (padding is never read).
        bytes_padding: bytes filled with zeros by VocabPadded.
        reads: number of region reads issued.
        bytes_chunks: bytes of the stored chunks those reads touch (storage reads whole chunks;
            more than bytes_read when a region cuts through chunks).
    """

    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_padding: int = 0
    reads: int = 0
    bytes_chunks: int = 0

    @property
    def amplification(self) -> float:
        """bytes_read / (bytes_needed - padding): 1.00 means every needed byte was read once."""
        want = self.bytes_needed - self.bytes_padding
        return self.bytes_read / want if want else 1.0

    @property
    def chunk_amplification(self) -> float:
        """bytes_chunks / bytes_read: 1.00 means every chunk touched was wholly needed."""
        return self.bytes_chunks / self.bytes_read if self.bytes_read else 1.0


def chunk_bytes_touched(box: Sequence[tuple[int, int]], shape: Sequence[int], chunk: Sequence[int],
                        itemsize: int) -> int:  # fmt: skip
    """Bytes of the whole chunks of a regular grid that a box touches."""
    n = itemsize
    for (lo, hi), dim, c in zip(box, shape, chunk):
        if hi <= lo:
            return 0
        n *= min(-(-hi // c) * c, dim) - (lo // c) * c
    return n


_last_stats = ReadStats()


def last_read_stats() -> ReadStats:
    """Read statistics of the last `restore` in this process."""
    return _last_stats


# ------------------------------------------------------------------------------------ restore


@dataclasses.dataclass
class _Resolved:
    """A target leaf checked against the checkpoint: the slot each of its pieces reads."""

    binding: LeafBinding
    groups: list[ReadGroup]
    slot_of: dict[str, str]  # atom -> slot to read (roles may redirect to another atom)
    atom_of: dict[str, str]


def resolve_leaf(ckpt: Checkpoint, b: LeafBinding, cast: bool, *, read: bool = True) -> _Resolved:
    """Check a target leaf against the manifest; `read=False` (plans) never reads an array."""
    if b.sharding is None and isinstance(b.value, jax.ShapeDtypeStruct):
        raise MismatchError(
            f"restore: target leaf {b.name!r} is a ShapeDtypeStruct without a sharding; give it "
            "sharding=NamedSharding(mesh, spec) (or pass a concrete array)",
            leaf=b.name,
            kind="target",
        )
    saved_impl = (ckpt.manifest.leaves.get(b.name) or {}).get("key_impl")
    if b.key_impl is not None and saved_impl is not None and saved_impl != b.key_impl:
        raise MismatchError(
            f"restore: leaf {b.name!r} is a PRNG key of impl {b.key_impl!r} but the checkpoint "
            f"holds {saved_impl!r} keys; make the target's keys with "
            f"jax.random.key(..., impl={saved_impl!r})",
            leaf=b.name,
            kind="key_impl",
        )
    groups = read_groups(b)
    atom_of: dict[str, str] = {}
    slot_of: dict[str, str] = {}
    for g in groups:
        for p in g.pieces:
            if p.atom is None or p.atom in atom_of:
                continue
            name, slot = p.atom, b.slot
            if name not in ckpt.atoms:  # written before NNX / Linen names were unified?
                name = next(
                    (n for n in legacy_names(name, b.base, b.legacy) if n in ckpt.atoms), name
                )
            if b.role is not None and name not in ckpt.atoms:
                name, slot = _by_role(ckpt, b, read)
            info = ckpt.atom(name, leaf=b.name)
            if slot not in info.slots:
                ckpt.array(name, slot, leaf=b.name)  # raises the message
            have = info.slot_shape(slot)
            if have != tuple(p.atom_shape):
                raise MismatchError(
                    f"restore: leaf {b.name!r} (shape {b.shape}) expects atom {name!r} of shape "
                    f"{p.atom_shape} but the checkpoint has {have}; add or fix a "
                    "rule (ucp.Fused / VocabPadded / Stacked ...) or pass the matching target",
                    leaf=b.name,
                    kind="shape",
                )
            _check_fused(b, name, p.fused, info)
            stored = np_dtype(info.slots[slot].dtype)
            # an imported per-atom step (float32 in DeepSpeed) becomes an optax count: exact
            if stored != b.dtype and not cast and slot != STEP_SLOT:
                raise MismatchError(
                    f"restore: leaf {b.name!r} wants dtype {b.dtype.name} but atom {name!r} slot "
                    f"{slot!r} is stored as {stored.name}; pass cast=True to convert, or a "
                    "target of the stored dtype",
                    leaf=b.name,
                    kind="dtype",
                )
            atom_of[p.atom], slot_of[p.atom] = name, slot
    over = stack_overrun(b.chain, b.shape, b.ctx, ckpt.atoms.__contains__) if atom_of else None
    if over is not None:
        index, n, atom = over
        raise MismatchError(
            f"restore: leaf {b.name!r} (shape {b.shape}) stacks {n} atoms along its {{{index}}} "
            f"axis, but the checkpoint also has {atom!r}: it was saved with more (experts, "
            f"layers ...) and a restore would silently drop them; make the target's {{{index}}} "
            "count match the checkpoint's (e.g. n_experts, n_layers)",
            leaf=b.name,
            kind="shape",
        )
    return _Resolved(b, groups, slot_of, atom_of)


def _by_role(ckpt: Checkpoint, b: LeafBinding, read: bool = True) -> tuple[str, str]:
    """An optimizer leaf mirroring no parameter, found by its role in another optax structure.

    Returns (atom, slot). An optax count (`ScaleByAdamState.count`, ...) of a checkpoint imported
    from PyTorch, which has no count atom, comes from the per-atom `step` slots (DeepSpeed keeps
    Adam's step per parameter); they must all agree.
    """
    found = [n for n, a in ckpt.atoms.items() if a.role == b.role]
    if len(found) == 1:
        return found[0], b.slot
    if not found and b.role and b.role.endswith(".count"):
        steps = [
            n
            for n, a in ckpt.atoms.items()
            if STEP_SLOT in a.slots and a.slot_shape(STEP_SLOT) == ()
        ]
        if steps:
            return (_common_step(ckpt, b, steps) if read else steps[0]), STEP_SLOT
    raise MismatchError(
        f"restore: leaf {b.name!r} ({b.role}) is not in the checkpoint "
        + (f"(candidates with that role: {found})" if found else "(no atom has that role)")
        + "; restore params only (opt_state_target=None) or a matching optax structure",
        leaf=b.name,
        kind="missing",
    )


def _common_step(ckpt: Checkpoint, b: LeafBinding, atoms: Sequence[str]) -> str:
    """The atom whose `step` slot gives the count: all per-atom steps must agree."""
    values: dict[float, list[str]] = {}
    for n in atoms:
        values.setdefault(float(ckpt.read(n, STEP_SLOT)), []).append(n)
    if len(values) > 1:
        seen = {v: names[:2] for v, names in sorted(values.items())}
        raise MismatchError(
            f"restore: leaf {b.name!r} ({b.role}) takes the per-atom 'step' slots of the "
            f"checkpoint, but they differ ({seen}); restore params only, or set the count yourself",
            leaf=b.name,
            kind="value",
        )
    return next(iter(values.values()))[0]


def _check_fused(b: LeafBinding, atom: str, marks: Sequence[Any], info: AtomInfo) -> None:
    """A fused atom must be unfused as it was saved, and never silently left in TP=1 order."""
    want = fused_marks_to_json(marks)
    if want and info.fused and want != info.fused:
        raise PatternError(
            f"restore: leaf {b.name!r} fuses atom {atom!r} as {want}, but it was saved as "
            f"{info.fused}; fix the ucp.Fused sizes/axis of the rule to match the saved layout",
            leaf=b.name,
            kind="pattern",
        )
    if want or not info.fused:
        return
    for p in chain_from_json(info.pattern):
        axis_name = p.shard_axis if isinstance(p, Fused) else None
        n = b.ctx.mesh_axes.get(axis_name, 1) if axis_name else 1
        if n > 1:
            assert isinstance(p, Fused)
            raise PatternError(
                f"restore: atom {atom!r} was saved as a fusion {info.fused} whose layout depends "
                f"on mesh axis {axis_name!r} (size {n} in leaf {b.name!r}'s mesh), but the rule "
                f"for {b.name!r} has no ucp.Fused, so it would come back in TP=1 order; add "
                f"ucp.Fused({p.sizes}, axis={p.axis}, shard_axis={axis_name!r}), "
                "or ucp.Fused(..., shard_axis=None) if the model wants the canonical order",
                leaf=b.name,
                kind="pattern",
            )


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
    `jax.make_array_from_single_device_arrays`.

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

    Raises:
        RestorePlanError: the targets do not fit the checkpoint; one error (a MismatchError and a
            PatternError) listing every problem `ucp.plan` finds, raised before any array is read.
        NotACheckpointError, FormatVersionError, ChecksumError.

    >>> params, opt_state = ucp.restore("/tmp/ckpt/step_10", abstract_params, abstract_opt)  # doctest: +SKIP
    """
    global _last_stats
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint(path)
    compiled = CompiledRules(rules) if rules else CompiledRules.from_json(ckpt.manifest.rules)
    pbind, obind = bind_state(params_target, opt_state_target, compiled)
    budget = config.inflight_bytes() if max_inflight_bytes is None else max_inflight_bytes
    from .plan_report import build  # every problem in one error, before anything is read

    report = build(ckpt, pbind + obind, compiled if rules else None, cast, budget, account=False)
    report.raise_if_problems()
    resolved = report.resolved
    if any(r.slot_of.get(a) == STEP_SLOT for r in resolved for a in r.slot_of):
        resolved = [resolve_leaf(ckpt, r.binding, cast) for r in resolved]  # counts: steps agree?
    regions = [
        (r.atom_of[p.atom], r.slot_of[p.atom], p.atom_box)
        for r in resolved
        for g in r.groups
        for p in g.pieces
        if p.atom is not None
    ]
    ckpt.open_arrays([(name, slot) for name, slot, _ in regions])
    ckpt.check_sizes(regions)  # before reading: no file decodes into more than its chunk
    stats = ReadStats()
    values = _read_all(ckpt, resolved, stats, budget)
    ckpt.check_fingerprints(regions)  # the files read are the ones written there, or raise
    _last_stats = stats
    values = rewrap(values, [r.binding.key_impl for r in resolved])
    return unbind_state(params_target, opt_state_target, values)


def _read_all(
    ckpt: Checkpoint, resolved: list[_Resolved], stats: ReadStats, budget: int
) -> list[Any]:
    """Issue reads leaf by leaf, keeping at most `budget` bytes of host data in flight."""
    out: list[Any] = [None] * len(resolved)
    window: InflightWindow[tuple[int, list[Any]]] = InflightWindow(budget)
    for i, r in enumerate(resolved):
        issued = [_issue(ckpt, r, g, stats) for g in r.groups]
        nbytes = sum(box_size(g.box) for g in r.groups) * r.binding.dtype.itemsize
        for j, iss in window.push((i, issued), nbytes):
            out[j] = _finish(ckpt, resolved[j], iss)
    for j, iss in window.drain():
        out[j] = _finish(ckpt, resolved[j], iss)
    return out


def _issue(
    ckpt: Checkpoint, r: _Resolved, g: ReadGroup, stats: ReadStats
) -> tuple[np.ndarray, list[tuple[Any, Any, Any]]]:
    """Start filling the region `g.box` of leaf `r.binding`: (host buffer, pending pieces).

    A piece stored with the leaf's dtype is read by TensorStore directly into its place in the
    buffer (through a view in the atom's axis order); others are read and converted on finish.
    Padding is zero-filled here.
    """
    b = r.binding
    stats.bytes_needed += box_size(g.box) * b.dtype.itemsize
    out = aligned_empty(box_shape(g.box), b.dtype)
    pending: list[tuple[Any, Any, Any]] = []
    for p in g.pieces:
        rel = relative_slices(p.leaf_box, g.box)
        if p.atom is None:
            stats.bytes_padding += box_size(p.leaf_box) * b.dtype.itemsize
            out[rel] = 0
            continue
        name, slot = r.atom_of[p.atom], r.slot_of[p.atom]
        arr = ckpt.array(name, slot, leaf=b.name)
        itemsize = arr.dtype.numpy_dtype.itemsize
        stats.bytes_read += box_size(p.atom_box) * itemsize
        stats.reads += 1
        sinfo = ckpt.atoms[name].slots[slot]
        stats.bytes_chunks += chunk_bytes_touched(
            p.atom_box, arr.shape, sinfo.inner_chunks or sinfo.chunks, itemsize
        )
        src = arr[to_slices(p.atom_box)]
        if arr.dtype.numpy_dtype == b.dtype:
            whole_trailing: tuple[Any, ...] = (*rel, ...)
            dst = p.leaf_to_atom(out[whole_trailing])
            if np.may_share_memory(dst, out):  # a view: no reshape copy was needed
                try:
                    view = ts.array(dst, copy=False, write=True)
                except (ValueError, TypeError):
                    pass
                else:
                    pending.append((p, view.write(src), None))
                    continue
        pending.append((p, src.read(), rel))
    return out, pending


def _finish(
    ckpt: Checkpoint, r: _Resolved, issued: list[tuple[np.ndarray, list[tuple[Any, Any, Any]]]]
) -> Any:
    b = r.binding
    hosts: dict[Any, np.ndarray] = {}
    for g, (out, pending) in zip(r.groups, issued):
        for p, fut, rel in pending:
            if rel is None:
                _result(ckpt, b, p.atom, fut)
            else:
                out[rel] = p.atom_to_leaf(_result(ckpt, b, p.atom, fut))
        if b.sharding is None:
            return out if isinstance(b.value, np.ndarray) or b.shape else out[()]
        out.flags.writeable = False  # it may now back device buffers (CPU places it in place)
        hosts[g.box] = out
    assert b.sharding is not None
    return jax.make_array_from_callback(
        b.shape, b.sharding, lambda index: hosts[index_to_box(index, b.shape)]
    )


def _result(ckpt: Checkpoint, b: LeafBinding, atom: str | None, fut: Any) -> Any:
    try:
        return fut.result()
    except ValueError as e:
        raise wrap_io_error(e, f"{ckpt.path}: leaf {b.name!r} atom {atom!r}") from e


__all__ = ["Checkpoint", "NotACheckpointError", "list_checkpoints", "open_checkpoint", "restore"]
