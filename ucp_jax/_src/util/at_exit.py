"""Background work that must finish before the interpreter exits: saves and persists.

A script whose last line starts an `async_save` (or a snapshot that persists) and never waits for
it must still get its checkpoint. An `atexit` hook comes too late for that: by then threading's
exit hooks have run, and `concurrent.futures` refuses new work ("cannot schedule new futures after
interpreter shutdown"), which the save's own thread pools and TensorStore's callbacks need. So
these hooks run among threading's, which run last-registered first: after `concurrent.futures`
registered its own (imported below), ours run before it.

SIGTERM, a scheduler's notice before it preempts a job, ends a Python process at once, without
exit hooks; `finish_on_sigterm` finishes the same work first, for at most `UCP_SIGTERM_GRACE_S`.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from . import config
from .libc import signal_handled_outside_python

log = logging.getLogger("ucp_jax")


def finish_before_exit(fn: Callable[[], None], what: str) -> None:
    """Run `fn` when the interpreter exits, while thread pools still take work, and before
    `jax.distributed.shutdown()` once work has started (`finish_on_sigterm`).

    An error is printed to stderr, prefixed with `what`, does not stop the other hooks, and
    makes the process exit with status 1 (a job whose last checkpoint was lost must not end as
    a success).

    >>> finish_before_exit(lambda: None, "nothing to finish")
    """
    _BEFORE_SHUTDOWN[what] = fn

    def hook() -> None:
        global _FAILED
        try:
            fn()
        except BaseException as e:
            print(f"ucp_jax: {what}: {e}", file=sys.stderr)
            _FAILED = True

    register = getattr(threading, "_register_atexit", None)  # CPython 3.9+; private
    if register is None:  # another interpreter: the plain hook, late as it may be
        atexit.register(hook)
    else:
        register(hook)


def finish_on_sigterm(fn: Callable[[], None], what: str) -> bool:
    """Run `fn` when SIGTERM (what a scheduler sends before it preempts a job) ends the process,
    then die of SIGTERM as before; Python's default is to die at once, without exit hooks, and
    a background save was lost. Installed only from the main thread, and only while SIGTERM has
    its default action (a handler of the program's own is left alone: it decides; so is one of
    native code, such as JAX's preemption notifier in a `jax.distributed` job, which keeps the
    process running to its preemption sync point). Returns whether the handler is in place.

    The work runs on a thread of its own, for at most `UCP_SIGTERM_GRACE_S` (the main thread,
    where the handler runs, may have been stopped holding a lock that work needs).
    """
    _finish_before_shutdown()  # (work starts: JAX is imported by now)
    current = signal.getsignal(signal.SIGTERM)
    ours = current is _on_sigterm
    if not ours:  # ours only where the default action would end the process
        main = threading.current_thread() is threading.main_thread()
        if not (main and current is signal.SIG_DFL):
            return False
        if signal_handled_outside_python(signal.SIGTERM):
            global _NATIVE_SAID
            if not _NATIVE_SAID:  # e.g. JAX's preemption notifier (jax.distributed.initialize)
                _NATIVE_SAID = True
                log.info("SIGTERM has a handler of native code (JAX's preemption notifier in a "
                         "jax.distributed job): left in place; %s is finished when the program "
                         "exits (after `reached_preemption_sync_point`, say)", what)  # fmt: skip
            return False
    _SIGTERM_WORK[what] = fn
    if not ours:
        signal.signal(signal.SIGTERM, _on_sigterm)
    return True


_BEFORE_SHUTDOWN: dict[str, Callable[[], None]] = {}
_FAILED = False  # work finished at exit failed: the process exits with status 1


def _exit_status() -> None:
    """The last exit hook (registered first): status 1 where work finished at exit failed
    (`os._exit` skips the hooks registered before ucp_jax was imported: logging is flushed)."""
    if _FAILED:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


atexit.register(_exit_status)


def _finish_before_shutdown() -> None:
    """Finish the work of `finish_before_exit` when `jax.distributed.shutdown()` is called (a
    distributed script's usual last line): a multi-process save needs the coordination service
    for its last barriers, and after the shutdown they failed, the checkpoint lost, while the
    process exited 0. The work's error is raised from the shutdown, after it ran."""
    distributed = sys.modules.get("jax._src.distributed")  # (none: no job, and no JAX import)
    state = getattr(distributed, "global_state", None)  # (moved: the exit hooks still run)
    original = getattr(state, "shutdown", None)
    if state is None or original is None or getattr(original, "_ucp_finishes", False):
        return

    def shutdown() -> None:
        errors: list[BaseException] = []
        for fn in list(_BEFORE_SHUTDOWN.values()):
            try:
                fn()
            except BaseException as e:  # (the job is still shut down, then it is raised)
                errors.append(e)
        original()
        if errors:
            raise errors[0]

    shutdown._ucp_finishes = True  # type: ignore[attr-defined]
    state.shutdown = shutdown


_SIGTERM_WORK: dict[str, Callable[[], None]] = {}
_NATIVE_SAID = False


def _finish(what: str, fn: Callable[[], None]) -> None:
    log.warning("SIGTERM: finishing %s before the process ends", what)
    try:
        fn()
    except BaseException as e:
        print(f"ucp_jax: {what}: {e}", file=sys.stderr)


def _on_sigterm(signum: int, frame: Any) -> None:
    # A second SIGTERM (schedulers repeat it) would run this handler again inside the first
    # one's wait, and its end would kill the process before the first one's work is finished.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grace = config.sigterm_grace_s()
    deadline = time.monotonic() + grace
    workers = {  # one thread each: work that hangs holds up none of the others
        what: threading.Thread(target=_finish, args=(what, fn), name="ucp-sigterm", daemon=True)
        for what, fn in list(_SIGTERM_WORK.items())
    }
    for w in workers.values():
        w.start()
    for w in workers.values():
        w.join(max(deadline - time.monotonic(), 0.0))
    left = ", ".join(what for what, w in workers.items() if w.is_alive())
    if left:
        print(f"ucp_jax: SIGTERM: {left} not finished after UCP_SIGTERM_GRACE_S={grace:g} s; "
              "the process ends without it (raise UCP_SIGTERM_GRACE_S to wait longer)",
              file=sys.stderr)  # fmt: skip
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends as it would have


_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(obj: Any, what: str) -> None:
    """Call `obj.close()` when the interpreter exits, or SIGTERM ends it (`finish_on_sigterm`),
    if `obj` is still alive then (held weakly; `close` must be idempotent). An error is logged
    and does not stop the others. `what`: what closing finishes, for the SIGTERM log line."""
    _OPEN.add(obj)
    finish_on_sigterm(_close_open, what)


def _close_open() -> None:
    for obj in list(_OPEN):
        try:
            obj.close()
        except BaseException as e:
            log.error("closing %r at exit: %s", obj, e)


finish_before_exit(_close_open, "closing at exit")
