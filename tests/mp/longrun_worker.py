"""A trainer that snapshots and async-saves every step until it is killed.

Usage: longrun_worker.py ROOT SHM_DIR NAMESPACE. Each step: a snapshot (keep=2) and an async
save of ROOT/step_<n> (older ones than the newest 3 deleted with `ucp.delete_checkpoint`); prints "saved <n>" once the save of
step n-1 is committed (the next save waits for it). The test SIGKILLs it mid-save.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax
import numpy as np

import ucp_jax as ucp
from ucp_jax.memory import SnapshotManager


def main() -> None:
    root, shm, ns = sys.argv[1], sys.argv[2], sys.argv[3]
    mgr = SnapshotManager(None, keep=2, shm_dir=shm, namespace=ns)
    for n in range(1, 100_000):
        tree = {"w": jax.numpy.full((512, 512), float(n)), "b": np.full((1024,), n, np.float32)}
        mgr.snapshot(n, tree)
        ucp.async_save(os.path.join(root, f"step_{n}"), tree, step=n)
        for old in ucp.list_checkpoints(root)[:-3]:
            ucp.delete_checkpoint(old)
        print(f"saved {n - 1}", flush=True)


if __name__ == "__main__":
    main()
