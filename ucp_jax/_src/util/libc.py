"""The C library this process already loaded, for the few calls Python does not expose."""

from __future__ import annotations

import ctypes
import functools
import os


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The loaded libc (errno kept for ctypes.get_errno), or None where there is none.

    `CDLL(None)` opens the process itself: no `ctypes.util.find_library`, which runs ldconfig.

    >>> libc().getpid() == os.getpid()
    True
    """
    if os.name != "posix":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def limit_malloc_arenas(n: int = 2) -> bool:
    """Cap glibc's malloc arenas (as MALLOC_ARENA_MAX=n would) for this process.

    An import allocates and frees large buffers on many threads (reads ahead, TensorStore's
    writers); with one arena per thread, freed memory stays resident. Two arenas halve the
    peak RSS of `ucp convert` at the same speed. Returns whether it applied (glibc only).
    """
    mallopt = getattr(libc(), "mallopt", None)
    return bool(mallopt(-8, int(n))) if mallopt is not None else False  # M_ARENA_MAX


def release_large_buffers(threshold: int = 1 << 20) -> bool:
    """Give allocations of `threshold` bytes or more their own mappings, unmapped when freed (as
    MALLOC_MMAP_THRESHOLD_=threshold would), for this process.

    glibc raises its mmap threshold as large buffers are freed (up to 32 MiB); buffers that big
    then come from the heap and stay resident after they are freed, so a converter that decodes
    32 MiB chunks one after another holds several of them at once. With the threshold fixed, a
    freed buffer goes back to the system at once. Returns whether it applied (glibc only).
    """
    mallopt = getattr(libc(), "mallopt", None)
    return bool(mallopt(-3, int(threshold))) if mallopt is not None else False  # M_MMAP_THRESHOLD


def exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (renameat2 with RENAME_EXCHANGE, Linux): a reader of either
    path finds one of the two, never nothing. Returns False where unsupported (nothing moved)."""
    fn = getattr(libc(), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def signal_handled_outside_python(signum: int) -> bool:
    """Whether the process's handler of `signum` was installed by native code, not by Python.

    Python's `signal.getsignal` reports what Python itself installed; a handler a library set
    with `sigaction` (JAX's preemption notifier takes SIGTERM in `jax.distributed.initialize`)
    leaves it reporting `SIG_DFL`. Asks the kernel: the handler is the first field of
    `struct sigaction` on Linux and macOS. False where that cannot be asked.

    >>> import signal
    >>> signal_handled_outside_python(signal.SIGUSR2)
    False
    """
    import signal

    fn = getattr(libc(), "sigaction", None)
    python_says = signal.getsignal(signum)
    if fn is None or not isinstance(python_says, signal.Handlers):
        return False  # Python's own handler (or no way to ask)
    buf = ctypes.create_string_buffer(256)  # larger than any struct sigaction
    if fn(int(signum), None, buf) != 0:
        return False
    handler = ctypes.c_void_p.from_buffer(buf).value or 0
    return handler != int(python_says)  # SIG_DFL is 0, SIG_IGN 1
