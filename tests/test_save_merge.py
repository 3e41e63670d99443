"""A leaf's small device regions: merged into one box only where that saves a write.

A merge copies the leaf's regions into one fresh buffer, so that many small regions cost one
write. A version-3 save that encodes whole stored shards itself writes one value per stored shard
either way, so a leaf whose regions each cover whole stored shards is written region by region,
without that copy. Regions that do not (a data type TensorStore encodes, or encoding switched
off), and the per-array layout, are still merged. Every case is restored bit-exact onto another
mesh; the copies into a merge are counted by wrapping `MergedWrite.add`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import mesh_of, need_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp
from ucp_jax._src.format import encode
from ucp_jax._src.mapping import merge

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float8_e4m3fn": jnp.float8_e4m3fn}


def small_state(dtype: str) -> dict[str, jax.Array]:
    """Small leaves (under merge.SMALL_REGION a region) sharded over a (2, 4) mesh."""
    mesh = mesh_of((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    shapes = {"w": (64, 256), "v": (128, 64), "b": (256,)}
    out = {}
    for name, shape in shapes.items():
        spec = P("model") if len(shape) == 1 else P("data", "model")
        x = rng.standard_normal(shape).astype(np.float32).astype(getattr(ml_dtypes, dtype, dtype))
        out[name] = jax.device_put(jnp.asarray(x, DTYPES[dtype]), NamedSharding(mesh, spec))
    return out


def saved_and_restored(tmp_path, monkeypatch, dtype: str) -> tuple[int, dict, dict]:
    """(regions copied into merges during the save, the state, the state restored resharded)."""
    copied = []
    add = merge.MergedWrite.add

    def counting(self, t, data):
        copied.append(t)
        return add(self, t, data)

    monkeypatch.setattr(merge.MergedWrite, "add", counting)
    state = small_state(dtype)
    ucp.save(tmp_path / "ck", state, step=1)
    other = mesh_of((4, 2), ("data", "model"))
    target = {
        k: jax.ShapeDtypeStruct(
            v.shape,
            v.dtype,
            sharding=NamedSharding(other, P("model") if v.ndim == 1 else P("model", "data")),
        )
        for k, v in state.items()
    }
    params, _ = ucp.restore(tmp_path / "ck", target)
    return len(copied), state, params


def assert_bit_exact(a: dict, b: dict) -> None:
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype, k
        assert x.tobytes() == y.tobytes(), f"leaf {k} differs after the restore"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_shard_regions_are_not_copied_into_a_merge(tmp_path, monkeypatch, dtype):
    if not encode.available():
        pytest.skip("this host does not encode shards itself (no hardware CRC32C)")
    monkeypatch.delenv("UCP_LAYOUT", raising=False)
    monkeypatch.delenv("UCP_DIRECT_WRITE", raising=False)
    copied, state, back = saved_and_restored(tmp_path, monkeypatch, dtype)
    assert copied == 0
    assert_bit_exact(state, back)


def test_regions_tensorstore_encodes_are_still_merged(tmp_path, monkeypatch):
    """float8 is not among the types encoded here: its small regions go through one merged
    TensorStore write per leaf, as before."""
    assert "float8_e4m3fn" not in encode.RAW_DTYPES
    need_devices(8)  # several regions a leaf
    monkeypatch.delenv("UCP_LAYOUT", raising=False)
    copied, state, back = saved_and_restored(tmp_path, monkeypatch, "float8_e4m3fn")
    assert copied > 0
    assert_bit_exact(state, back)


@pytest.mark.parametrize(
    "env", [{"UCP_DIRECT_WRITE": "0"}, {"UCP_LAYOUT": "per-array"}], ids=["no-encode", "per-array"]
)
def test_without_the_shard_encoder_small_regions_are_merged(tmp_path, monkeypatch, env):
    need_devices(8)  # several regions a leaf
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    copied, state, back = saved_and_restored(tmp_path, monkeypatch, "float32")
    assert copied > 0
    assert_bit_exact(state, back)
