"""Deterministic train states and shard checks shared by the subprocess workers and the tests.

Imported as `state` by the worker scripts (run from this folder) and as `mp.state` by the tests.
`helpers` (tests/helpers.py) must be importable: the workers put tests/ on sys.path.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from helpers import auto_spec, trained_state
from jax.sharding import NamedSharding

LR = 1e-2


def reference_state() -> tuple[Any, Any]:
    """Params of several shapes and dtypes (bf16, a scalar) and adamw state after 2 updates.

    Computed on the local default device only, so every process (of any job) gets the same bits.
    Returns numpy trees (bf16 as ml_dtypes.bfloat16).
    """
    rng = np.random.default_rng(1234)
    params = {
        "dense": {
            "kernel": rng.standard_normal((16, 24), np.float32),
            "bias": rng.standard_normal(24, np.float32),
        },
        "emb": {"embedding": rng.standard_normal((32, 8)).astype(jax.numpy.bfloat16)},
        "layers": {"w": rng.standard_normal((4, 16, 8), np.float32)},
        "head": rng.standard_normal((8, 40)).astype(jax.numpy.bfloat16),
        "scale": np.float32(rng.standard_normal()),
    }
    # On the CPU backend, like the workers' jobs: an accelerator's arithmetic differs in the last bits.
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        params, opt_state = trained_state(optax.adamw(LR), params, steps=2)
        return jax.device_get(params), jax.device_get(opt_state)


def _np(x: Any) -> np.ndarray:
    return np.asarray(x)


def globalize(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Global jax.Arrays (auto_spec sharding on `mesh`) built from the same numpy data everywhere."""

    def one(x: Any) -> jax.Array:
        ref = _np(x)
        sharding = NamedSharding(mesh, auto_spec(ref.shape, mesh))
        return jax.make_array_from_callback(ref.shape, sharding, lambda idx: np.asarray(ref[idx]))

    return jax.tree.map(one, tree)


def targets_on(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """ShapeDtypeStructs with auto_spec NamedShardings on `mesh` for every leaf of `tree`."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        ref = _np(x)
        sharding = NamedSharding(mesh, auto_spec(ref.shape, mesh))
        return jax.ShapeDtypeStruct(ref.shape, ref.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def check_shards(restored: Any, ref: Any, targets: Any, what: str) -> int:
    """Every addressable shard of every restored leaf equals the reference, bit for bit.

    Also checks tree structure, shape, dtype and sharding. Returns the number of shards checked.
    """
    got, tdef = jax.tree_util.tree_flatten_with_path(restored)
    want, rdef = jax.tree_util.tree_flatten(ref)
    tgts = jax.tree_util.tree_leaves(targets)
    assert tdef == jax.tree_util.tree_structure(ref), f"{what}: tree {tdef} != {rdef}"
    n = 0
    for (path, arr), r, t in zip(got, want, tgts):
        where = f"{what}: {jax.tree_util.keystr(path)}"
        r = _np(r)
        assert isinstance(arr, jax.Array), f"{where}: got {type(arr).__name__}"
        assert arr.shape == r.shape, f"{where}: shape {arr.shape} != {r.shape}"
        assert arr.dtype == r.dtype, f"{where}: dtype {arr.dtype} != {r.dtype}"
        assert arr.sharding == t.sharding, f"{where}: sharding {arr.sharding} != {t.sharding}"
        assert arr.addressable_shards, f"{where}: no addressable shards"
        for s in arr.addressable_shards:
            data, expect = np.asarray(s.data), np.asarray(r[s.index])
            assert data.dtype == expect.dtype and data.shape == expect.shape, where
            # bytes, not values: bit-exact for bf16 and NaN-safe
            assert data.tobytes() == expect.tobytes(), f"{where}: shard {s.index} differs"
            n += 1
    return n


def global_state(pid: int) -> tuple[Any, Any, Any, Any]:
    """The reference state as global arrays on the 2-process (2, 4) save mesh.

    Process `pid` holds mesh row `pid`, so arrays sharded on 'a' are split between processes.

    Returns:
        (reference params, reference opt state, params, opt state), numpy then jax.Array trees.
    """
    from helpers import mesh_of

    ref_params, ref_opt = reference_state()
    save_mesh = mesh_of((2, 4))
    assert {d.process_index for d in save_mesh.devices[pid]} == {pid}
    params = globalize(ref_params, save_mesh)
    opt_state = globalize(ref_opt, save_mesh)
    assert not params["dense"]["kernel"].is_fully_addressable
    return ref_params, ref_opt, params, opt_state
