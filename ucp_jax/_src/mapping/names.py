"""Atom-style names for pytree leaves: the key path joined with '.'."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


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


def named_leaves(tree: Any, prefix: str = "") -> list[tuple[str, tuple[Any, ...], Any]]:
    """Flatten a pytree into (name, key path, leaf) triples, in jax's leaf order.

    Raises:
        ValueError: two leaves would get the same name.
    """
    out = []
    seen: dict[str, tuple[Any, ...]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = path_to_name(path, prefix)
        if name in seen:
            raise ValueError(
                f"leaves {seen[name]} and {path} both get the name {name!r}; "
                "rename one of the keys so that dotted names are unique"
            )
        seen[name] = path
        out.append((name, path, leaf))
    return out
