"""What the exit and SIGTERM workers leave in flight: a snapshot that persists (step 2) and an
async save of the same array, both under OUT (`OUT/persist/step_2`, `OUT/final`)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def start_snapshot_and_save(out: str, pid: int, namespace: str) -> object:
    """Start both for this process; returns the SnapshotManager (kept open, as a trainer's is)."""
    import ucp_jax as ucp
    from ucp_jax.memory import SnapshotManager

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    full = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)
    x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("d")), lambda i: full[i])
    mgr = SnapshotManager(f"{out}/persist", persist_every=2, shm_dir=f"{out}/shm{pid}",
                          namespace=namespace)  # fmt: skip
    mgr.snapshot(2, {"x": x})
    ucp.async_save(f"{out}/final", {"x": x}, step=2)
    return mgr
