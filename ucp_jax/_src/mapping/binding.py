"""Plans: bind a (params, opt_state) tree to atoms and slots, then decide who writes or reads what."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..errors import MismatchError
from ..util.dtypes import dtype_name, np_dtype
from .boxes import Box, box_size, full_box, index_to_box
from .chain_cuts import chain_cuts
from .keys import unwrap
from .names import named_leaves, path_to_name
from .patterns import LeafContext, PatternChain, Piece, atom_shapes, chain_pieces
from .rules import CompiledRules
from .slot_names import PARAM_SLOT, VALUE_SLOT
from .slots import OPT_PREFIX, classify_opt_state

SPLIT_MIN_BYTES = 4 << 20  # replicated regions at least this big are split among their replicas


@dataclasses.dataclass
class LeafBinding:
    """How one leaf of the train state maps to atoms.

    Attributes:
        name: the leaf's name in messages ('layers.qkv.kernel', 'opt_state.0.mu.layers.qkv.kernel').
        kind: 'param' or 'opt'.
        base: the name rules are matched against and the default atom (a mirrored moment uses its
            parameter's name, so it maps exactly like its parameter).
        slot: the slot it is stored in ('fp32', 'exp_avg', ..., 'value').
        role: '<StateClass>.<field>' for optimizer leaves that mirror no parameter.
        rule: index of the rule that matched, or None.
        chain: its pattern chain, atom outward.
        ctx: what the patterns know about the leaf (name, regex match, mesh axis sizes).
        shape, dtype, sharding: the leaf's global shape, dtype and sharding (None for host values).
        value: the array, ShapeDtypeStruct or host value itself.
        legacy: the base name jax's raw key path gives when it differs from `base` (an NNX
            `.value`, a Linen `params.` prefix): checkpoints written before names were unified.
        key_impl: for a typed PRNG key leaf, its impl's name; `value`, shape and dtype are then
            those of its key data (see `keys.py`).
        owner: for an optimizer leaf in a slot, the optax state field holding it
            ('ScaleByAdamState.mu').
    """

    name: str
    kind: str
    base: str
    slot: str
    role: str | None
    rule: int | None
    chain: PatternChain
    ctx: LeafContext
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None
    value: Any
    legacy: str | None = None
    key_impl: str | None = None
    owner: str | None = None

    def pieces(self, box: Box) -> list[Piece]:
        """Atom pieces filling `box` of this leaf."""
        return chain_pieces(self.chain, self.ctx, self.shape, box)

    def atoms(self) -> dict[str, Any]:
        """All atoms this leaf maps to: {name: (shape, fused marks)}."""
        return atom_shapes(self.chain, self.ctx, self.shape)


def mesh_axes(sharding: Any) -> dict[str, int]:
    """Mesh axis sizes of a NamedSharding, {} for any other sharding."""
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not hasattr(mesh, "shape"):
        return {}
    return {str(k): int(v) for k, v in dict(mesh.shape).items()}


# the Python numbers a tree may hold as leaves (a Linen `TrainState.step`): targets keep them,
# restores give them back as numbers of their type
PYTHON_NUMBERS = (bool, int, float, complex)
# what a leaf of a state or of its targets may be (`_leaf_meta`); anything else is refused
LEAF_TYPES = (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, *PYTHON_NUMBERS)


def _leaf_meta(leaf: Any, where: str) -> tuple[tuple[int, ...], np.dtype, Any]:
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        return tuple(leaf.shape), np_dtype(leaf.dtype), getattr(leaf, "sharding", None)
    if isinstance(leaf, int) and not -(2**63) <= leaf < 2**64:
        raise TypeError(
            f"leaf {where!r} is a Python int of {leaf.bit_length()} bits, beyond what int64 or "
            "uint64 hold; store it as a float, a string of digits outside the state, or split"
        )
    if isinstance(leaf, LEAF_TYPES):
        arr = np.asarray(leaf)
        return tuple(arr.shape), arr.dtype, None
    raise TypeError(
        f"leaf {where!r} is a {type(leaf).__name__}; expected a jax.Array, jax.ShapeDtypeStruct, "
        "numpy array or Python scalar"
    )


def bind_state(
    params: Any, opt_state: Any, rules: CompiledRules
) -> tuple[list[LeafBinding], list[LeafBinding]]:
    """Bind every leaf of params and opt_state to its atom(s), slot and pattern chain.

    Returns:
        (param bindings, opt bindings), each in jax's leaf order of its tree.
    """
    param_leaves = named_leaves(params)
    pbind: list[LeafBinding] = []
    by_name: dict[str, LeafBinding] = {}
    legacy: dict[str, str] = {}
    for name, path, leaf in param_leaves:
        if path_to_name(path) != name:
            legacy[name] = path_to_name(path)
        leaf, impl = unwrap(leaf)
        shape, dtype, sharding = _leaf_meta(leaf, name)
        idx, m, chain = rules.match(name)
        ctx = LeafContext(name, m, mesh_axes(sharding))
        b = LeafBinding(name, "param", name, PARAM_SLOT, None, idx, chain, ctx, shape, dtype,
                        sharding, leaf, legacy.get(name), impl)  # fmt: skip
        pbind.append(b)
        by_name[name] = b
    obind: list[LeafBinding] = []
    if opt_state is not None:
        params_def = jax.tree_util.tree_structure(params)
        names = [n for n, _, _ in param_leaves]
        shapes = [b.shape for b in pbind]
        for o in classify_opt_state(opt_state, params_def, names, shapes):
            leaf, impl = unwrap(o.leaf)
            shape, dtype, sharding = _leaf_meta(leaf, o.name)
            if o.param is not None:
                p = by_name[o.param]
                # a moment mirrors its parameter element for element: its global layout (a
                # fused kernel's per-shard order) is the parameter's, whatever the moment's own
                # sharding (on the host, on another mesh): the parameter's mesh axes apply
                ctx = LeafContext(o.name, p.ctx.match, p.ctx.mesh_axes, base=o.param)
                b = LeafBinding(o.name, "opt", o.param, o.slot or "", None, p.rule, p.chain, ctx,
                                shape, dtype, sharding, leaf, p.legacy, impl, o.owner)  # fmt: skip
            else:
                idx, m, chain = rules.match(o.name)
                ctx = LeafContext(o.name, m, mesh_axes(sharding))
                raw = path_to_name(o.path, OPT_PREFIX)
                b = LeafBinding(o.name, "opt", o.name, VALUE_SLOT, o.role, idx, chain, ctx,
                                shape, dtype, sharding, leaf, raw if raw != o.name else None,
                                impl)  # fmt: skip
            obind.append(b)
    return pbind, obind


def unbind_state(
    params_target: Any, opt_state_target: Any, values: Sequence[Any]
) -> tuple[Any, Any]:
    """The inverse of `bind_state`: (params, opt_state) trees from values in binding order."""
    n = len(jax.tree_util.tree_leaves(params_target))
    params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params_target), values[:n])
    if opt_state_target is None:
        return params, None
    opt_def = jax.tree_util.tree_structure(opt_state_target)
    return params, jax.tree_util.tree_unflatten(opt_def, values[n:])


# ----------------------------------------------------------------------------------------- save


@dataclasses.dataclass(frozen=True)
class WriteTask:
    """A region of a leaf that this process writes, and the device shard it comes from."""

    binding: LeafBinding
    box: Box
    device: Any | None  # None: a host value, written by process 0
    shard_box: Box

    @property
    def nbytes(self) -> int:
        return box_size(self.box) * self.binding.dtype.itemsize


def _split_box(box: Box, parts: int) -> list[Box] | None:
    """Split a box into `parts` equal slabs along its longest evenly divisible axis."""
    extents = [b - a for a, b in box]
    axes = [j for j, e in enumerate(extents) if e % parts == 0 and e >= parts]
    if not axes:
        return None
    ax = max(axes, key=lambda j: extents[j])
    step = extents[ax] // parts
    a0 = box[ax][0]
    return [(*box[:ax], (a0 + i * step, a0 + (i + 1) * step), *box[ax + 1 :]) for i in range(parts)]


def write_regions(b: LeafBinding) -> list[tuple[Box, Any, Box]]:
    """Every region of a leaf with the device that writes it, for the whole job.

    Each distinct shard is written once. A shard held by R replicas is split into R slabs written
    by different replicas when it is big enough, else written whole by one replica chosen by a hash
    of the leaf name, so the writes of replicated arrays spread over replicas and processes.
    Every process computes the same answer without communication.

    Returns:
        (region, writing device or None for host values, the region's whole shard box).
    """
    if not isinstance(b.value, jax.Array):
        return [(full_box(b.shape), None, full_box(b.shape))]
    groups: dict[Box, list[Any]] = {}
    for dev, index in b.value.sharding.devices_indices_map(b.shape).items():
        groups.setdefault(index_to_box(index, b.shape), []).append(dev)
    salt = zlib.crc32(b.name.encode())
    out = []
    for k, (box, devs) in enumerate(sorted(groups.items())):
        devs = sorted(devs, key=lambda d: d.id)
        r = len(devs)
        parts = None
        if r > 1 and box_size(box) * b.dtype.itemsize >= SPLIT_MIN_BYTES:
            parts = _split_box(box, r)
        if parts is None:
            out.append((box, devs[(salt + k) % r], box))
        else:
            out.extend((p, devs[(salt + k + i) % r], box) for i, p in enumerate(parts))
    return out


def my_write_tasks(b: LeafBinding, regions: Sequence[tuple[Box, Any, Box]]) -> list[WriteTask]:
    """The regions of `regions` that this process writes."""
    me = jax.process_index()
    out = []
    for box, dev, shard_box in regions:
        if dev is None:
            if me == 0:
                out.append(WriteTask(b, box, None, shard_box))
        elif dev.process_index == me:
            out.append(WriteTask(b, box, dev, shard_box))
    return out


def plan_on_grid(
    b: LeafBinding, info: Any = None
) -> tuple[list[WriteTask], dict[str, list[set[int]]]] | None:
    """This process's write tasks and each atom's writer boundaries, from the mesh and spec alone.

    O(local devices + shards per axis) per leaf (see grid.py and chain_cuts.py), patterns
    included; the same answer as `my_write_tasks(b, write_regions(b))` and `atom_boundaries`.

    Args:
        b: the leaf.
        info: the `grid.MeshInfo` of its mesh for this process; None: from its concrete mesh.

    Returns:
        (tasks, boundaries), or None where the grid does not apply (a host value, another
        sharding, uneven shards): use `plan_writes`'s per-device path then.
    """
    from . import grid

    sh = b.sharding
    if not isinstance(sh, jax.sharding.NamedSharding):
        return None
    if info is None:
        if not isinstance(sh.mesh, jax.sharding.Mesh):
            return None
        info = grid.mesh_info(sh.mesh, jax.process_index())
    plan = grid.grid_plan(info, tuple(sh.spec), tuple(b.shape))
    if plan is None:
        return None
    salt = zlib.crc32(b.name.encode())
    regions = grid.local_regions(plan, info.local, salt, b.dtype.itemsize)
    tasks = [WriteTask(b, box, dev, shard_box) for box, dev, shard_box in regions]
    if not b.chain:
        cuts = grid.cuts(plan, b.dtype.itemsize, b.shape)
        return tasks, {atom: cuts for atom in b.atoms()}
    axes = grid.axis_intervals(plan, b.dtype.itemsize, b.shape)
    mapped = chain_cuts(b.chain, b.ctx, b.shape, axes)
    if mapped is None:  # a registered pattern: only the per-device path knows it
        mapped = atom_boundaries(b, write_regions(b))
    return tasks, mapped


def plan_writes(
    b: LeafBinding, info: Any = None
) -> tuple[list[WriteTask], dict[str, list[set[int]]]]:
    """This process's write tasks of leaf `b`, and per atom, per axis, its writer boundaries.

    On the grid where it applies (`plan_on_grid`); else from every region of the job
    (`write_regions`, O(devices)), the boundaries still mapped per axis (`chain_cuts`) when the
    regions form a product grid. The boundary sets may be shared between atoms: do not change them.

    Args:
        b: the leaf.
        info: the `grid.MeshInfo` of its mesh for this process; None: from its concrete mesh.
    """
    fast = plan_on_grid(b, info)
    if fast is not None:
        return fast
    regions = write_regions(b)
    tasks = my_write_tasks(b, regions)
    axes = product_axes(regions, len(b.shape))
    mapped = None if axes is None else chain_cuts(b.chain, b.ctx, b.shape, axes)
    return tasks, mapped if mapped is not None else atom_boundaries(b, regions)


def product_axes(
    regions: Sequence[tuple[Box, Any, Box]], ndim: int
) -> list[list[tuple[int, int]]] | None:
    """Per axis, the distinct intervals of `regions`, if the regions are all their combinations.

    >>> product_axes([(((0, 2), (0, 3)), None, None), (((2, 4), (0, 3)), None, None)], 2)
    [[(0, 2), (2, 4)], [(0, 3)]]
    >>> product_axes([(((0, 2), (0, 3)), None, None), (((2, 4), (0, 1)), None, None)], 2) is None
    True
    """
    boxes = {box for box, _, _ in regions}
    axes = [sorted({box[j] for box in boxes}) for j in range(ndim)]
    # the boxes are combinations of these intervals: as many as all the combinations are all of them
    return axes if math.prod(len(a) for a in axes) == len(boxes) else None


def atom_boundaries(
    b: LeafBinding, regions: Sequence[tuple[Box, Any, Box]]
) -> dict[str, list[set[int]]]:
    """Per atom of `b`, per axis, the offsets where one writer's region ends and the next begins."""
    out: dict[str, list[set[int]]] = {}
    for box, _, _ in regions:
        for p in b.pieces(box):
            if p.atom is None:
                continue
            cuts = out.setdefault(p.atom, [set() for _ in p.atom_shape])
            for j, (lo, hi) in enumerate(p.atom_box):
                cuts[j].update((lo, hi))
    return out


# -------------------------------------------------------------------------------------- restore


@dataclasses.dataclass
class ReadGroup:
    """One distinct region of a target leaf that this process needs, and the devices wanting it."""

    box: Box
    devices: list[Any]
    pieces: list[Piece]


def device_regions(b: LeafBinding) -> dict[Box, list[Any]]:
    """The distinct regions of a sharded leaf this process's devices hold, each with its devices."""
    assert b.sharding is not None
    groups: dict[Box, list[Any]] = {}
    try:
        indices = b.sharding.addressable_devices_indices_map(b.shape)
    except (ValueError, IndexError) as e:  # jax's IndivisibleError is a ValueError
        raise MismatchError(
            f"restore: target leaf {b.name!r} of shape {b.shape} cannot take its sharding "
            f"{getattr(b.sharding, 'spec', b.sharding)}: {str(e)[:240]}; give the target a "
            "sharding whose mesh axes divide its dimensions",
            leaf=b.name,
            kind="sharding",
        ) from e
    for dev, index in indices.items():
        groups.setdefault(index_to_box(index, b.shape), []).append(dev)
    return groups


def read_groups(b: LeafBinding) -> list[ReadGroup]:
    """The distinct regions of a target leaf that this process's devices need (each read once)."""
    if b.sharding is None:
        return [ReadGroup(full_box(b.shape), [], b.pieces(full_box(b.shape)))]
    return [ReadGroup(box, devs, b.pieces(box)) for box, devs in sorted(device_regions(b).items())]


def describe_leaf(b: LeafBinding) -> dict[str, Any]:
    """A leaf's manifest record."""
    spec = getattr(b.sharding, "spec", None)
    return {
        "kind": b.kind,
        "base": b.base,
        "slot": b.slot,
        "role": b.role,
        "rule": b.rule,
        "shape": list(b.shape),
        "dtype": dtype_name(b.dtype),
        "mesh": b.ctx.mesh_axes,
        "spec": None if spec is None else str(spec),
        **({"key_impl": b.key_impl} if b.key_impl else {}),
        **({"owner": b.owner} if b.owner else {}),
    }


__all__ = ["OPT_PREFIX", "LeafBinding", "ReadGroup", "WriteTask", "bind_state"]
