"""An array's zarr.json: checked against the manifest before anything of the array is read, and
written by a writer that creates many arrays at once.

A checkpoint from elsewhere is untrusted: the zarr.json TensorStore would decode with must be the
one committed (its sha256, format version 2) and say what the manifest says (shape, data type,
chunk grid, codecs). A model's checkpoint holds hundreds of arrays whose zarr.json are byte for
byte the same (every layer's matrices, and an optimizer slot beside each), so a verdict is kept
per distinct (sha256 of the bytes, expected array): the same bytes checked against the same
expectation are not parsed again.

The same repetition makes creating arrays cheap: `zarr_json_bytes` asks TensorStore once per
distinct (shape, dtype, chunks, inner chunks) for the zarr.json it writes when it creates such an
array (on an in-memory store), and a writer puts those bytes under each array's key in its open
transaction, a few microseconds each instead of a `tensorstore.open(create=True)` (about 0.1 ms of
the writing thread each).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

from ..errors import ChecksumError
from ..untrusted.json import read_json
from . import store
from .folders import MAX_ZARR_JSON_BYTES
from .manifest import SlotInfo

__all__ = ["check_zarr_json", "zarr_json_bytes"]


def zarr_json_bytes(shape: tuple[int, ...], si: SlotInfo) -> bytes:
    """The zarr.json TensorStore writes when it creates an array of `shape` stored as `si`.

    >>> import types
    >>> si = SlotInfo("float32", "a", (4,))
    >>> created = types.SimpleNamespace(state="value", value=zarr_json_bytes((8,), si))
    >>> check_zarr_json(created, (8,), si, "here")
    """
    inner = None if si.inner_chunks is None else tuple(si.inner_chunks)
    return _created(tuple(int(d) for d in shape), si.dtype, tuple(si.chunks), inner)


@functools.lru_cache(maxsize=256)
def _created(shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...],
             inner: tuple[int, ...] | None) -> bytes:  # fmt: skip
    import tensorstore as ts

    mem = store.Location.parse("memory://")
    spec = store.array_spec(mem, shape, SlotInfo(dtype, "a", chunks, inner))
    ctx = ts.Context()  # its own memory store: nothing shared with another call
    ts.open(spec, create=True, context=ctx).result()
    got = ts.KvStore.open(spec["kvstore"], context=ctx).result().read("zarr.json").result()
    return bytes(got.value)


def check_zarr_json(meta: Any, shape: tuple[int, ...], si: SlotInfo, where: str) -> None:
    """The array's zarr.json (`meta`, a TensorStore kvstore read result) is the one committed and
    agrees with the manifest's `shape` and slot `si`.

    Raises:
        ChecksumError: it is missing, not the one committed, or says something else.

    >>> import types
    >>> si = SlotInfo("float32", "a", (4,))
    >>> raw = store.array_spec(store.Location.parse("/"), (8,), si)["metadata"]
    >>> import json
    >>> ok = types.SimpleNamespace(state="value", value=json.dumps(raw).encode())
    >>> check_zarr_json(ok, (8,), si, "here")
    >>> check_zarr_json(ok, (16,), si, "here")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ucp_jax._src.errors.ChecksumError: here: zarr.json says shape [8], the manifest [16]; ...
    """
    if meta.state != "value":
        raise ChecksumError(f"{where}: zarr.json is missing; the checkpoint is damaged")
    raw = bytes(meta.value)
    digest = hashlib.sha256(raw).hexdigest()
    if si.meta_sha256 is not None and digest != si.meta_sha256:
        raise ChecksumError(
            f"{where}: zarr.json is not the one committed (sha256 differs); it was edited or "
            "damaged: restore an earlier checkpoint"
        )
    shape, chunks = tuple(shape), tuple(si.chunks)
    inner = None if si.inner_chunks is None else tuple(si.inner_chunks)
    key = (digest, shape, si.dtype, chunks, inner)
    problem = _VERDICTS.get(key, _UNSEEN)
    if problem is _UNSEEN:
        problem = _problem(raw, SlotInfo(si.dtype, "", chunks, inner), shape)
        if len(_VERDICTS) >= _KEEP:  # a hostile checkpoint's many distinct files: bounded
            _VERDICTS.clear()
        _VERDICTS[key] = problem
    if problem is not None:
        raise ChecksumError(f"{where}: {problem}")


# The zarr3 data types of one byte or less an element (numpy/ml_dtypes hold each in one byte),
# whose `bytes` codec TensorStore writes without an endian.
ONE_BYTE_TYPES = frozenset(
    ["bool", "int2", "int4", "int8", "uint8", "float4_e2m1fn", "float8_e8m0fnu"]
    + [f"float8_{k}" for k in ("e3m4", "e4m3fn", "e4m3fnuz", "e4m3b11fnuz", "e5m2", "e5m2fnuz")]
)
# The zarr3 data types TensorStore stores (others, such as uint4 or float8_e4m3, it refuses).
STORABLE_TYPES = ONE_BYTE_TYPES | frozenset(
    ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
    + [f"{u}int{b}" for u in ("", "u") for b in (16, 32, 64)]
)


def check_storable(data_type: str, where: str) -> None:
    """Refuse a data type zarr3 (TensorStore) cannot store, before anything is written.

    Raises:
        TypeError: `data_type` is not in STORABLE_TYPES; the message starts with `where`.

    >>> check_storable("float8_e4m3fn", "save: leaf 'w'")
    >>> check_storable("uint4", "save: leaf 'w'")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: save: leaf 'w' has dtype uint4, which zarr3 (TensorStore) cannot store; ...
    """
    if data_type not in STORABLE_TYPES:
        raise TypeError(
            f"{where} has dtype {data_type}, which zarr3 (TensorStore) cannot store; the types it "
            f"stores: {', '.join(sorted(STORABLE_TYPES))}. Cast it to one of them (e.g. uint4 to "
            "uint8) first"
        )


# (sha256 of the bytes, shape, dtype, chunks, inner chunks) -> what is wrong, or None: the
# digest, not the bytes (up to 1 MiB each in a hostile checkpoint), is what is kept
_VERDICTS: dict[tuple[Any, ...], str | None] = {}
_UNSEEN: Any = object()
_KEEP = 1024


def _problem(raw: bytes, si: SlotInfo, shape: tuple[int, ...]) -> str | None:
    """What is wrong with zarr.json bytes `raw` for an array of `shape` stored as `si`, or None."""
    try:
        doc = read_json(raw, "zarr.json", max_bytes=MAX_ZARR_JSON_BYTES, error=ChecksumError)
    except ChecksumError as e:
        return str(e)
    want = store.array_spec(store.Location.parse("/"), shape, si)["metadata"]
    got = {k: doc.get(k) for k in want} if isinstance(doc, dict) else {}
    codecs, data_type = got.get("codecs"), got.get("data_type")
    if isinstance(codecs, list) and isinstance(data_type, str):
        got["codecs"] = _one_byte_endian(codecs, data_type)
    for field in want:
        if got.get(field) != want[field]:
            return (
                f"zarr.json says {field} {got.get(field)!r}, the manifest {want[field]!r}; "
                "the checkpoint is damaged: restore an earlier one"
            )
    return None


def _one_byte_endian(codecs: list[Any], data_type: str) -> list[Any]:
    """`codecs` with the `bytes` codec's endian spelled out for a one-byte data type.

    zarr3 leaves a one-byte type's endian unset and TensorStore writes `{"name": "bytes"}` for
    every type of one byte (or less) an element, where the manifest's spec says little-endian:
    the same layout.

    >>> _one_byte_endian([{"name": "bytes"}, {"name": "crc32c"}], "float8_e4m3fn")[0]
    {'name': 'bytes', 'configuration': {'endian': 'little'}}
    """
    if data_type not in ONE_BYTE_TYPES:
        return codecs
    out: list[Any] = []
    for c in codecs:
        if isinstance(c, dict) and c == {"name": "bytes"}:
            c = {"name": "bytes", "configuration": {"endian": "little"}}
        elif isinstance(c, dict) and c.get("name") == "sharding_indexed":
            conf = c.get("configuration")
            if isinstance(conf, dict) and isinstance(conf.get("codecs"), list):
                c = {
                    **c,
                    "configuration": {
                        **conf,
                        "codecs": _one_byte_endian(conf["codecs"], data_type),
                    },
                }
        out.append(c)
    return out
