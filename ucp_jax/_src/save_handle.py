"""The saves that run in the background (`ucp.async_save`): one in flight per process.

A `SaveHandle` runs a save job's `write` on its own thread; its error is raised by `wait()` or by
the next save (`finish_pending`), and once at interpreter exit if nobody waited.

A script that ends with an `async_save` it never waited for gets its checkpoint committed before
the interpreter exits (`util.at_exit`; as an `atexit` hook the wait came too late, and the save
failed with "cannot schedule new futures after interpreter shutdown", the checkpoint lost); so
does one ended by SIGTERM, a scheduler's preemption (`util.at_exit.finish_on_sigterm`).
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import in_background
from .util.at_exit import finish_before_exit, finish_on_sigterm


class SaveHandle:
    """A save running in the background; `.wait()` returns once it is committed.

    >>> h = ucp.async_save("/tmp/ckpt/step_1", params)  # doctest: +SKIP
    >>> h.wait()  # doctest: +SKIP
    """

    def __init__(self, job: Any, host: list[Any]) -> None:
        self.path = job.loc.url
        self.step = job.manifest.step
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(
            target=self._run, args=(job, host), name=f"ucp-save-{job.seq}", daemon=True
        )
        self._thread.start()

    def _run(self, job: Any, host: list[Any]) -> None:
        try:
            job.write(host)
        except BaseException as e:  # re-raised on wait() or on the next save
            self._error = e

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None, *, then: str | None = None) -> None:
        """Block until committed; raise the save's error if it failed.

        Args:
            timeout: seconds to wait at most (None: until it ends).
            then: what was waiting for it (a next save), named in its error as not started.

        Raises:
            TimeoutError: still running after `timeout` seconds.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"save to {self.path} still running after {timeout} s")
        if self._error is not None and not self._reported:
            self._reported = True
            prefix = f"background save to {self.path} failed"
            if then is not None:
                prefix = f"{then} was not started: the {prefix}"
            raise in_background(self._error, prefix) from self._error


_pending: SaveHandle | None = None
_lock = threading.Lock()


def finish_pending(then: str | None = None) -> None:
    """One save in flight: wait for the previous one, and raise its error if it was never seen
    (``then``: the save that waited, named in the error as not started)."""
    global _pending
    with _lock:
        prev, _pending = _pending, None
    if prev is not None:
        prev.wait(then=then)


def in_flight(url: str) -> bool:
    """Whether this process's save in flight writes ``url`` and has not finished."""
    prev = _pending
    return prev is not None and prev.path == url and not prev.done()


finish_before_exit(finish_pending, "a background save still running at exit")


def start(job: Any, host: list[Any]) -> SaveHandle:
    """Start writing `job` (a `save.SaveJob`) from its host copies `host`; it is the save in
    flight until the next save waits for it."""
    global _pending
    handle = SaveHandle(job, host)
    with _lock:
        _pending = handle
    finish_on_sigterm(finish_pending, "a background save")
    return handle
