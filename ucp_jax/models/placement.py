"""Host arrays <-> sharded parameter trees: tensor-parallel fusing, flat names, placement.

>>> import numpy as np
>>> from ucp_jax.models.placement import fuse_tp, unfuse_tp
>>> a = np.arange(12.0).reshape(1, 12)
>>> bool((unfuse_tp(fuse_tp(a, (4, 4, 4), 2), (4, 4, 4), 2) == a).all())
True
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any


def fuse_tp(a: np.ndarray, sizes: tuple[int, ...], t: int) -> np.ndarray:
    """Canonical ``[s_0 | s_1 | ...]`` columns -> ``concat_r [s_0[r] | s_1[r] | ...]`` (last axis)."""
    subs = np.split(a, np.cumsum(sizes)[:-1], axis=-1)
    return np.concatenate([np.split(s, t, axis=-1)[r] for r in range(t) for s in subs], axis=-1)


def unfuse_tp(a: np.ndarray, sizes: tuple[int, ...], t: int) -> np.ndarray:
    """Inverse of :func:`fuse_tp`."""
    chunk = [n // t for n in sizes]
    groups = np.split(a, t, axis=-1)
    parts = [np.split(g, np.cumsum(chunk)[:-1], axis=-1) for g in groups]
    return np.concatenate(
        [np.concatenate([p[k] for p in parts], -1) for k in range(len(sizes))], -1
    )


def unflatten_tree(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for name, v in flat.items():
        *path, leaf = name.split(".")
        node = tree
        for k in path:
            node = node.setdefault(k, {})
        node[leaf] = v
    return tree


def flatten_tree(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten_tree(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def put_sharded(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global host array as a jax.Array with `sharding` (each device takes its region)."""
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def _mesh_of(tree: PyTree) -> Mesh:
    for leaf in jax.tree.leaves(tree):
        if isinstance(getattr(leaf, "sharding", None), NamedSharding):
            return leaf.sharding.mesh
    raise ValueError("no leaf with a NamedSharding in the params")


def abstract_opt_state(optimizer: optax.GradientTransformation, params: PyTree) -> PyTree:
    """The optax state as ``jax.ShapeDtypeStruct`` with shardings (a restore target).

    Subtrees that mirror the params (Adam's ``mu``/``nu``) take the params' shardings; the other
    leaves (``count``...) are replicated on the params' mesh.

    Args:
        optimizer: the optax transformation.
        params: params or abstract params (leaves with ``.shape``, ``.dtype``, ``.sharding``).

    Returns:
        A pytree with the structure of ``optimizer.init(params)``.
    """
    structure: Any = jax.tree.structure(params)
    shardings = jax.tree.map(lambda p: p.sharding, params)
    replicated = NamedSharding(_mesh_of(params), P())
    state = jax.eval_shape(optimizer.init, params)

    def is_mirror(x: Any) -> bool:
        return bool(structure == jax.tree.structure(x))

    def place(x: Any) -> Any:
        if is_mirror(x):
            return jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), x, shardings
            )
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)

    return jax.tree.map(place, state, is_leaf=is_mirror)
