"""Typed PRNG keys (`jax.random.key`, any impl) as atoms: their key data, with the impl recorded.

A typed key array of shape S holds key data of shape S + impl.key_shape (uint32); the data is
what is stored, snapshotted and exchanged, like any other uint32 leaf, and the impl's name
(`threefry2x32`, `rbg`, `unsafe_rbg`, ...) goes into the leaf's manifest record (`key_impl`).
Restore reads the data onto the target's sharding (the trailing key axes replicated) and wraps it
back with `jax.random.wrap_key_data(data, impl=...)`. Legacy raw `uint32[2]` keys are plain uint32
leaves; a checkpoint of raw keys restores into typed key targets of a matching impl and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp


def is_key_dtype(dtype: Any) -> bool:
    """Whether `dtype` is a typed PRNG key dtype (`key<fry>`, `key<rbg>`, ...).

    >>> is_key_dtype(jax.random.key(0).dtype), is_key_dtype(jnp.uint32)
    (True, False)
    """
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def impl_name(leaf: Any) -> str | None:
    """The PRNG impl's name of a typed key array or ShapeDtypeStruct (None for anything else).

    >>> impl_name(jax.random.key(0, impl="rbg"))
    'rbg'
    """
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not is_key_dtype(dtype):
        return None
    if isinstance(leaf, jax.Array):
        return str(jax.random.key_impl(leaf))
    return str(dtype._impl.name)  # a ShapeDtypeStruct: jax has no public accessor for it


def _data_sharding(sharding: Any, extra_dims: int) -> Any:
    """A key array's sharding for its key data (the trailing key axes replicated)."""
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return sharding
    return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(*spec, *([None] * extra_dims)),
        memory_kind=sharding.memory_kind,
    )  # fmt: skip


def unwrap(leaf: Any) -> tuple[Any, str | None]:
    """A leaf as storable data: (key data or its ShapeDtypeStruct, impl name) for typed keys,
    (leaf, None) for anything else."""
    impl = impl_name(leaf)
    if impl is None:
        return leaf, None
    if isinstance(leaf, jax.Array):
        return jax.random.key_data(leaf), impl
    key_shape = tuple(leaf.dtype._impl.key_shape)
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
        sharding = _data_sharding(sharding, len(key_shape))
    return jax.ShapeDtypeStruct((*leaf.shape, *key_shape), jnp.uint32, sharding=sharding), impl


def wrap(data: Any, impl: str | None) -> Any:
    """Restored key data back as a typed key array of `impl` (data unchanged when impl is None)."""
    if impl is None:
        return data
    return jax.random.wrap_key_data(data, impl=impl)


def rewrap(values: Sequence[Any], impls: Sequence[str | None]) -> list[Any]:
    """`wrap` each restored value with its leaf's impl."""
    return [wrap(v, i) for v, i in zip(values, impls)]


def data_leaves(tree: Any) -> list[Any]:
    """The leaves of a state with typed keys replaced by their key data (what snapshots copy)."""
    return [unwrap(x)[0] for x in jax.tree_util.tree_leaves(tree)]


__all__ = ["data_leaves", "impl_name", "is_key_dtype", "rewrap", "unwrap", "wrap"]
