"""Background work that must finish before the interpreter exits: saves and persists.

A script whose last line starts an `async_save` (or a snapshot that persists) and never waits for
it must still get its checkpoint. An `atexit` hook comes too late for that: by then threading's
exit hooks have run, and `concurrent.futures` refuses new work ("cannot schedule new futures after
interpreter shutdown"), which the save's own thread pools and TensorStore's callbacks need. So
these hooks run among threading's, which run last-registered first: after `concurrent.futures`
registered its own (imported below), ours run before it.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ucp_jax")


def finish_before_exit(fn: Callable[[], None], what: str) -> None:
    """Run `fn` when the interpreter exits, while thread pools still take work.

    An error is printed to stderr, prefixed with `what`, and does not stop the other hooks.

    >>> finish_before_exit(lambda: None, "nothing to finish")
    """

    def hook() -> None:
        try:
            fn()
        except BaseException as e:
            print(f"ucp_jax: {what}: {e}", file=sys.stderr)

    register = getattr(threading, "_register_atexit", None)  # CPython 3.9+; private
    if register is None:  # another interpreter: the plain hook, late as it may be
        atexit.register(hook)
    else:
        register(hook)


def finish_on_sigterm(fn: Callable[[], None], what: str) -> bool:
    """Run `fn` when SIGTERM (what a scheduler sends before it preempts a job) ends the process,
    then die of SIGTERM as before; Python's default is to die at once, without exit hooks, and
    a background save was lost. Installed only from the main thread, and only while SIGTERM has
    its default action (a handler of the program's own is left alone: it decides). Returns
    whether the handler is in place.
    """
    current = signal.getsignal(signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()
    if current is not _on_sigterm and not (main and current is signal.SIG_DFL):
        return False
    _SIGTERM_WORK[what] = fn
    if current is not _on_sigterm:
        signal.signal(signal.SIGTERM, _on_sigterm)
    return True


_SIGTERM_WORK: dict[str, Callable[[], None]] = {}


def _on_sigterm(signum: int, frame: Any) -> None:
    for what, fn in list(_SIGTERM_WORK.items()):
        log.warning("SIGTERM: finishing %s before the process ends", what)
        try:
            fn()
        except BaseException as e:
            print(f"ucp_jax: {what}: {e}", file=sys.stderr)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends as it would have


_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(obj: Any) -> None:
    """Call `obj.close()` when the interpreter exits, if `obj` is still alive then (held weakly;
    `close` must be idempotent). An error is logged and does not stop the others."""
    _OPEN.add(obj)


def _close_open() -> None:
    for obj in list(_OPEN):
        try:
            obj.close()
        except BaseException as e:
            log.error("closing %r at exit: %s", obj, e)


finish_before_exit(_close_open, "closing at exit")
