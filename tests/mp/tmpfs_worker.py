"""Snapshots on a tmpfs of its own; run in its own mount namespace (`unshare`).

Usage: tmpfs_worker.py huge|full MOUNT_POINT REPORT_JSON. Mounts a tmpfs at MOUNT_POINT (the
mount goes away with the namespace) and writes what it saw to REPORT_JSON:

* huge: a huge=advise tmpfs; snapshots an 8-device train state there and restores it in a
  second manager; reports the pages' mapping sizes;
* full: a 12 MiB tmpfs and a 16 MiB snapshot; reports the error and what is left in the tmpfs;
* tight: a 0.5 MiB state in a tmpfs with room for its data but hardly more (the commit's small
  files may not fit); reports each snapshot's error and files, then grows the tmpfs and snapshots
  again.
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


def state() -> tuple[dict, dict]:
    """A 16 MiB (params, opt_state) on a (2, 4) mesh."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    rng = np.random.default_rng(0)
    params = {
        "w": jax.device_put(rng.standard_normal((1024, 2048), np.float32), NamedSharding(mesh, P(None, "b"))),
        "b": jax.device_put(rng.standard_normal((2048,), np.float32), NamedSharding(mesh, P("b"))),
    }  # fmt: skip
    opt = {"mu": jax.tree.map(lambda a: a * 2, params)}
    return params, opt


def huge(point: str) -> dict:
    mount(point, "huge=advise,size=1g")
    params, opt = state()
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
    return out


def full(point: str) -> dict:
    mount(point, "size=12m")
    mgr = SnapshotManager(None, shm_dir=point, namespace="full", redundancy=None)
    params, opt = state()  # 16 MiB
    out: dict = {}
    try:
        mgr.snapshot(1, params, opt)
        mgr.wait()
    except RuntimeError as e:  # raised by wait() (or snapshot() on the CPU copy path)
        out["error"] = str(e)
        out["errno"] = getattr(e.__cause__, "errno", None)
    st = os.statvfs(point)
    out["free_after"] = st.f_bavail * st.f_frsize
    out["total"] = st.f_blocks * st.f_frsize
    out["files"] = sorted(
        os.path.relpath(os.path.join(d, f), point) for d, _, fs in os.walk(point) for f in fs
    )
    out["latest"] = mgr.latest_step()
    mgr.close()
    return out


def tight(point: str) -> dict:
    mount(point, "size=516k")
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("a",))
    rng = np.random.default_rng(0)
    params = {"w": jax.device_put(rng.standard_normal(1 << 16, np.float32),
                                  NamedSharding(mesh, P("a"))),
              "b": jax.device_put(rng.standard_normal(1 << 16, np.float32),
                                  NamedSharding(mesh, P()))}  # fmt: skip
    mgr = SnapshotManager(None, shm_dir=point, namespace="tight", redundancy=None)
    out: dict = {"errors": [], "files": []}
    for step in (1, 2):
        try:
            mgr.snapshot(step, params)
            mgr.wait()
            out["errors"].append(None)
        except RuntimeError as e:
            out["errors"].append([str(e), getattr(e.__cause__, "errno", None)])
        out["files"].append(sorted(
            os.path.relpath(os.path.join(d, f), point) for d, _, fs in os.walk(point) for f in fs
        ))  # fmt: skip
    subprocess.run(["mount", "-o", "remount,size=4m", point], check=True)
    mgr.snapshot(3, params)
    mgr.wait()
    out["latest"] = mgr.latest_step()
    mgr.close()
    return out


def mount(point: str, opts: str) -> None:
    os.makedirs(point, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", point], check=True)


def main() -> None:
    mode, point, report = sys.argv[1:4]
    out = {"huge": huge, "full": full, "tight": tight}[mode](point)
    with open(report, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
