"""Chunks read straight into scattered rows (format/scatter_read.py, its C extension).

The referees: numpy places every chunk (the expected buffer), and the `crc32c` package computes
every checksum the extension compares against; a damaged or short file must be refused, and
bounds that do not fit the buffer must be an error before anything is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import crc32c
import numpy as np
import pytest

from ucp_jax._src.format import scatter_read

pytestmark = pytest.mark.skipif(
    not scatter_read.built(), reason="the C extension is not built, or no CRC instruction here"
)


@pytest.fixture(autouse=True, params=["through the bounce buffer", "straight into place"])
def read_way(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test both ways the extension reads a run of chunks: whole into a bounce buffer and
    copied into place (short rows), or one iovec per row straight into place (long rows)."""
    from ucp_jax._src.format import _scatter_read as native

    if not hasattr(native, "bounce_below"):
        pytest.skip("the built extension predates the bounce buffer: rebuild it")
    old = native.bounce_below(1 << 62 if request.param.startswith("through") else 0)
    try:
        yield request.param
    finally:
        native.bounce_below(old)


def _file(tmp_path: Path, chunks: list[np.ndarray], gap: int = 0) -> tuple[str, list[int]]:
    """Chunks as zarr3 stores them (C-order bytes, then a little-endian crc32c), `gap` bytes of
    junk between some of them; returns the path and each chunk's offset."""
    path, offsets, pos = str(tmp_path / "chunks"), [], 0
    with open(path, "wb") as f:
        for i, c in enumerate(chunks):
            if gap and i % 3 == 2:
                f.write(b"\x5a" * gap)
                pos += gap
            raw = np.ascontiguousarray(c).tobytes()
            f.write(raw + crc32c.crc32c(raw).to_bytes(4, "little"))
            offsets.append(pos)
            pos += len(raw) + 4
    return path, offsets


def _grid(shape: tuple[int, ...], chunk: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [tuple(int(i) * c for i, c in zip(idx, chunk)) for idx in np.ndindex(*(s // c for s, c in zip(shape, chunk)))]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "uint16", "int8", "float64"])
@pytest.mark.parametrize(
    ("region", "chunk", "outer"),
    [
        ((64, 96), (16, 24), None),  # rows scattered in a C-contiguous target
        ((64, 96), (64, 96), None),  # one chunk: one run of bytes
        ((64, 96), (16, 96), None),  # whole rows: the rows merge into one iovec per chunk
        ((40, 60), (8, 12), (50, 70)),  # a view inside a larger array
        ((6, 20, 30), (3, 5, 10), None),  # 3-d
        ((3000, 4), (1500, 2), None),  # more rows than one preadv takes (IOV_MAX)
        ((512,), (64,), None),  # 1-d
    ],
)  # fmt: skip
@pytest.mark.parametrize("gap", [0, 7])
def test_chunks_land_where_numpy_puts_them(
    tmp_path: Path, dtype: str, region, chunk, outer, gap: int
) -> None:
    """Every chunk's bytes land in its box, in file order or not, contiguous in the file or not;
    nothing outside the boxes is touched."""
    rng = np.random.default_rng(7)
    want = (rng.standard_normal(region) * 100).astype(dtype)
    starts = _grid(region, chunk)
    order = rng.permutation(len(starts))  # file order differs from the grid's
    boxes = [tuple(slice(s, s + c) for s, c in zip(starts[k], chunk)) for k in order]
    path, offsets = _file(tmp_path, [want[b] for b in boxes], gap)
    base = np.full(outer or region, 3, dtype)
    out = base[tuple(slice(1, 1 + r) for r in region)] if outer else base
    fd = os.open(path, os.O_RDONLY)
    trailers = bytearray(4 * len(order))
    try:
        into = scatter_read.target(out, np.dtype(dtype))
        assert into is not None
        assert into.read(fd, offsets, [starts[k] for k in order], chunk, trailers)
    finally:
        os.close(fd)
    np.testing.assert_array_equal(out, want)
    # each chunk's trailer as read, in the order of the offsets: what a shard's fingerprint takes
    assert bytes(trailers) == b"".join(
        crc32c.crc32c(np.ascontiguousarray(want[b]).tobytes()).to_bytes(4, "little") for b in boxes
    )
    if outer:
        mask = np.ones(outer, bool)
        mask[tuple(slice(1, 1 + r) for r in region)] = False
        assert (base[mask] == 3).all()


@pytest.mark.parametrize("damage", ["data", "trailer", "short"])
def test_damaged_or_short_files_are_refused(tmp_path: Path, damage: str) -> None:
    """A flipped data byte, a flipped checksum byte, a file that ends early: the read says no
    (the caller then reads through TensorStore, which raises the checksum error)."""
    want = np.arange(32 * 48, dtype=np.float32).reshape(32, 48)
    starts = _grid(want.shape, (8, 16))
    path, offsets = _file(tmp_path, [want[s0 : s0 + 8, s1 : s1 + 16] for s0, s1 in starts])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if damage == "short":
            f.truncate(size - 100)
        else:
            at = offsets[5] + (100 if damage == "data" else 8 * 16 * 4 + 1)
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 1]))
    out = np.zeros_like(want)
    fd = os.open(path, os.O_RDONLY)
    try:
        into = scatter_read.target(out, out.dtype)
        assert into is not None
        assert not into.read(fd, offsets, starts, (8, 16))
    finally:
        os.close(fd)


def test_bounds_outside_the_buffer_are_an_error(tmp_path: Path) -> None:
    """Offsets or strides that would write outside the buffer raise before any read."""
    from ucp_jax._src.format import _scatter_read as native

    path, _ = _file(tmp_path, [np.zeros((4, 4), np.float32)])
    dst = np.zeros(64, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    i64 = lambda *v: np.asarray(v, np.int64)  # noqa: E731
    try:
        assert native.read_chunks(fd, dst, i64(0), i64(0), i64(4), i64(16), 16) == (-1, 0)
        for doff, stride in [(1, 16), (-1, 16), (0, 17), (0, -16)]:
            with pytest.raises(ValueError, match="outside the buffer"):
                native.read_chunks(fd, dst, i64(0), i64(doff), i64(4), i64(stride), 16)
        with pytest.raises(ValueError, match="outside the buffer"):
            native.read_chunks(fd, dst, i64(-5), i64(0), i64(4), i64(16), 16)
        with pytest.raises(ValueError, match="contiguous"):
            native.read_chunks(fd, np.zeros(64, np.uint8)[::2], i64(0), i64(0), i64(4), i64(16), 16)
        with pytest.raises((TypeError, BufferError)):  # read-only memory
            native.read_chunks(fd, bytes(64), i64(0), i64(0), i64(4), i64(16), 16)
    finally:
        os.close(fd)


@pytest.fixture(params=[2, 1, 0], ids=["folding", "instruction", "tables"])
def crc_way(request: pytest.FixtureRequest):
    """Each of the extension's ways to a CRC32C in turn (as far as this CPU has it)."""
    from ucp_jax._src.format import _scatter_read as native

    before = native.crc_way(request.param)
    try:
        yield native.crc_way(-1)
    finally:
        native.crc_way(before)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 767, 768, 769, 1536, 4099, 1 << 20])
def test_crc32c_equals_the_crc32c_package(n: int, crc_way: int) -> None:
    """The extension's CRC32C (folded, three interleaved streams joined, or by tables) equals the
    `crc32c` package's."""
    from ucp_jax._src.format import _scatter_read as native

    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert native.crc32c(data) == crc32c.crc32c(data)


def test_crc32c_of_every_length_and_alignment(crc_way: int) -> None:
    """Every length up to 1100 bytes from each of four alignments: the folding's 64-byte blocks,
    its 16-byte tail and the bytes after it, against the `crc32c` package."""
    from ucp_jax._src.format import _scatter_read as native

    data = np.random.default_rng(7).integers(0, 256, 1104, dtype=np.uint8).tobytes()
    wrong = [
        (start, n)
        for start in range(4)
        for n in range(1101)
        if native.crc32c(data[start : start + n]) != crc32c.crc32c(data[start : start + n])
    ]
    assert not wrong, f"{len(wrong)} lengths differ, first {wrong[:3]}"


def test_crc_way_falls_back_to_what_the_cpu_has() -> None:
    """Asking for a way returns the one before; a way above the best this CPU has gives the best;
    the module's CRC (format/crc.py) follows the extension's way and agrees either way."""
    from ucp_jax._src.format import _scatter_read as native
    from ucp_jax._src.format import crc

    best = native.crc_way(-1)
    try:
        assert native.crc_way(0) == best and native.crc_way(-1) == 0
        assert crc.value(b"123456789") == 0xE3069283
        assert native.crc_way(5) == 0 and native.crc_way(-1) == best
        assert crc.value(b"123456789") == 0xE3069283
    finally:
        native.crc_way(best)


def test_not_usable_where_rows_are_not_contiguous() -> None:
    """A transposed target (last axis strided), another dtype, or the switch off: not usable."""
    a = np.zeros((8, 8), np.float32)
    assert scatter_read.target(a, np.dtype(np.float32)) is not None
    assert scatter_read.target(a.T, np.dtype(np.float32)) is None
    assert scatter_read.target(a, np.dtype(np.int32)) is None
    assert scatter_read.target(np.zeros((), np.float32), np.dtype(np.float32)) is None
    os.environ["UCP_SCATTER_READ"] = "0"
    try:
        assert scatter_read.target(a, np.dtype(np.float32)) is None
    finally:
        del os.environ["UCP_SCATTER_READ"]


@pytest.mark.parametrize("seed", range(12))
def test_random_geometries(tmp_path: Path, seed: int) -> None:
    """Random ranks (1-4), chunk shapes, item sizes, offsets inside a larger array and chunk
    subsets in random file order: every chunk lands where numpy puts it, nothing else moves."""
    rng = np.random.default_rng(1000 + seed)
    ndim = int(rng.integers(1, 5))
    chunk = tuple(int(c) for c in rng.integers(1, 9, ndim))
    grid = tuple(int(g) for g in rng.integers(1, 4, ndim))
    region = tuple(c * g for c, g in zip(chunk, grid))
    dtype = np.dtype(rng.choice(["uint8", "int16", "float32", "float64"]))
    pad = tuple(int(p) for p in rng.integers(0, 3, ndim))
    base = np.zeros(tuple(r + 2 * p for r, p in zip(region, pad)), dtype)
    out = base[tuple(slice(p, p + r) for p, r in zip(pad, region))]
    want = rng.integers(1, 100, region).astype(dtype)
    starts = _grid(region, chunk)
    keep = [k for k in rng.permutation(len(starts)) if rng.random() < 0.7] or [0]
    boxes = [tuple(slice(s, s + c) for s, c in zip(starts[k], chunk)) for k in keep]
    path, offsets = _file(tmp_path, [want[b] for b in boxes], gap=int(rng.integers(0, 2)) * 5)
    fd = os.open(path, os.O_RDONLY)
    try:
        into = scatter_read.target(out, dtype)
        assert into is not None
        assert into.read(fd, offsets, [starts[k] for k in keep], chunk)
    finally:
        os.close(fd)
    expect = np.zeros_like(base)
    inner = expect[tuple(slice(p, p + r) for p, r in zip(pad, region))]
    for b in boxes:
        inner[b] = want[b]
    np.testing.assert_array_equal(base, expect)


def test_read_at_reads_each_offset_or_says_no(tmp_path: Path) -> None:
    """`read_at` gives the bytes at every offset, joined in the order asked, as Python's own
    `os.pread` does; a read past the end is None; bad arguments are refused before any read."""
    data = np.random.default_rng(1).integers(0, 256, 5000, np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    offsets = [4996, 0, 1234, 4096, 7]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert scatter_read.read_at(fd, offsets, 4) == b"".join(os.pread(fd, 4, o) for o in offsets)
        assert scatter_read.read_at(fd, [], 4) == b""
        assert scatter_read.read_at(fd, [0, 4997], 4) is None  # the file ends first
        with pytest.raises(ValueError):
            scatter_read.read_at(fd, [-1], 4)
        from ucp_jax._src.format import _scatter_read as native

        with pytest.raises(ValueError):
            native.read_at(fd, np.zeros(3, np.int64), 4, bytearray(11))  # room for 2 reads
        with pytest.raises(TypeError):
            native.read_at(fd, np.zeros(3, np.int32), 4, bytearray(12))  # not int64 offsets
    finally:
        os.close(fd)


def _shard_file(tmp_path: Path, want: np.ndarray, inner: tuple[int, ...], drop: int | None = None):
    """A zarr3 `sharding_indexed` shard of `want` built by hand: inner chunks (C-order bytes and
    a crc32c each) in a shuffled order, then the index ((offset, nbytes) per chunk, u64 little
    endian, `drop`'s entry marked missing) and its crc32c. Returns path, grid, the index bytes,
    and each listed chunk's trailer in index order."""
    grid = [s // i for s, i in zip(want.shape, inner)]
    cells = list(np.ndindex(*grid))
    order = np.random.default_rng(5).permutation(len(cells))
    index = np.full((len(cells), 2), 2**64 - 1, np.uint64)
    trailers: dict[int, bytes] = {}
    body = b""
    for k in order:
        if k == drop:
            continue
        box = tuple(slice(c * i, (c + 1) * i) for c, i in zip(cells[k], inner))
        raw = np.ascontiguousarray(want[box]).tobytes()
        trailers[int(k)] = crc32c.crc32c(raw).to_bytes(4, "little")
        index[k] = (len(body), len(raw) + 4)
        body += raw + trailers[int(k)]
    ix = index.astype("<u8").tobytes()
    path = tmp_path / "shard"
    path.write_bytes(b"\x00" * 3 + body + ix + crc32c.crc32c(ix).to_bytes(4, "little"))
    listed = b"".join(trailers[k] for k in range(len(cells)) if k in trailers)
    return str(path), grid, ix + crc32c.crc32c(ix).to_bytes(4, "little"), listed


@pytest.mark.parametrize("dtype", ["float32", "uint16", "int8"])
def test_read_shard_places_checks_and_lists_like_the_format_says(
    tmp_path: Path, dtype: str
) -> None:
    """The C shard reader against a shard built here from the zarr3 spec: the inner chunks of
    the asked grid box land where numpy puts them (a target cut out of a larger array, so the
    shard's origin lies before it), the index comes back as written, `listed` is every listed
    chunk's trailer in index order (a missing chunk left out); a missing chunk inside the box,
    a damaged index or chunk, or a short file is refused, not returned."""
    want = (np.random.default_rng(2).standard_normal((12, 32)) * 50).astype(dtype)
    inner = (4, 8)
    path, grid, index, listed = _shard_file(tmp_path, want, inner, drop=0)
    size = os.path.getsize(path)
    base = np.full((16, 40), 7, dtype)
    out = base[2:14, 4:36]  # the target holds rows 4.. and columns 8.. of `want`
    out_origin = (4, 8)
    place = scatter_read.target(out[:, :], np.dtype(dtype))
    assert place is not None
    lo, hi = (1, 1), (3, 4)  # grid box: rows 4..12, columns 8..32
    fd = os.open(path, os.O_RDONLY)
    try:
        origin = [-o for o in out_origin]
        ok, got_index, got_listed = place.read_shard(
            fd, (3, size - 3), grid, inner, lo, hi, origin, True
        )
        assert ok and got_index == index and got_listed == listed
        np.testing.assert_array_equal(out[: 12 - 4, : 32 - 8], want[4:, 8:])
        assert (base[:2] == 7).all() and (base[:, :4] == 7).all()  # nothing outside touched
        # chunk 0 (grid (0, 0)) is missing: asked for, the shard is refused
        assert not place.read_shard(fd, (3, size - 3), grid, inner, (0, 0), (1, 1), origin, False)[
            0
        ]
        assert not place.read_shard(fd, (3, size - 4), grid, inner, lo, hi, origin, False)[0]
        with pytest.raises(ValueError):  # a grid box outside the grid
            place.read_shard(fd, (3, size - 3), grid, inner, lo, (3, 5), origin, False)
    finally:
        os.close(fd)
    at_1_1 = int(np.frombuffer(index[:-4], "<u8").reshape(-1, 2)[1 * grid[1] + 1, 0])
    for where in (3 + at_1_1 + 5, size - 10):  # a byte of chunk (1, 1), asked for; of the index
        damaged = bytearray(Path(path).read_bytes())
        damaged[where] ^= 0x10
        bad = tmp_path / f"bad{where}"
        bad.write_bytes(bytes(damaged))
        fd = os.open(bad, os.O_RDONLY)
        try:
            got = place.read_shard(fd, (3, size - 3), grid, inner, (0, 1), (3, 4), origin, True)
            assert got == (False, None, None)
        finally:
            os.close(fd)


def test_gather_chunks_refuses_what_does_not_fit() -> None:
    """The encoder's gather checks its arguments before copying: a value buffer too small for
    the chunks, a source span outside its buffer, an inner chunk that does not divide the shard,
    a last axis that is not contiguous."""
    from ucp_jax._src.format import _scatter_read as native

    if not hasattr(native, "gather_chunks"):
        pytest.skip("the built extension predates gather_chunks: rebuild it")
    src = np.arange(32, dtype=np.float32)
    i64 = lambda *v: np.asarray(v, np.int64)  # noqa: E731
    ok = bytearray(4 * 8 * 4)
    native.gather_chunks(src, 0, i64(32, 4), i64(4, 8), i64(2, 4), 4, ok, 32)
    want = src.reshape(2, 2, 2, 4).transpose(0, 2, 1, 3).reshape(-1)  # (2, 4) chunks, C order
    assert np.frombuffer(ok, np.float32).tolist() == want.tolist()
    with pytest.raises(ValueError, match="do not fit"):
        native.gather_chunks(src, 0, i64(32, 4), i64(4, 8), i64(2, 4), 4, bytearray(100), 32)
    with pytest.raises(ValueError, match="do not fit"):
        native.gather_chunks(src, 8, i64(32, 4), i64(4, 8), i64(2, 4), 4, bytearray(128), 32)
    with pytest.raises(ValueError, match="bad shape"):
        native.gather_chunks(src, 0, i64(32, 4), i64(4, 8), i64(3, 4), 4, bytearray(128), 32)
    with pytest.raises(ValueError, match="mismatched"):
        native.gather_chunks(src, 0, i64(4, 32), i64(8, 4), i64(2, 2), 4, bytearray(128), 16)
