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
        owner: for a leaf in a slot, '<StateClass>.<field>' of the subtree holding it
            ('ScaleByAdamState.mu'): which optimizer's state the slot is.
    """

    path: tuple[Any, ...]
    name: str
    param: str | None
    slot: str | None
    role: str | None
    leaf: Any
    owner: str | None = None


def _shape(x: Any) -> tuple[int, ...] | None:
    s = getattr(x, "shape", None)
    return tuple(s) if s is not None else None


def classify_opt_state(
    opt_state: Any, params_def: Any, param_names: Sequence[str], param_shapes: Sequence[Any]
) -> list[OptLeaf]:
    """Split an optax state into parameter-mirroring leaves and the rest.

    A subtree mirrors the parameters when it has the params' tree structure (or their leaf names,
    as when NNX holds them) and leaf shapes (adam's mu/nu, sgd's trace, MultiSteps' acc_grads,
    ...), some of them possibly left out as `optax.MaskedNode`s (the inner states of
    `optax.masked` and `multi_transform`). Its slot is the field name that holds it, renamed as
    DeepSpeed names it (mu -> exp_avg, nu -> exp_avg_sq); if two subtrees would give one
    parameter the same slot name, they use their full paths instead.

    Args:
        opt_state: the optax state (arrays or ShapeDtypeStructs).
        params_def: the params' treedef.
        param_names: the params' leaf names, in leaf order.
        param_shapes: the params' leaf shapes, in leaf order.

    Returns:
        One OptLeaf per leaf of `opt_state`, in jax's leaf order.
    """
    shapes = [tuple(s) for s in param_shapes]
    by_name: dict[str, tuple[int, ...] | None] = dict(zip(param_names, shapes))
    prefixes: dict[str, list[str]] = {}  # a name's tail after a '.' -> the heads before it
    for n in param_names:
        for at in [0, *(i + 1 for i, c in enumerate(n) if c == ".")]:
            prefixes.setdefault(n[at:], []).append(n[:at])
    mirrors: list[tuple[tuple[Any, ...], str, frozenset[str]]] = []
    out: list[OptLeaf] = []

    def mirrored(node: Any) -> list[str] | None:
        """The parameter names a subtree mirrors, leaf for leaf, or None: the params' own tree
        structure and shapes, or leaves named as parameters (`by_names`)."""
        leaves = jax.tree_util.tree_leaves(node)
        if not leaves:
            return None
        if (
            jax.tree_util.tree_structure(node) == params_def
            and [_shape(x) for x in leaves] == shapes
        ):
            return list(param_names)
        return by_names(node)

    def by_names(node: Any) -> list[str] | None:
        """A subtree whose leaves are named as parameters (under one common prefix), with their
        shapes: the params held another way (NNX variables, `nnx.State`), `optax.masked` /
        `multi_transform` states (a `MaskedNode` where a parameter or a whole subtree is left
        out), a state of part of the params (`lookahead`'s `fast_state`)."""
        try:
            named = named_leaves(node)
        except ValueError:
            return None
        if not named or any(not sub for sub, _, _ in named):
            return None
        for prefix in prefixes.get(named[0][0], ()):
            names = [prefix + sub for sub, _, _ in named]
            if len(set(names)) == len(names) and all(
                by_name.get(n, ()) == _shape(leaf) for n, (_, _, leaf) in zip(names, named)
            ):
                return names
        return None

    def walk(node: Any, path: tuple[Any, ...], npath: tuple[Any, ...], container: str) -> None:
        # path: jax's key path; npath: the same without the `.value` of NNX variables
        if not jax.tree_util.tree_leaves(node):
            return
        field = key_to_str(npath[-1]) if npath else "state"
        names = mirrored(node) if shapes else None
        if names is not None:
            slot = SLOT_ALIASES.get(field, field)
            mirrors.append((path, slot, frozenset(names)))
            head = path_to_name(npath, OPT_PREFIX)
            for (sub_name, sub, leaf), pname in zip(named_leaves(node), names):
                name = f"{head}.{sub_name}" if sub_name else head
                out.append(OptLeaf(path + tuple(sub), name, pname, slot, None, leaf,
                                   f"{container}.{field}"))  # fmt: skip
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
    # Resolve clashing slot names (e.g. two momentum traces in one chain) by their full path;
    # masked states of disjoint parameters (multi_transform's) share their slot names.
    claimed: dict[tuple[str, str], int] = {}
    for _, slot, names in mirrors:
        for n in names:
            claimed[(n, slot)] = claimed.get((n, slot), 0) + 1
    twice = {s for (_, s), k in claimed.items() if k > 1}
    clashing = {p: path_to_name(p) for p, s, _ in mirrors if s in twice}
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
