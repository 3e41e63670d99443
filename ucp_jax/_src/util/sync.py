"""Cross-process barriers that are safe from background threads (the coordination service)."""

from __future__ import annotations

import os

import jax

BARRIER_TIMEOUT_S = float(os.environ.get("UCP_BARRIER_TIMEOUT_S", "1800"))


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Wait until every process of the job reaches the barrier `name` (unique per use)."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the coordination-service client jax itself uses

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("several jax processes but no jax.distributed client to synchronise")
    client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1000))
