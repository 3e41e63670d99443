"""A target leaf resolved against a manifest: its atoms, slots and checks, before any read.

`restore` reads what this resolves; `plan` reports it without reading. Every check that a target
leaf can fail (a missing atom, a PRNG key of another impl, steps that disagree, fused sizes that
differ) is made here, once, for both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from .checkpoint import Checkpoint
from .errors import MismatchError, PatternError
from .format.manifest import STEP_SLOT, AtomInfo
from .mapping.binding import LeafBinding, ReadGroup, read_groups
from .mapping.names import legacy_names
from .mapping.pattern_json import chain_from_json, fused_marks_to_json
from .mapping.patterns import Fused
from .mapping.stack_count import stack_overrun
from .util.dtypes import np_dtype


@dataclasses.dataclass
class ResolvedLeaf:
    """A target leaf checked against the checkpoint: the slot each of its pieces reads."""

    binding: LeafBinding
    groups: list[ReadGroup]
    slot_of: dict[str, str]  # atom -> slot to read (roles may redirect to another atom)
    atom_of: dict[str, str]


def resolve_leaf(
    ckpt: Checkpoint, b: LeafBinding, cast: bool, *, read: bool = True
) -> ResolvedLeaf:
    """Check a target leaf against the manifest; `read=False` (plans) never reads an array."""
    if b.sharding is None and isinstance(b.value, jax.ShapeDtypeStruct):
        raise MismatchError(
            f"restore: target leaf {b.name!r} is a ShapeDtypeStruct without a sharding; give it "
            "sharding=NamedSharding(mesh, spec) (or pass a concrete array)",
            leaf=b.name,
            kind="target",
        )
    if b.sharding is not None and jax.dtypes.canonicalize_dtype(b.dtype) != b.dtype:
        raise MismatchError(
            f"restore: target leaf {b.name!r} is {b.dtype.name} on devices, but JAX's 64-bit "
            f"types are off: it would be made {jax.dtypes.canonicalize_dtype(b.dtype).name} and "
            "lose values; enable them (jax.config.update('jax_enable_x64', True)), or pass a "
            "numpy target, or a 32-bit target with cast=True",
            leaf=b.name,
            kind="dtype",
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
            older = [n for n in legacy_names(name, b.base, b.legacy) if n in ckpt.atoms]
            if name not in ckpt.atoms:  # written before NNX / Linen names were unified?
                name = older[0] if older else name
            elif older:
                raise MismatchError(
                    f"restore: leaf {b.name!r} (named without its lone 'params' collection or "
                    f"NNX '.value') is atom {name!r}, but the checkpoint also holds {older[0]!r}: "
                    "it was saved from a tree with 'params' beside other top-level keys, and "
                    "either may be meant; pass a target with the saved tree's top-level keys",
                    leaf=b.name,
                    kind="missing",
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
    return ResolvedLeaf(b, groups, slot_of, atom_of)


def other_optimizer(ckpt: Checkpoint, bindings: Sequence[LeafBinding]) -> list[str]:
    """Slots restored into another optax state than the one that saved them (adam's `nu` into
    adabelief's, whose `nu` is another statistic): one line per (slot, saved, target), empty
    when every slot's saving state is the target's or was not recorded (imports, older saves)."""
    saved: dict[tuple[str, str], str] = {}
    for rec in ckpt.manifest.leaves.values():
        if isinstance(rec, dict) and isinstance(rec.get("owner"), str):
            saved[(str(rec.get("base")), str(rec.get("slot")))] = rec["owner"]
    out: dict[tuple[str, str, str], None] = {}
    for b in bindings:
        was = saved.get((b.base, b.slot)) if b.owner is not None else None
        if was is None or b.owner is None:
            continue
        before, now = _optax_class(was), _optax_class(b.owner)
        if before is not None and now is not None and before != now:
            out[(b.slot, was, b.owner)] = None
    return [f"slot {s!r}: saved from {w}, restored into {t}" for s, w, t in out]


def _optax_class(owner: str) -> str | None:
    """The optax state class of an owner ('ScaleByAdamState' of 'ScaleByAdamState.mu'), None
    for a container (a dict, NNX's State)."""
    cls = owner.split(".")[0]
    return cls if cls.endswith("State") and cls not in ("State", "VariableState") else None


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
