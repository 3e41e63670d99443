"""The zarr.json check (format/zarr_json.py) against the zarr.json TensorStore itself writes, and
its kept verdicts: the same bytes pass only for the expectation they were checked against, other
bytes are checked afresh, and a hostile checkpoint's many distinct files do not grow the memo."""

from __future__ import annotations

import hashlib
import json
import types
from pathlib import Path

import pytest
import tensorstore as ts

from ucp_jax._src.errors import ChecksumError
from ucp_jax._src.format import store, zarr_json
from ucp_jax._src.format.manifest import SlotInfo


def _written_by_tensorstore(tmp_path: Path, shape: tuple[int, ...], si: SlotInfo) -> bytes:
    spec = store.array_spec(store.Location.parse(str(tmp_path)), shape, si)
    ts.open(spec, create=True).result()
    return (tmp_path / si.path / "zarr.json").read_bytes()


def _meta(raw: bytes) -> types.SimpleNamespace:
    return types.SimpleNamespace(state="value", value=raw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("inner", [None, (4, 8)])
def test_kept_verdicts_hold_only_for_what_was_checked(
    tmp_path: Path, dtype: str, inner: tuple[int, int] | None
) -> None:
    zarr_json._VERDICTS.clear()
    raw = _written_by_tensorstore(tmp_path, (16, 32), SlotInfo(dtype, "a", (8, 16), inner))
    sha = hashlib.sha256(raw).hexdigest()
    si = SlotInfo(dtype, "b", (8, 16), inner, meta_sha256=sha)
    for _ in range(2):  # checked, then the kept verdict
        zarr_json.check_zarr_json(_meta(raw), (16, 32), si, "here")
    assert len(zarr_json._VERDICTS) == 1
    # the same bytes against another expectation: not the kept verdict
    with pytest.raises(ChecksumError, match=r"here: zarr\.json says shape"):
        zarr_json.check_zarr_json(_meta(raw), (16, 64), si, "here")
    other = "float64" if dtype != "float64" else "float32"
    with pytest.raises(ChecksumError, match="says data_type"):
        zarr_json.check_zarr_json(
            _meta(raw), (16, 32), SlotInfo(other, "b", (8, 16), inner), "there"
        )
    # other bytes (same JSON, one field changed) with their own digest: checked afresh
    doc = json.loads(raw)
    doc["shape"] = [16, 48]
    bad = json.dumps(doc).encode()
    unsealed = SlotInfo(dtype, "b", (8, 16), inner)
    with pytest.raises(ChecksumError, match="says shape"):
        zarr_json.check_zarr_json(_meta(bad), (16, 32), unsealed, "here")
    with pytest.raises(ChecksumError, match="sha256 differs"):
        zarr_json.check_zarr_json(_meta(bad), (16, 32), si, "here")
    with pytest.raises(ChecksumError, match=r"zarr\.json is missing"):
        zarr_json.check_zarr_json(types.SimpleNamespace(state="missing"), (16, 32), si, "x")


def test_many_distinct_files_keep_the_memo_bounded() -> None:
    zarr_json._VERDICTS.clear()
    si = SlotInfo("float32", "a", (4,))
    for k in range(zarr_json._KEEP + 10):
        with pytest.raises(ChecksumError):
            zarr_json.check_zarr_json(_meta(b'{"k": %d}' % k), (8,), si, "hostile")
    assert len(zarr_json._VERDICTS) <= zarr_json._KEEP


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", "float16", "float64", "int8", "uint8", "int32", "bool"]
)
@pytest.mark.parametrize(
    ("shape", "chunks", "inner"),
    [((), (), None), ((7,), (4,), None), ((16, 32), (8, 16), (4, 8)), ((3, 5, 6), (3, 5, 6), None),
     ((2048, 768), (256, 768), (32, 96))],
)  # fmt: skip
def test_zarr_json_bytes_are_what_tensorstore_writes(
    tmp_path: Path, dtype: str, shape: tuple[int, ...], chunks: tuple[int, ...],
    inner: tuple[int, ...] | None,
) -> None:  # fmt: skip
    """The bytes a writer puts under an array's key are those TensorStore writes when it creates
    the array on disk, and TensorStore opens and reads the array written with them."""
    si = SlotInfo(dtype, "a", chunks, inner)
    want = _written_by_tensorstore(tmp_path / "ts", shape, si)
    got = zarr_json.zarr_json_bytes(shape, si)
    assert got == want
    (tmp_path / "ours" / "a").mkdir(parents=True)
    (tmp_path / "ours" / "a" / "zarr.json").write_bytes(got)
    loc = store.Location.parse(str(tmp_path / "ours"))
    arr = ts.open(store.array_spec(loc, shape, si), open=True).result()
    assert tuple(arr.shape) == shape and str(arr.dtype.numpy_dtype) == dtype
