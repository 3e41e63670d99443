from typing import Any

def read_chunks(
    fd: int,
    dst: Any,
    file_offsets: Any,
    dst_offsets: Any,
    counts: Any,
    strides: Any,
    row_bytes: int,
    trailers: Any = None,
    /,
) -> tuple[int, int]: ...
def crc32c(data: Any, /) -> int: ...
def hardware() -> bool: ...
def crc_way(way: int, /) -> int: ...
def read_at(fd: int, offsets: Any, length: int, out: Any, /) -> bool: ...
def seal_chunks(buf: Any, count: int, body: int, stride: int, /) -> bytes: ...
def bounce_below(n: int, /) -> int: ...
def gather_chunks(
    src: Any,
    base: int,
    strides: Any,
    shape: Any,
    inner: Any,
    itemsize: int,
    dst: Any,
    stride: int,
    /,
) -> None: ...
def read_shard(
    fd: int,
    shard_offset: int,
    shard_length: int,
    grid: Any,
    inner: Any,
    itemsize: int,
    lo: Any,
    hi: Any,
    dst: Any,
    base: int,
    strides: Any,
    want_listed: bool,
    /,
) -> tuple[bool, bytes | None, bytes | None]: ...
