"""One process (8 CPU devices) that restores an rs2 job's snapshots under many losses.

Run by tests/test_memory_rs2_multiprocess.py after a 4-process job (one rs2 group of 4) trained
with mem_worker.py and two of its processes were killed:

    python tests/mp/rs2_worker.py CONFIG_JSON

CONFIG: {"namespace", "ckpt", "report", "cases": {name: {"lost": [nodes], "stale": ...}}}. For
each case it copies the job's shared memory into a namespace of its own without the lost nodes'
folders (with "stale": with the newest step's Q parity of stripe 0 replaced by the previous
step's bytes, as a parity that missed a snapshot, "committed" so or "after" the commit), restores with a SnapshotManager onto a 1 x 8
mesh (a smaller one than the job's 4 x 2), and reports the step, source, lost nodes, reason, this
process's extra and the state's crc32s; then deletes that namespace.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

import jax
import numpy as np
from mp.mem_worker import digest, targets


def _make_stale(ns_dir: Path, committed: bool) -> None:
    """Put the previous step's Q of stripe 0 into the newest step's blob of the node keeping it:
    with `committed`, as a parity that missed the snapshot and was committed so (the index's
    CRC-32 of the blob matches: the group's digests must catch it); else as damage after the
    commit (the blob's CRC-32 catches it before anything is decoded)."""
    from ucp_jax._src.memory.layout import SnapshotLayout
    from ucp_jax._src.memory.schemes import scheme_for

    plan = next((ns_dir / "0" / "plans").glob("*.json"))
    layout = SnapshotLayout.from_json(plan.read_text())
    rs2 = scheme_for("rs2")
    holder, off = rs2.parity_at(layout, layout.groups[0], 0, 1)
    n = rs2.lane_bytes(layout, holder)
    steps = sorted((ns_dir / str(holder)).glob("step_*"), key=lambda p: int(p.name[5:]))
    old, new = (np.fromfile(p / "data.bin", np.uint8) for p in steps[-2:])
    assert (old[off : off + n] != new[off : off + n]).any(), "Q did not change between steps"
    new[off : off + n] = old[off : off + n]
    new.tofile(steps[-1] / "data.bin")
    if committed:
        from ucp_jax._src.memory import shm

        index = json.loads((steps[-1] / shm.INDEX).read_text())
        index["crc32"] = f"{shm.blob_crc(new):08x}"
        raw = json.dumps(index, sort_keys=True).encode()
        (steps[-1] / shm.INDEX).write_bytes(raw)
        (steps[-1] / shm.COMMIT).write_text(f"{shm.FORMAT} {zlib.crc32(raw):08x}\n")


def main() -> None:
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from ucp_jax.memory import SnapshotManager

    devs = np.array(sorted(jax.devices(), key=lambda d: d.id))
    mesh = jax.sharding.Mesh(devs.reshape(1, -1), ("data", "model"))
    pt, ot = targets(mesh)
    src = Path("/dev/shm") / f"ucp-{cfg['namespace']}"
    report: dict[str, Any] = {}
    for name, case in cfg["cases"].items():
        ns = f"{cfg['namespace']}-{name}"
        dst = src.parent / f"ucp-{ns}"
        lost = {str(n) for n in case["lost"]}
        shutil.copytree(
            src, dst, ignore=lambda d, names, lost=lost: lost & set(names) if Path(d) == src else ()
        )
        if case.get("stale"):
            _make_stale(dst, case["stale"] == "committed")
        mgr = SnapshotManager(cfg["ckpt"], redundancy="rs2", namespace=ns)
        try:
            params, opt_state = mgr.restore(pt, ot)
            info = mgr.restored
            report[name] = {"step": info.step, "source": info.source, "lost": info.lost,
                            "reason": info.reason, "extra": repr(info.extra),
                            "digest": digest((params, opt_state))}  # fmt: skip
            del params, opt_state
        finally:
            mgr.free(all_nodes=True)
            shutil.rmtree(dst, ignore_errors=True)
        print(f"CASE {name} DONE", flush=True)
    Path(cfg["report"]).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
