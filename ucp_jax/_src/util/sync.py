"""Cross-process coordination that is safe from background threads (jax's coordination service)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import jax

from . import config


def coordination_client() -> Any:
    """The coordination-service client jax itself uses (several processes only).

    Raises:
        RuntimeError: several jax processes but no `jax.distributed` client.
    """
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "several jax processes but no jax.distributed client to coordinate with; call "
            "jax.distributed.initialize() first"
        )
    return client


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Wait until every process of the job reaches the barrier `name` (unique per use).

    Args:
        name: the barrier's name, the same on every process and new for each use.
        timeout_s: how long to wait (default: `UCP_BARRIER_TIMEOUT_S`, 1800 s).

    >>> barrier("ucp-doctest")  # one process: returns at once
    """
    if jax.process_count() == 1:
        return
    timeout = config.barrier_timeout_s() if timeout_s is None else timeout_s
    coordination_client().wait_at_barrier(name, timeout_in_ms=int(timeout * 1000))


class Rendezvous:
    """The barriers of one operation all processes make (a save: created, written, committed),
    passed in order. A process that fails says so (a key in the coordination service) and still
    arrives at the barriers it has left, so that the others learn of it at their next barrier
    and stop too, instead of waiting there until the barrier timeout (30 minutes by default).

    `error`: the class raised where another process failed (the caller's layer names it).

    >>> r = Rendezvous("ucp-doctest-op", ["created", "written"], RuntimeError)
    >>> r.wait("created"); r.wait("written")  # one process: returns at once
    """

    def __init__(self, tag: str, names: list[str], error: type[Exception]) -> None:
        self.tag, self.names, self.passed, self.error = tag, names, 0, error
        self.broken = False  # a barrier timed out: the others are not all coming

    def wait(self, name: str) -> None:
        """Barrier `name` (the next of `names`), then raise if another process failed.

        Raises:
            error: a process said it failed before reaching it.
        """
        assert name == self.names[self.passed], (name, self.names, self.passed)
        try:
            barrier(f"{self.tag}-{name}")
        except Exception as e:
            self._raise_if_timed_out(e, f"the barrier {self.tag}-{name}")
            raise
        self.passed += 1
        if jax.process_count() > 1:
            failed = coordination_client().key_value_dir_get(f"{self.tag}-failed/")
            if failed:
                key, why = sorted(failed)[0]
                raise self.error(
                    f"process {key.rsplit('/', 1)[-1]} failed, so this one stopped too (nothing "
                    f"was committed): {why}"
                )

    def agree(self, summary: dict[str, Any], differs: type[Exception]) -> None:
        """Check that this process's `summary` of the operation (its arguments) is process 0's:
        process 0 publishes its own, the others compare (one key read each, whatever the job's
        size).

        Raises:
            differs: naming the first field that differs (the others then stop at their next
                barrier, told by `fail`).
        """
        if jax.process_count() == 1:
            return
        client, key = coordination_client(), f"{self.tag}-agree"
        if jax.process_index() == 0:
            client.key_value_set(key, json.dumps(summary))
            return
        timeout_ms = int(config.barrier_timeout_s() * 1000)
        try:
            theirs = json.loads(client.blocking_key_value_get(key, timeout_ms))
        except Exception as e:
            self._raise_if_timed_out(e, "process 0's call")
            raise
        for field, mine in summary.items():
            if theirs.get(field) != mine:
                raise differs(
                    f"process {jax.process_index()} and process 0 make different calls: "
                    f"{field} {mine!r:.200} here, {theirs.get(field)!r:.200} on process 0; every "
                    "process must make the same call (the same path, step and state)"
                )

    def _raise_if_timed_out(self, e: Exception, what: str) -> None:
        """Raise our error for `e` where it is a timeout (the processes left are then not waited
        for: `fail` waits at no more barriers); any other error is the caller's to re-raise."""
        if "DEADLINE_EXCEEDED" not in str(e):
            return
        self.broken = True
        raise self.error(
            f"not every process reached {what} within UCP_BARRIER_TIMEOUT_S "
            f"({config.barrier_timeout_s():g} s): a process died, hangs, or did not make this call "
            "(every process must, with the same arguments)"
        ) from e

    def forget(self) -> None:
        """Once every process passed the last barrier: process 0 removes the published summary
        (the coordination service keeps keys for the job's life)."""
        if jax.process_count() > 1 and jax.process_index() == 0:
            with contextlib.suppress(Exception):
                coordination_client().key_value_delete(f"{self.tag}-agree")

    def fail(self, error: BaseException) -> None:
        """Say this process failed with `error` (unless it only learned of another's failure)
        and arrive at the barriers left; failures to do so are ignored (the error is raised)."""
        if jax.process_count() == 1:
            return
        try:
            client = coordination_client()
            if not isinstance(error, self.error):
                why = f"{type(error).__name__}: {error}"[:4000]
                client.key_value_set(f"{self.tag}-failed/{jax.process_index()}", why)
            for name in [] if self.broken else self.names[self.passed :]:
                barrier(f"{self.tag}-{name}")
                self.passed += 1
        except Exception:
            pass
