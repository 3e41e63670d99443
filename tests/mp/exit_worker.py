"""One process of a job that ends without waiting: an async save and a persisting snapshot in
flight when the script returns.

Usage: exit_worker.py PROCESS_ID PROCESSES COORDINATOR OUT.
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main() -> None:
    pid, n, addr, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(addr, num_processes=n, process_id=pid)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ucp_jax as ucp
    from ucp_jax.memory import SnapshotManager

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    full = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)
    x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("d")), lambda i: full[i])
    mgr = SnapshotManager(f"{out}/persist", persist_every=2, shm_dir=f"{out}/shm{pid}",
                          namespace="exit")  # fmt: skip
    mgr.snapshot(2, {"x": x})
    ucp.async_save(f"{out}/final", {"x": x}, step=2)
    print(f"{pid} returning", flush=True)


if __name__ == "__main__":
    main()
