"""Atom-style names for pytree leaves: the model's parameter names, joined with '.'.

A name is the leaf's key path joined with '.', with what only says *how* a model API holds the
parameter left out, so that one model gets the same atom names whichever API holds it:

- a Flax NNX `Variable` (and `VariableState`) wrapper: its `.value` field is not part of the name
  (`nnx.state(model)` gives `up.kernel`, not `up.kernel.value`);
- `nnx.State` flattens like a plain dict (its keys are the names);
- Linen's top-level `params` collection: a tree `{"params": {...}}` (what `model.init` returns when
  the model has no other collection) is named by what is inside it.

The raw jax path is still returned, so checkpoints written with the older names (`...value`,
`params....`) can be found by restore (see `legacy_names`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

COLLECTION = "params"  # Linen's parameter collection, left out of names when alone at the top


def key_to_str(key: Any) -> str:
    """One key-path entry as a name component (`DictKey('w')` -> 'w', `SequenceKey(0)` -> '0')."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key).strip(".[]'\"")


def path_to_name(path: Sequence[Any], prefix: str = "") -> str:
    """Join a jax key path into a dotted name, e.g. ('layers', 'attn', 'kernel') -> 'layers.attn.kernel'.

    >>> path_to_name((jax.tree_util.DictKey("a"), jax.tree_util.SequenceKey(0)))
    'a.0'
    """
    parts = [key_to_str(k) for k in path]
    if prefix:
        parts.insert(0, prefix)
    return ".".join(parts)


def is_variable(x: Any) -> bool:
    """Whether `x` is a Flax NNX `Variable` / `VariableState` (checked without importing flax)."""
    return any(
        c.__name__ in ("Variable", "VariableState") and c.__module__.startswith("flax.")
        for c in type(x).__mro__
    )


def _is_value_key(key: Any) -> bool:
    return getattr(key, "name", None) == "value" or getattr(key, "key", None) == "value"


def _only_params(tree: Any) -> bool:
    """A Linen variables dict holding only the `params` collection."""
    return isinstance(tree, Mapping) and list(tree.keys()) == [COLLECTION]


def model_paths(tree: Any) -> list[tuple[tuple[Any, ...], tuple[Any, ...], Any]]:
    """Every leaf as (name path, raw jax key path, leaf), in jax's leaf order.

    The name path drops the `.value` key of NNX variables and a lone top-level Linen `params`
    collection; the raw path is jax's own.
    """
    out = []
    skip = 1 if _only_params(tree) else 0
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]:
        if not is_variable(node):
            out.append((tuple(path[skip:]), tuple(path), node))
            continue
        for sub, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
            sub = tuple(sub)
            inner = sub[1:] if sub and _is_value_key(sub[0]) else sub
            out.append((tuple(path[skip:]) + inner, tuple(path) + sub, leaf))
    return out


def named_leaves(tree: Any, prefix: str = "") -> list[tuple[str, tuple[Any, ...], Any]]:
    """Flatten a pytree into (name, raw key path, leaf) triples, in jax's leaf order.

    >>> named_leaves({"params": {"up": {"kernel": 1.0}}})[0][0]
    'up.kernel'

    Raises:
        ValueError: two leaves would get the same name.
    """
    out = []
    seen: dict[str, tuple[Any, ...]] = {}
    for npath, path, leaf in model_paths(tree):
        name = path_to_name(npath, prefix)
        if name in seen:
            raise ValueError(
                f"leaves {seen[name]} and {path} both get the name {name!r}; "
                "rename one of the keys so that dotted names are unique"
            )
        seen[name] = path
        out.append((name, path, leaf))
    return out


def legacy_names(atom: str, base: str, legacy_base: str | None) -> list[str]:
    """Names an atom may have in a checkpoint written before NNX/Linen names were unified.

    Args:
        atom: the atom's name now.
        base: the leaf's base name now (what an identity mapping names its atom).
        legacy_base: the leaf's base name as it was then (with `.value` / `params.`), or None
            when it is the same.

    Returns:
        Candidate names, most likely first (empty when the leaf's name did not change).

    >>> legacy_names("up.kernel", "up.kernel", "up.kernel.value")
    ['up.kernel.value', 'params.up.kernel', 'params.up.kernel.value']
    """
    if legacy_base is None or legacy_base == base:
        return []
    out = [legacy_base] if atom == base else []
    out += [f"{atom}.value", f"{COLLECTION}.{atom}", f"{COLLECTION}.{atom}.value"]
    return list(dict.fromkeys(n for n in out if n != atom))
