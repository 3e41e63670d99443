"""How the in-memory tier's snapshot layout grows with the job: listed pieces against grids.

`SnapshotManager` plans a snapshot (once per state structure: at the first snapshot of a run and
after a reconfiguration) with a `SnapshotLayout`, whose JSON every node writes into its shared
memory. This script builds that layout for a simulated job (no devices, no data): `--leaves`
fp32 matrices sharded row-wise over every device (FSDP), 8 devices per node, groups of 4, xor,
two ways, for one process (a node in the middle of the job):

- listed (format 2, what the engine did before; still the fallback for leaves whose sharding is
  not an even `NamedSharding` grid): every piece of every node (a device's region of a leaf),
  `build_pieces` + `SnapshotLayout` + `to_json`. It grows with devices x leaves. (The engine
  also mapped every device's region through jax's sharding first, `binding.write_regions`: also
  O(devices) per leaf, not counted here.)
- grid (format 3): each leaf described by its sharding grid (`placement.GridPlacement`: the mesh's
  device ids and processes once, the spec, a salt), then what one node's snapshot needs: the
  layout and its digest (its JSON), this node's pieces and offsets, gaps, size, and what it
  fetches (`redundancy.plan_fetches` for this node alone, as the engine plans it: its pieces,
  what its redundancy needs, from which device or roll; its group's nodes are placed, no other.
  The engine then gathers the rolls each process needs, a small message each: not simulated).

`--listed-max` skips the listed layout above that many devices (98 s at 16k devices).

Usage::

    python benchmarks/snapshot_layout_scale.py --out bench_out/snapshot_layout_scale.json
    python benchmarks/snapshot_layout_scale.py --devices 64 1024 --leaves 100
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import zlib
from typing import Any

import numpy as np
from harness import markdown_table, write_json

from ucp_jax._src.memory.layout import LeafMeta, SnapshotLayout, build_pieces, make_groups
from ucp_jax._src.memory.placement import GridPlacement, MeshTable
from ucp_jax._src.memory.redundancy import Sources, plan_fetches

DEVICES_PER_NODE = 8
ROWS, COLS = 16384, 4096


@dataclasses.dataclass(frozen=True)
class SimDevice:
    """A device of the simulated job: what the planner reads of one."""

    id: int
    process_index: int
    platform: str = "sim"


def _metas(leaves: int) -> list[LeafMeta]:
    return [LeafMeta(f"layer{li}.w", (ROWS, COLS), np.dtype(np.float32), "param")
            for li in range(leaves)]  # fmt: skip


def measure_listed(devices: int, leaves: int) -> dict[str, Any]:
    """The listed layout of `leaves` FSDP matrices over `devices`: pieces, times, JSON size."""
    nodes = max(devices // DEVICES_PER_NODE, 1)
    step = max(ROWS // devices, 1)
    metas = _metas(leaves)
    regions = [[(((d * step, (d + 1) * step), (0, COLS)), d // DEVICES_PER_NODE)
                for d in range(min(devices, ROWS))] for _ in metas]  # fmt: skip
    t0 = time.perf_counter()
    pieces = build_pieces(metas, regions, nodes)
    t1 = time.perf_counter()
    layout = SnapshotLayout(metas, nodes, make_groups(nodes, 4), "xor", pieces)
    t2 = time.perf_counter()
    text = layout.to_json()
    t3 = time.perf_counter()
    return {"pieces": len(pieces), "build_pieces_s": t1 - t0, "layout_s": t2 - t1,
            "to_json_s": t3 - t2, "plan_s": t3 - t0, "json_bytes": len(text)}  # fmt: skip


def measure_grid(devices: int, leaves: int) -> dict[str, Any]:
    """The grid layout of the same job, and one node's part of it: times, JSON size."""
    nodes = max(devices // DEVICES_PER_NODE, 1)
    me = nodes // 2 + 1
    metas = _metas(leaves)
    devs = [SimDevice(i, i // DEVICES_PER_NODE) for i in range(devices)]  # as jax.devices()
    t0 = time.perf_counter()
    ids = np.arange(devices, dtype=np.int64)
    table = MeshTable((("fsdp", devices),), ids, ids // DEVICES_PER_NODE)
    placements = [GridPlacement(table, (("fsdp",), ()), m.shape, m.dtype.itemsize,
                                zlib.crc32(m.name.encode())) for m in metas]  # fmt: skip
    layout = SnapshotLayout(metas, nodes, make_groups(nodes, 4), "xor", placements=placements)
    t1 = time.perf_counter()
    sources = Sources([None] * leaves, {}, dict(enumerate(placements)), devs)
    fetches, rolls = plan_fetches(layout, sources, devs, me, roll_nodes=[me])
    gaps, size = layout.gaps(me), layout.size(me)
    t2 = time.perf_counter()
    text = layout.to_json()
    assert size > 0 and gaps is not None
    return {"node": me, "node_pieces": len(layout.by_node[me]), "fetches": len(fetches),
            "rolls": len(rolls), "layout_s": t1 - t0, "node_s": t2 - t1, "plan_s": t2 - t0,
            "nodes_placed": len(layout._placed), "json_bytes": len(text)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    ap.add_argument("--leaves", type=int, default=300)
    ap.add_argument("--listed-max", type=int, default=16384,
                    help="build the listed layout up to this many devices")  # fmt: skip
    ap.add_argument("--out", default=None, help="results as JSON")
    args = ap.parse_args()
    measure_grid(64, 2)  # warm-up: imports, first calls
    rows, results = [], []
    for n in args.devices:
        r: dict[str, Any] = {"devices": n, "nodes": max(n // DEVICES_PER_NODE, 1),
                             "leaves": args.leaves}  # fmt: skip
        r["grid"] = measure_grid(n, args.leaves)
        g = r["grid"]
        r["listed"] = measure_listed(n, args.leaves) if n <= args.listed_max else None
        results.append(r)
        ls = r["listed"]
        listed = ["-", "-", "-"] if ls is None else [
            ls["pieces"], f"{ls['plan_s']:.2f}", f"{ls['json_bytes'] / 1e6:.1f}"]  # fmt: skip
        rows.append([n, r["nodes"], *listed, g["node_pieces"], f"{g['plan_s']:.3f}",
                     f"{g['json_bytes'] / 1e6:.3f}"])  # fmt: skip
        print(f"{n} devices: grid {g['plan_s']:.3f} s, {g['json_bytes'] / 1e6:.3f} MB"
              + ("" if ls is None else f"; listed {ls['plan_s']:.2f} s, "
                 f"{ls['json_bytes'] / 1e6:.1f} MB"), flush=True)  # fmt: skip
    print(markdown_table(["devices", "nodes", "listed pieces", "listed plan s",
                          "listed JSON MB", "grid: node's pieces", "grid plan s (one node)",
                          "grid JSON MB"], rows))  # fmt: skip
    if args.out:
        write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
