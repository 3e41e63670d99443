"""Builders for test train states on arbitrary meshes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def fit_shape(shape: Sequence[int], devices: int | None = None) -> tuple[int, ...]:
    """`shape`, with its largest axes halved until it fits on the devices there (accelerator runs).

    On 8 forced CPU devices every mesh of the tests fits and comes back unchanged.
    """
    have = jax.device_count() if devices is None else devices
    out = [int(s) for s in shape]
    while int(np.prod(out)) > have:
        k = int(np.argmax(out))
        out[k] = max(1, out[k] // 2)
    return tuple(out)


def need_devices(n: int) -> None:
    """Skip the test unless `n` devices are there (it checks a layout that fewer cannot hold)."""
    import pytest

    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices, {jax.device_count()} here ({jax.default_backend()})")


def mesh_of(shape: Sequence[int], names: Sequence[str] | None = None) -> jax.sharding.Mesh:
    """A mesh of the first prod(shape) devices (shrunk by `fit_shape` where fewer are there)."""
    names = tuple(names or ("a", "b", "c")[: len(shape)])
    shape = fit_shape(shape)
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(tuple(shape)), names)


def auto_spec(shape: Sequence[int], mesh: jax.sharding.Mesh, style: str = "spread") -> P:
    """A PartitionSpec for `shape` on `mesh`.

    'spread': axis k of the array on mesh axis k where it divides; 'fsdp': the first axis over all
    mesh axes together; 'replicated': nothing sharded.
    """
    names = list(mesh.axis_names)
    if style == "replicated" or not shape:
        return P()
    if style == "fsdp":
        total = int(np.prod([mesh.shape[n] for n in names]))
        return P(tuple(names)) if shape[0] % total == 0 and shape[0] else P()
    spec: list[Any] = []
    for k, d in enumerate(shape):
        if k < len(names) and d and d % mesh.shape[names[k]] == 0:
            spec.append(names[k])
        else:
            spec.append(None)
    return P(*spec)


def place(tree: Any, mesh: jax.sharding.Mesh | None, style: str = "spread") -> Any:
    """device_put every leaf with auto_spec on `mesh` (or onto device 0 when mesh is None)."""

    def put(x: Any) -> Any:
        x = jnp.asarray(x)
        if mesh is None:
            return jax.device_put(x, jax.devices()[0])
        return jax.device_put(x, NamedSharding(mesh, auto_spec(x.shape, mesh, style)))

    return jax.tree.map(put, tree)


def targets(tree: Any, mesh: jax.sharding.Mesh, style: str = "spread") -> Any:
    """ShapeDtypeStructs with NamedShardings for every leaf of `tree`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, auto_spec(x.shape, mesh, style))
        ),
        tree,
    )


def float_params(seed: int = 0) -> dict[str, Any]:
    """Float params of several shapes and dtypes (a scalar too)."""
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "kernel": rng.standard_normal((16, 24), np.float32),
            "bias": rng.standard_normal(24, np.float32),
        },
        "emb": {"embedding": rng.standard_normal((32, 8)).astype(jnp.bfloat16)},
        "scale": np.float32(rng.standard_normal()),
    }


def mixed_params(seed: int = 0) -> dict[str, Any]:
    """Params of every dtype the format must carry: f32, bf16, int32, zero-size, scalar."""
    rng = np.random.default_rng(seed)
    return {
        "f32": rng.standard_normal((16, 8), np.float32),
        "bf16": rng.standard_normal((8, 16)).astype(jnp.bfloat16),
        "i32": rng.integers(-(2**31), 2**31 - 1, (24, 4), dtype=np.int32),
        "empty": np.zeros((0, 8), np.float32),
        "scalar": np.float32(3.25),
        "iscalar": np.int32(7),
    }


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "multisteps_adam": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}


def trained_state(opt: optax.GradientTransformation, params: Any, steps: int = 2) -> Any:
    """Opt state after `steps` updates with random grads, so moments and counts are non-trivial."""
    state = opt.init(params)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.standard_normal(np.shape(p)), dtype=jnp.asarray(p).dtype),
            params,
        )
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def save_layout(
    path: Any, params: Any, opt_state: Any = None, *, layout: str, step: int | None = None
) -> None:
    """`ucp.save` in a given layout ('per-array': format version 2, one file per chunk)."""
    from ucp_jax._src.save import SaveJob

    SaveJob(path, params, opt_state, step=step, rules=(), extra=None, overwrite=False,
            layout=layout).write(None)  # fmt: skip


def ocdbt_values(path: Any) -> dict[str, tuple[str, int, int]]:
    """Key -> (data file, offset, length) of every value in a version-3 checkpoint's root database.

    `path`: a local folder (data files as paths), or a kvstore spec dict (data files as keys
    relative to it).
    """
    import os

    import tensorstore as ts

    local = not isinstance(path, dict)
    spec = {"driver": "file", "path": os.fspath(path) + "/"} if local else path
    base = ts.KvStore.open(spec).result()
    out: dict[str, tuple[str, int, int]] = {}
    todo = [ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]]
    while todo:
        node = ts.ocdbt.dump(base, todo.pop()).result()
        for e in node["entries"]:
            if "node" in e:
                todo.append(e["node"])
            elif "indirect_value" in e:
                _, rest = e["indirect_value"].split(":", 1)
                prefix, name, off, n = rest.split(":")
                where = os.path.join(os.fspath(path), prefix + name) if local else prefix + name
                out[e["key"].decode()] = (where, int(off), int(n))
    return out
