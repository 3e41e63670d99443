"""CRC32C in hardware, the GIL released, for the chunks ucp encodes (format/encode.py) and reads
(format/direct.py) itself: the reading extension's (format/_scatter_read.c) where it folds with
carry-less multiplication (9.6 GB/s against the `crc32c` package's 6.1 GB/s on 1 MiB, AMD EPYC,
measured), else the `crc32c` package's CRC instruction.

TensorStore's PyPI wheel computes the zarr3 `crc32c` codec with absl's portable CRC on the x86
machines measured here; both paths above are taken only where this one runs in hardware.
"""

from __future__ import annotations

import sys
from typing import Any

from . import scatter_read

_crc32c: Any
try:
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - a dependency; without it TensorStore does all the work
    _crc32c = None


def hardware() -> bool:
    """A hardware CRC32C is here and memory is little-endian (zarr3's `bytes` layout of ucp).

    >>> isinstance(hardware(), bool)
    True
    """
    package = _crc32c is not None and bool(getattr(_crc32c, "hardware_based", False))
    return (package or scatter_read.folds()) and sys.byteorder == "little"


def value(buf: Any) -> int:
    """The CRC32C of a bytes-like object.

    >>> value(b"123456789") == 0xE3069283
    True
    """
    if scatter_read.folds():
        return scatter_read.crc32c(buf)
    assert _crc32c is not None
    return int(_crc32c.crc32c(buf))


def trailer(buf: Any) -> bytes:
    """The 4-byte little-endian CRC32C trailer zarr3's `crc32c` codec appends to `buf`."""
    return value(buf).to_bytes(4, "little")


def matches(data: Any, stored: Any) -> bool:
    """`stored` (4 bytes, little-endian) is the CRC32C of `data`.

    >>> matches(b"123456789", (0xE3069283).to_bytes(4, "little"))
    True
    """
    return value(data) == int.from_bytes(bytes(stored), "little")
