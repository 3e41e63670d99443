"""Building restore targets: a mesh over the available devices, and ShapeDtypeStructs with shardings
for params and the optax state alike (moments take their parameter's sharding)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .errors import check_device_count
from .mapping.binding import PYTHON_NUMBERS
from .mapping.names import named_leaves
from .mapping.slots import classify_opt_state

SpecSource = Any  # a pytree of PartitionSpec, or a callable (leaf name, leaf) -> PartitionSpec


def make_mesh(devices: Any = None, **axes: int) -> Mesh:
    """A mesh with named axes over the available devices; one axis may be -1 (the rest).

    Args:
        devices: devices to use (default: all of `jax.devices()`).
        **axes: axis name -> size, in mesh order, e.g. `data=2, fsdp=1, tensor=4`.

    Raises:
        DeviceCountError: the sizes need more devices than there are.
        ValueError: the sizes do not multiply to the device count.

    >>> mesh = make_mesh(data=-1, tensor=1)
    >>> mesh.axis_names
    ('data', 'tensor')
    """
    devs = list(jax.devices() if devices is None else devices)
    sizes = dict(axes)
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"make_mesh: only one axis may be -1, got {free}")
    known = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if len(devs) % known:
            raise ValueError(f"make_mesh: {len(devs)} devices do not divide by {known}")
        sizes[free[0]] = len(devs) // known
    fix = (f"choose sizes whose product is {len(devs)} (one may be -1: the rest), or pass "
           "devices= a subset")  # fmt: skip
    check_device_count(f"make_mesh: axes {sizes}", math.prod(sizes.values()), devs, fix)
    if math.prod(sizes.values()) != len(devs):
        raise ValueError(
            f"make_mesh: axes {sizes} make {math.prod(sizes.values())} devices but "
            f"{len(devs)} are available; {fix}"
        )
    arr = np.array(devs, dtype=object).reshape(tuple(sizes.values()) or (1,))
    return Mesh(arr, tuple(sizes) or ("x",))


def _spec_for(specs: SpecSource, names: list[str], tree: Any) -> list[PartitionSpec]:
    if callable(specs) and not isinstance(specs, PartitionSpec):
        return [specs(n, x) for n, (_, _, x) in zip(names, named_leaves(tree))]
    if isinstance(specs, PartitionSpec):
        return [specs] * len(names)

    def is_spec(s: Any) -> bool:
        return isinstance(s, PartitionSpec) or s is None

    def spread(s: Any, sub: Any) -> list[PartitionSpec]:  # a spec for a whole subtree
        return [PartitionSpec() if s is None else s] * len(jax.tree_util.tree_leaves(sub))

    try:  # a tree of specs like params, or a prefix of it ({"enc": P("data"), ...})
        spread_tree = jax.tree_util.tree_map(spread, specs, tree, is_leaf=is_spec)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"targets: specs must be one PartitionSpec, a callable (name, leaf) -> spec, or a "
            f"tree of PartitionSpec shaped like params or like a prefix of it; it does not "
            f"match params: {str(e)[:300]}"
        ) from e
    flat = jax.tree_util.tree_leaves(spread_tree, is_leaf=is_spec)
    if len(flat) != len(names):
        raise ValueError(
            f"targets: specs give {len(flat)} PartitionSpecs for {len(names)} leaves of params; "
            "give one per leaf, or one per subtree"
        )
    return flat


def _host_target(x: Any) -> Any:
    """A numpy target for a numpy scalar (or 0-d array) of a 64-bit type while JAX's 64-bit
    types are off, as a train state keeps a step or a seed on the host (on devices JAX would
    narrow it, so a restore refuses a device target of it): a zero of its type, filled by the
    restore on the host. None for any other leaf (arrays are shape templates for devices)."""
    if not isinstance(x, np.ndarray | np.generic) or np.ndim(x):
        return None
    if jax.dtypes.canonicalize_dtype(x.dtype) == x.dtype:
        return None
    return x.dtype.type(0) if isinstance(x, np.generic) else np.zeros((), x.dtype)


def targets(
    params: Any,
    mesh: Mesh,
    specs: SpecSource | Callable[[str, Any], PartitionSpec] | None = None,
    opt_state: Any = None,
) -> tuple[Any, Any]:
    """Restore targets for params (and optax state) on `mesh`.

    Optimizer leaves that mirror a parameter (adam's mu/nu, ...) get that parameter's sharding;
    the rest (counts, hyperparameters) are replicated.

    Args:
        params: pytree of arrays or ShapeDtypeStructs (e.g. `jax.eval_shape(init)`), shapes of the
            *target* layout.
        mesh: the target mesh.
        specs: a pytree of PartitionSpec matching `params` (e.g. `nnx.get_partition_spec(state)`)
            or a prefix of it (one spec per subtree), one PartitionSpec for all, or a callable
            `(leaf name, leaf) -> PartitionSpec`; None replicates everything.
        opt_state: the optax state's structure (e.g. `jax.eval_shape(optimizer.init, params)`).

    Returns:
        (params targets, opt_state targets or None): pytrees of jax.ShapeDtypeStruct with
        shardings; Python numbers (a Linen ``TrainState.step``) stay numbers, restored as such;
        numpy scalars of a 64-bit type while JAX's 64-bit types are off get numpy targets (on
        devices JAX would narrow them), restored on the host.

    Raises:
        ValueError: ``specs`` does not match ``params``, or a spec is not a PartitionSpec or does
            not fit its leaf (the leaf is named).
        TypeError: ``mesh`` is not a Mesh, or a leaf is not an array, struct or number.

    >>> mesh = make_mesh(data=-1)
    >>> p, _ = targets({"w": np.zeros((8, 4))}, mesh, PartitionSpec("data"))
    >>> p["w"].sharding.spec == PartitionSpec("data")
    True
    """
    if not isinstance(mesh, Mesh | jax.sharding.AbstractMesh):
        raise TypeError(
            f"targets: mesh is a {type(mesh).__name__} ({mesh!r:.40}); expected a "
            "jax.sharding.Mesh (ucp.make_mesh(data=..., tensor=...) makes one)"
        )
    specs = PartitionSpec() if specs is None else specs
    leaves = named_leaves(params)
    names = [n for n, _, _ in leaves]
    by_name: dict[str, Any] = {}
    out: list[Any] = []
    for name, (_, _, x), spec in zip(names, leaves, _spec_for(specs, names, params)):
        if isinstance(x, PYTHON_NUMBERS):  # a Python number (a Linen step=0)
            by_name[name] = x  # restored as a number of its type, not onto devices
            out.append(x)
            continue
        host = _host_target(x)
        if host is not None:
            by_name[name] = host
            out.append(host)
            continue
        _check_leaf(x, name)
        if not isinstance(spec, PartitionSpec):
            raise ValueError(
                f"targets: the spec for leaf {name!r} is a {type(spec).__name__} ({spec!r:.40}); "
                "expected a PartitionSpec (P('data', None), ...): specs gives one per leaf, one "
                "per subtree, one for all, or a callable (name, leaf) -> PartitionSpec"
            )
        try:
            sharding = NamedSharding(mesh, spec)
            sharding.shard_shape(np.shape(x))
            t = jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
        except Exception as e:  # JAX's own errors of a spec (DuplicateSpecError is no ValueError)
            raise ValueError(
                f"targets: leaf {name!r} of shape {np.shape(x)} cannot take {spec} on mesh "
                f"{dict(mesh.shape)}: {str(e)[:200]}; give it a spec that fits its rank and "
                "divides its dimensions"
            ) from e
        by_name[name] = t
        out.append(t)
    ptargets = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), out)
    if opt_state is None:
        return ptargets, None
    shapes = [np.shape(x) for _, _, x in leaves]
    opt: list[Any] = []
    for o in classify_opt_state(opt_state, jax.tree_util.tree_structure(params), names, shapes):
        if isinstance(o.leaf, PYTHON_NUMBERS):
            opt.append(o.leaf)
            continue
        host = _host_target(o.leaf)
        if host is not None:
            opt.append(host)
            continue
        _check_leaf(o.leaf, o.name)
        mirrored = getattr(by_name.get(o.param), "sharding", None) if o.param is not None else None
        opt.append(jax.ShapeDtypeStruct(np.shape(o.leaf), o.leaf.dtype,
                                        sharding=mirrored or NamedSharding(mesh, PartitionSpec())))  # fmt: skip
    return ptargets, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(opt_state), opt)


def _check_leaf(x: Any, name: str) -> None:
    """A target leaf has a shape and a dtype (Python numbers are taken before)."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(
            f"targets: leaf {name!r} is a {type(x).__name__} ({x!r:.40}); expected an array, "
            "a jax.ShapeDtypeStruct or a Python number"
        )
