"""Every data type zarr3 stores is saved and restored bit-exact; the others are refused up front.

TensorStore writes the `bytes` codec of a type of one byte or less an element without an endian
(float8s, float4, int4, int2, as int8 and bool); the restore's check of each array's zarr.json
must take that as the little-endian layout the manifest records, or a checkpoint holding such a
leaf is written and then refused as damaged. Types TensorStore cannot store (uint4, uint2,
float8_e4m3 in this version) fail the save before anything is written, naming the leaf.
"""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp
from ucp_jax._src.cli import verify_checkpoint
from ucp_jax._src.format import zarr_json
from ucp_jax._src.frameworks.common.writer import AtomWriter

ONE_BYTE = sorted(zarr_json.ONE_BYTE_TYPES - {"bool", "int8", "uint8"})
WIDER = ["float16", "bfloat16", "float32", "int16", "uint16", "int32", "uint32", "complex64"]


def jnp_dtype(name: str):
    dt = getattr(jnp, name, None)
    if dt is None:
        pytest.skip(f"this jax has no {name}")
    return dt


def state_of(name: str) -> jax.Array:
    """A (64, 64) leaf of `name` sharded over a (2, 4) mesh, its values all distinct bytes where
    the type allows (small integers otherwise)."""
    dt = jnp_dtype(name)
    mesh = mesh_of((2, 4), ("data", "model"))
    values = np.arange(64 * 64).reshape(64, 64) % 7 - 3
    if name.startswith("uint") or name == "float8_e8m0fnu":
        values = np.abs(values)
    return jax.device_put(jnp.asarray(values, dtype=dt), NamedSharding(mesh, P("data", "model")))


def resharded(x: jax.Array) -> jax.ShapeDtypeStruct:
    other = mesh_of((4, 2), ("data", "model"))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P("model", "data")))


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
@pytest.mark.parametrize("direct_read", ["1", "0"], ids=["direct-read", "tensorstore-read"])
@pytest.mark.parametrize("name", ONE_BYTE + WIDER)
def test_saved_and_restored_bit_exact(tmp_path, monkeypatch, name, layout, direct_read):
    monkeypatch.setenv("UCP_LAYOUT", layout)
    monkeypatch.setenv("UCP_DIRECT_READ", direct_read)
    x = state_of(name)
    ucp.save(tmp_path / "ck", {"w": x}, step=3)
    params, _ = ucp.restore(tmp_path / "ck", {"w": resharded(x)})
    got = params["w"]
    assert got.dtype == x.dtype
    assert got.sharding == resharded(x).sharding
    assert np.asarray(got).tobytes() == np.asarray(x).tobytes()
    out = io.StringIO()
    assert verify_checkpoint(str(tmp_path / "ck"), out) == 0, out.getvalue()


@pytest.mark.parametrize("name", ["uint4", "uint2", "float8_e4m3"])
def test_a_type_zarr3_cannot_store_fails_before_writing(tmp_path, name):
    if name in zarr_json.STORABLE_TYPES:
        pytest.skip(f"{name} is storable here")
    x = state_of(name)
    with pytest.raises(TypeError, match=rf"save: leaf 'w' has dtype {name}, which zarr3.*Cast it"):
        ucp.save(tmp_path / "ck", {"w": x, "ok": jnp.ones((4,))}, step=1)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "int4", "bfloat16"])
def test_imported_atoms_of_each_type_restore_bit_exact(tmp_path, monkeypatch, name, layout):
    """What importers write (an FP8 safetensors file read as float8_e4m3fn, say) goes through the
    importers' writer, not `ucp.save`: its arrays restore bit-exact too."""
    monkeypatch.setenv("UCP_LAYOUT", layout)
    x = np.asarray(state_of(name))
    with AtomWriter(tmp_path / "ck") as w:
        w.atom("w", x.shape)
        w.write("w", "fp32", ((0, 64), (0, 64)), x)
        w.commit(step=1, source={"framework": "test"})
    target = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=resharded(state_of(name)).sharding)
    params, _ = ucp.restore(tmp_path / "ck", {"w": target})
    assert np.asarray(params["w"]).tobytes() == x.tobytes()


def test_an_import_of_a_type_zarr3_cannot_store_fails_before_committing(tmp_path):
    dt = jnp_dtype("uint4")
    if "uint4" in zarr_json.STORABLE_TYPES:
        pytest.skip("uint4 is storable here")
    refused = pytest.raises(TypeError, match=r"import: atom 'w' slot 'fp32' has dtype uint4")
    with refused, AtomWriter(tmp_path / "ck") as w:
        w.atom("w", (8,))
        w.write("w", "fp32", ((0, 8),), np.zeros(8, dtype=dt))
        w.commit(step=1, source={"framework": "test"})
    assert not (tmp_path / "ck" / "COMMIT").exists()
