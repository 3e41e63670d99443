"""Encode stored chunks (zarr3 shards) in Python: what a save writes as raw kvstore values.

TensorStore's array write copies a region into its chunk buffers, checksums every chunk with
absl's portable CRC32C (the pip wheels are built without the x86 CRC instructions) and assembles
the shard: 13-22% of a save's CPU went to that CRC alone. A region that covers whole shards of an
array ucp stores itself (zarr3; `bytes` little-endian then `crc32c`, optionally inside
`sharding_indexed` with the same codecs on the index; see `store.array_spec`) is encoded here
instead and written as one value per shard through the database's kvstore, in the save's own
transaction. The layout is the one format/direct.py reads:

* an unsharded chunk: its elements in C order, then their crc32c (4 bytes, little-endian);
* a shard: every inner chunk in C order of the inner grid, each its elements in C order and
  their crc32c, then the index, an (offset, nbytes) pair of little-endian uint64 per inner
  chunk in that same order (nbytes counting the trailer), then the index's crc32c.

The checksums come from `crc32c` (the CPU's CRC instructions, GIL released). Knowing every
trailer, the encoder also returns the chunk's fingerprint (`integrity.fingerprint_range`'s value
for these bytes), so a writer needs not read its chunks back for its fingerprint table.

Copies: `KvStore.write` takes only `bytes` (or a `bytearray`), not a buffer view, and copies it
into TensorStore's own buffer; so an unsharded chunk is copied once here (`b"".join` of a view of
the region and its trailer), a shard once (each inner chunk straight into its place in one
`bytearray`), then once by TensorStore, then by the kernel into the page cache.
"""

from __future__ import annotations

import collections
import itertools
import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..util import config
from . import crc, scatter_read
from .manifest import SlotInfo
from .store import chunk_key

Box = Sequence[tuple[int, int]]
# Data types whose zarr3 `bytes` encoding is their numpy memory, little-endian, one element after
# another: these are encoded here. Others (packed 4-bit types, float8s, complex) go through
# TensorStore, whose encoding of them the tests do not pin down.
RAW_DTYPES = frozenset(
    ["bool", "bfloat16", "float16", "float32", "float64"]
    + [f"{u}int{b}" for u in ("", "u") for b in (8, 16, 32, 64)]
)


def available() -> bool:
    """This host encodes chunks itself: a hardware CRC32C and little-endian memory, and
    `UCP_DIRECT_WRITE` is not 0 (set it to 0 to have TensorStore encode every chunk)."""
    return config.direct_write() and crc.hardware()


def covers_whole_shards(shape: Sequence[int], info: SlotInfo, box: Box) -> bool:
    """`box` of a stored array of `shape` is a union of whole shards that need no padding.

    False where a shard would reach past the array's edge (zarr3 stores edge chunks at full
    size, padded), where the inner chunks do not tile a shard, or for a data type not in
    RAW_DTYPES: TensorStore writes those.

    >>> info = SlotInfo("float32", "a/fp32", (4, 4))
    >>> covers_whole_shards((8, 8), info, ((4, 8), (0, 8))), covers_whole_shards((8, 8), info, ((2, 6), (0, 8)))
    (True, False)
    >>> covers_whole_shards((6, 8), info, ((4, 6), (0, 8)))
    False
    """
    if info.dtype not in RAW_DTYPES or len(shape) != len(info.chunks) or len(box) != len(shape):
        return False
    for dim, c, (lo, hi) in zip(shape, info.chunks, box):
        if c <= 0 or dim % c or lo % c or hi % c or not 0 <= lo < hi <= dim:
            return False
    if info.inner_chunks is not None:
        if len(info.inner_chunks) != len(info.chunks):
            return False
        if any(i <= 0 or c % i for c, i in zip(info.chunks, info.inner_chunks)):
            return False
    return True


def shards_of(info: SlotInfo, box: Box) -> list[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """The shards `box` covers (see `covers_whole_shards`): (grid index, their slices of the
    region's data), in C order.

    >>> shards_of(SlotInfo("float32", "a", (2, 4)), ((2, 6), (0, 4)))[1]
    ((2, 0), (slice(2, 4, None), slice(0, 4, None)))
    """
    ranges = [range(lo // c, hi // c) for (lo, hi), c in zip(box, info.chunks)]
    out = []
    for idx in itertools.product(*ranges):
        rel = tuple(slice(i * c - lo, (i + 1) * c - lo)
                    for i, c, (lo, _) in zip(idx, info.chunks, box))  # fmt: skip
        out.append((tuple(idx), rel))
    return out


def _le_bytes(a: np.ndarray) -> memoryview:
    """The elements of `a` in C order as little-endian bytes (a view where `a` allows)."""
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    a = np.ascontiguousarray(a)
    return memoryview(a.reshape(-1).view(np.uint8).data)


class BufferPool:
    """Value buffers to encode into again once TensorStore has copied them: a buffer used before
    has its pages already (a fresh one is zeroed by the kernel page by page as it is filled).

    Keeps at most `keep` buffers; `take(n)` gives one of exactly `n` bytes.

    >>> pool = BufferPool(2)
    >>> b = pool.take(8); pool.give(b); pool.take(8) is b
    True
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: collections.deque[bytearray] = collections.deque()

    def take(self, n: int) -> bytearray:
        for _ in range(len(self._free)):
            try:
                buf = self._free.popleft()
            except IndexError:
                break
            if len(buf) == n:
                return buf
            self._free.append(buf)
        return bytearray(n)

    def give(self, buf: bytes | bytearray) -> None:
        if isinstance(buf, bytearray):
            self._free.append(buf)
            while len(self._free) > self.keep:
                self._free.popleft()


def encode_shard(
    data: np.ndarray, info: SlotInfo, pool: BufferPool | None = None
) -> tuple[bytes | bytearray, str]:
    """One stored chunk (shard) value of `data` (exactly one shard of `info`'s array), and its
    fingerprint. With `pool`, the value is a buffer taken from it.

    Raises:
        ValueError: `data` is not one whole shard of `info` (expected shape `info.chunks`).
    """
    if tuple(data.shape) != tuple(info.chunks):
        raise ValueError(
            f"encode_shard: {info.path}: expected one whole shard of shape {tuple(info.chunks)}, "
            f"found data of shape {tuple(data.shape)}; write partial shards through TensorStore"
        )
    if info.inner_chunks is None:
        body = _le_bytes(data)
        tr = crc.trailer(body)
        if pool is None:
            return b"".join((body, tr)), f"{zlib.crc32(tr):08x}"
        buf = pool.take(len(body) + 4)
        buf[: len(body)] = body
        buf[len(body) :] = tr
        return buf, f"{zlib.crc32(tr):08x}"
    inner = tuple(info.inner_chunks)
    grid = [c // i for c, i in zip(info.chunks, inner)]
    n = math.prod(grid)
    body_bytes = math.prod(inner) * data.dtype.itemsize
    # One buffer laid out as the value, filled by one strided copy (no temporary, one call that
    # releases the GIL): the shard's data seen as (grid..., inner...) goes into the inner chunks
    # seen in place, each chunk followed by room for its crc32c; TensorStore takes a bytearray.
    size = n * (body_bytes + 4) + 16 * n + 4
    value = bytearray(size) if pool is None else pool.take(size)
    # (The C extension walks `data` in its own order instead: numpy's copy walks the value's.)
    if not scatter_read.gather_chunks(data, inner, value, body_bytes + 4):
        le = data.dtype.newbyteorder("<") if data.dtype.byteorder == ">" else data.dtype
        nd = len(inner)
        item = data.dtype.itemsize
        inner_strides = [item * math.prod(inner[k + 1 :]) for k in range(nd)]
        grid_strides = [(body_bytes + 4) * math.prod(grid[k + 1 :]) for k in range(nd)]
        dest = np.ndarray((*grid, *inner), le, value, 0, (*grid_strides, *inner_strides))
        split = data.reshape([x for g, i in zip(grid, inner) for x in (g, i)])
        np.copyto(dest, split.transpose([*range(0, 2 * nd, 2), *range(1, 2 * nd, 2)]))
    if scatter_read.can_seal():  # every trailer in one call, the GIL released
        trailers = scatter_read.seal_chunks(value, n, body_bytes, body_bytes + 4)
    else:
        out, parts = memoryview(value), []
        for k in range(n):
            start = k * (body_bytes + 4)
            parts.append(crc.trailer(out[start : start + body_bytes]))
            out[start + body_bytes : start + body_bytes + 4] = parts[-1]
        trailers = b"".join(parts)
    index = np.empty((n, 2), "<u8")
    index[:, 0] = np.arange(n, dtype=np.uint64) * (body_bytes + 4)
    index[:, 1] = body_bytes + 4
    ibytes = memoryview(index.reshape(-1).view(np.uint8).data)
    tail = b"".join((ibytes, crc.trailer(ibytes)))
    value[n * (body_bytes + 4) :] = tail
    return value, f"{zlib.crc32(trailers, zlib.crc32(tail)):08x}"


class RawWriter:
    """Writes whole shards as raw values through one database's kvstore, in the open transaction.

    `known` collects every written chunk's fingerprint: array path -> chunk key -> fingerprint
    (`process_tables.write_process_table`'s `known`).
    """

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.bound: Any = None
        self.known: dict[str, dict[str, str]] = {}

    def bind(self, txn: Any) -> None:
        """Write into transaction `txn` from now on."""
        self.bound = self.kv.with_transaction(txn)

    def write(self, info: SlotInfo, box: Box, data: np.ndarray) -> list[Any]:
        """Encode and write the shards of `data`, the region `box` of `info`'s array (whole
        shards: see `covers_whole_shards`); return the futures of their writes (ready once each
        is recorded in the transaction)."""
        return self.put(info, encode_region(info, box, data))

    def put(
        self, info: SlotInfo, shards: Sequence[tuple[str, bytes | bytearray, str]]
    ) -> list[Any]:
        """Write shards `encode_region` encoded for `info`'s array into the bound transaction
        (TensorStore copies each value before this returns); return the futures of the writes."""
        if self.bound is None:
            raise RuntimeError("RawWriter.put: no transaction bound; call bind(txn) first")
        futs = []
        table = self.known.setdefault(info.path, {})
        for key, value, fp in shards:
            futs.append(self.bound.write(f"{info.path}/{key}", value))
            table[key] = fp
        return futs


def encode_region(
    info: SlotInfo, box: Box, data: np.ndarray, pool: BufferPool | None = None
) -> list[tuple[str, bytes | bytearray, str]]:
    """(chunk key, value, fingerprint) of every shard of `data`, the region `box` of `info`'s
    array (whole shards: see `covers_whole_shards`). Safe on any thread (the copies and the
    checksums release the GIL).

    >>> [(k, len(v)) for k, v, _ in encode_region(SlotInfo("float32", "a", (2,)), ((0, 4),),
    ...                                           np.arange(4, dtype=np.float32))]
    [('c/0', 12), ('c/1', 12)]
    """
    out = []
    for idx, rel in shards_of(info, box):
        value, fp = encode_shard(data[rel] if rel else data, info, pool)
        out.append((chunk_key(idx), value, fp))
    return out
