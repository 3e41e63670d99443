"""Snapshots on a tmpfs mounted with huge pages; run in its own mount namespace (`unshare`).

Usage: huge_pages_worker.py MOUNT_POINT REPORT_JSON. Mounts a tmpfs with huge=advise at
MOUNT_POINT (the mount goes away with the namespace), snapshots an 8-device train state there,
restores it in a second manager and writes what it saw to REPORT_JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ucp_jax.memory import SnapshotManager


def pmd_mapped_kib(path: str) -> int:
    """KiB of the mappings of `path` in this process mapped with 2 MiB page-table entries."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = line.rstrip().endswith(path)
            elif inside and head and head[0] in ("ShmemPmdMapped:", "FilePmdMapped:"):
                total += int(head[1])
    return total


def main() -> None:
    point, report = sys.argv[1], sys.argv[2]
    os.makedirs(point, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "huge=advise,size=1g", "tmpfs", point], check=True
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    rng = np.random.default_rng(0)
    params = {
        "w": jax.device_put(rng.standard_normal((1024, 2048), np.float32), NamedSharding(mesh, P(None, "b"))),
        "b": jax.device_put(rng.standard_normal((2048,), np.float32), NamedSharding(mesh, P("b"))),
    }  # fmt: skip
    opt = {"mu": jax.tree.map(lambda a: a * 2, params)}
    want = jax.device_get((params, opt))
    mgr = SnapshotManager(None, shm_dir=point, namespace="hp", redundancy=None)
    mgr.snapshot(3, params, opt)
    mgr.wait()
    data = os.path.join(point, "ucp-hp", "0", "step_3", "data.bin")
    written_pmd = pmd_mapped_kib(data)
    mgr.close()
    again = SnapshotManager(None, shm_dir=point, namespace="hp", redundancy=None)
    tgt = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), (params, opt)
    )
    got = jax.device_get(again.restore(*tgt))
    out = {
        "huge_pages": again.huge_pages,
        "blob_bytes": os.path.getsize(data),
        "written_pmd_kib": written_pmd,
        "restored_pmd_kib": pmd_mapped_kib(data),
        "source": again.restored.source,
        "bitexact": all(
            x.dtype == y.dtype and x.tobytes() == y.tobytes()
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        ),
    }
    again.close()
    with open(report, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
