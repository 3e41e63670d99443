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
def read_at(fd: int, offsets: Any, length: int, out: Any, /) -> bool: ...
