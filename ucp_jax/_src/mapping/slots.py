"""Optax state <-> slots: which optimizer leaves mirror a parameter (mu -> exp_avg), which do not."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from .names import is_variable, key_to_str, named_leaves, path_to_name
from .slot_names import SLOT_ALIASES

OPT_PREFIX = "opt_state"


@dataclasses.dataclass(frozen=True)
class OptLeaf:
    """One leaf of an optax state.

    Attributes:
        path: its key path in the optax state.
        name: its atom-style name, 'opt_state.<path>'.
        param: the parameter it mirrors (None for counts, hyperparameters, ...).
        slot: the slot it is stored in when it mirrors a parameter ('exp_avg', 'exp_avg_sq', ...).
        role: '<StateClass>.<field>' of its container, used to match a different optax structure.
        leaf: the leaf itself.
    """

    path: tuple[Any, ...]
    name: str
    param: str | None
    slot: str | None
    role: str | None
    leaf: Any


def _shape(x: Any) -> tuple[int, ...] | None:
    s = getattr(x, "shape", None)
    return tuple(s) if s is not None else None


def classify_opt_state(
    opt_state: Any, params_def: Any, param_names: Sequence[str], param_shapes: Sequence[Any]
) -> list[OptLeaf]:
    """Split an optax state into parameter-mirroring leaves and the rest.

    A subtree mirrors the parameters when it has the params' tree structure (or their leaf names,
    as when NNX holds them) and leaf shapes (adam's
    mu/nu, sgd's trace, MultiSteps' acc_grads, ...). Its slot is the field name that holds it,
    renamed as DeepSpeed names it (mu -> exp_avg, nu -> exp_avg_sq); if two subtrees would share a
    slot name, both use their full path instead.

    Args:
        opt_state: the optax state (arrays or ShapeDtypeStructs).
        params_def: the params' treedef.
        param_names: the params' leaf names, in leaf order.
        param_shapes: the params' leaf shapes, in leaf order.

    Returns:
        One OptLeaf per leaf of `opt_state`, in jax's leaf order.
    """
    shapes = [tuple(s) for s in param_shapes]
    mirrors: list[tuple[tuple[Any, ...], str]] = []
    out: list[OptLeaf] = []

    def is_mirror(node: Any) -> bool:
        if [_shape(x) for x in jax.tree_util.tree_leaves(node)] != shapes:
            return False
        if jax.tree_util.tree_structure(node) == params_def:
            return True
        try:  # the same parameter names, held another way (NNX variables, nnx.State, ...)
            return [n for n, _, _ in named_leaves(node)] == list(param_names)
        except ValueError:
            return False

    def walk(node: Any, path: tuple[Any, ...], npath: tuple[Any, ...], container: str) -> None:
        # path: jax's key path; npath: the same without the `.value` of NNX variables
        if not jax.tree_util.tree_leaves(node):
            return
        field = key_to_str(npath[-1]) if npath else "state"
        if shapes and is_mirror(node):
            slot = SLOT_ALIASES.get(field, field)
            mirrors.append((path, slot))
            head = path_to_name(npath, OPT_PREFIX)
            for (sub_name, sub, leaf), pname in zip(named_leaves(node), param_names):
                name = f"{head}.{sub_name}" if sub_name else head
                out.append(OptLeaf(path + tuple(sub), name, pname, slot, None, leaf))
            return
        if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(node)):
            name = path_to_name(npath, OPT_PREFIX)
            out.append(OptLeaf(path, name, None, None, f"{container}.{field}", node))
            return
        children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        wrapper = is_variable(node)
        kind = container if wrapper else type(node).__name__
        for sub, child in children:
            sub = tuple(sub)
            nsub = sub[1:] if wrapper and sub and key_to_str(sub[0]) == "value" else sub
            walk(child, path + sub, npath + nsub, kind)

    walk(opt_state, (), (), type(opt_state).__name__)
    # Resolve clashing slot names (e.g. two momentum traces in one chain) by their full path.
    counts: dict[str, int] = {}
    for _, slot in mirrors:
        counts[slot] = counts.get(slot, 0) + 1
    clashing = {p: path_to_name(p) for p, s in mirrors if counts[s] > 1}
    if clashing:
        fixed = []
        for leaf in out:
            if leaf.param is not None:
                for p, qual in clashing.items():
                    if leaf.path[: len(p)] == p:
                        leaf = dataclasses.replace(leaf, slot=qual)
            fixed.append(leaf)
        out = fixed
    # Keep jax's leaf order, so the result zips with tree_leaves(opt_state).
    order = {
        tuple(p): i for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(opt_state)[0])
    }
    return sorted(out, key=lambda o: order[tuple(o.path)])
