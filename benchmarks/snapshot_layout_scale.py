"""How the in-memory tier's snapshot layout grows with the job: a known limit, measured.

`SnapshotManager` plans a snapshot (once per state structure: at the first snapshot of a run and
after a reconfiguration) with a global `SnapshotLayout`: every piece of every node (a device's
region of a leaf), its offset in its node's blob, and the JSON of all of it, which every node
writes into its shared memory. So the plan and its JSON grow with devices x leaves, not with
what one process holds, against the project's rule that the cost per process must not grow with
the cluster. This script builds that layout for a simulated job (no devices, no data): `--leaves`
fp32 matrices sharded row-wise over every device (FSDP), 8 devices per node, groups of 4, xor,
and times `build_pieces`, `SnapshotLayout` and `to_json`. (The engine also maps every device's
region through jax's sharding first, `binding.write_regions`: also O(devices) per leaf, not
counted here.)

Usage::

    python benchmarks/snapshot_layout_scale.py --out bench_out/snapshot_layout_scale.json
    python benchmarks/snapshot_layout_scale.py --devices 64 1024 --leaves 100
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from harness import markdown_table, write_json

from ucp_jax._src.memory.layout import LeafMeta, SnapshotLayout, build_pieces, make_groups

DEVICES_PER_NODE = 8
ROWS, COLS = 16384, 4096


def measure(devices: int, leaves: int) -> dict[str, Any]:
    """The layout of `leaves` FSDP matrices over `devices`: its pieces, times and JSON size."""
    nodes = max(devices // DEVICES_PER_NODE, 1)
    step = max(ROWS // devices, 1)
    metas, regions = [], []
    for li in range(leaves):
        metas.append(LeafMeta(f"layer{li}.w", (ROWS, COLS), np.dtype(np.float32), "param"))
        regions.append([(((d * step, (d + 1) * step), (0, COLS)), d // DEVICES_PER_NODE)
                        for d in range(min(devices, ROWS))])  # fmt: skip
    t0 = time.perf_counter()
    pieces = build_pieces(metas, regions, nodes)
    t1 = time.perf_counter()
    layout = SnapshotLayout(metas, nodes, make_groups(nodes, 4), "xor", pieces)
    t2 = time.perf_counter()
    text = layout.to_json()
    t3 = time.perf_counter()
    return {"devices": devices, "nodes": nodes, "leaves": leaves, "pieces": len(pieces),
            "build_pieces_s": t1 - t0, "layout_s": t2 - t1, "to_json_s": t3 - t2,
            "json_bytes": len(text)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    ap.add_argument("--leaves", type=int, default=300)
    ap.add_argument("--out", default=None, help="results as JSON")
    args = ap.parse_args()
    rows, results = [], []
    for n in args.devices:
        r = measure(n, args.leaves)
        results.append(r)
        total = r["build_pieces_s"] + r["layout_s"] + r["to_json_s"]
        rows.append([n, r["nodes"], r["pieces"], f"{total:.2f}", f"{r['json_bytes'] / 1e6:.1f}"])
        print(f"{n} devices: {total:.2f} s, {r['json_bytes'] / 1e6:.1f} MB", flush=True)
    print(markdown_table(["devices", "nodes", "pieces", "plan s (one process)", "layout JSON MB"],
                         rows))  # fmt: skip
    if args.out:
        write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
