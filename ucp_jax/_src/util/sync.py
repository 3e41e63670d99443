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
