"""Cross-process coordination that is safe from background threads (jax's coordination service)."""

from __future__ import annotations

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

    def wait(self, name: str) -> None:
        """Barrier `name` (the next of `names`), then raise if another process failed.

        Raises:
            error: a process said it failed before reaching it.
        """
        assert name == self.names[self.passed], (name, self.names, self.passed)
        barrier(f"{self.tag}-{name}")
        self.passed += 1
        if jax.process_count() > 1:
            failed = coordination_client().key_value_dir_get(f"{self.tag}-failed/")
            if failed:
                key, why = sorted(failed)[0]
                raise self.error(
                    f"process {key.rsplit('/', 1)[-1]} failed, so this one stopped too (nothing "
                    f"was committed): {why}"
                )

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
            for name in self.names[self.passed :]:
                barrier(f"{self.tag}-{name}")
                self.passed += 1
        except Exception:
            pass
