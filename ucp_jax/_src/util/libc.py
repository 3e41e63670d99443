"""The C library this process already loaded, for the few calls Python does not expose."""

from __future__ import annotations

import ctypes
import functools
import os


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The loaded libc (errno kept for ctypes.get_errno), or None where there is none.

    `CDLL(None)` opens the process itself: no `ctypes.util.find_library`, which runs ldconfig.

    >>> libc().getpid() == os.getpid()  # doctest: +SKIP
    True
    """
    if os.name != "posix":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
