"""CRC32C by the CPU's CRC instructions (the `crc32c` package, GIL released), for the chunks ucp
encodes (format/encode.py) and reads (format/direct.py) itself.

TensorStore's PyPI wheel computes the zarr3 `crc32c` codec with absl's portable CRC on the x86
machines measured here; both paths above are taken only where this one runs in hardware.
"""

from __future__ import annotations

import sys
from typing import Any

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
    return (
        _crc32c is not None
        and bool(getattr(_crc32c, "hardware_based", False))
        and sys.byteorder == "little"
    )


def value(buf: Any) -> int:
    """The CRC32C of a bytes-like object.

    >>> value(b"123456789") == 0xE3069283
    True
    """
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
