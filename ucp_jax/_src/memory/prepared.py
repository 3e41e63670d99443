"""What a snapshot of one state structure copies (`Prepared`, planned once by `plan_snapshot`,
cached by the `SnapshotManager`), and the statistics of the last snapshot (`SnapshotStats`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ..mapping.binding import bind_state, write_regions
from ..mapping.boxes import Box, index_to_box
from ..mapping.rules import CompiledRules
from ..util import config
from . import copies
from .layout import LeafMeta, Placement, SnapshotLayout, build_pieces
from .placement import GridPlacement, explicit, of_binding
from .redundancy import Fetch, Sources, agree_rolls, plan_fetches


@dataclasses.dataclass
class Prepared:
    """What a snapshot of one state structure copies (cached: it is the same every step)."""

    layout: SnapshotLayout
    text: str
    fetches: list[Fetch]
    rolls: dict[int, list[int]]  # shift -> leaves rolled by it
    gaps: list[tuple[int, int]]
    nbytes: int
    groups: list[copies.DeviceCopies]  # the device-side copies (none on CPU devices)
    host_memory: bool  # every device is a CPU device: its buffers are host memory already
    stage: np.ndarray | None = None  # (CPU, donation safe) the XOR sources, copied out (reused)


@dataclasses.dataclass
class SnapshotStats:
    """The last committed snapshot of this process.

    Attributes:
        step: its step.
        nbytes: bytes of this node's blob (own pieces + redundancy).
        copied_bytes: bytes copied device -> shared memory for it.
        dispatch_s: time `snapshot()` took on the training thread.
        copy_s, fill_s: the copy into shared memory and commit; of it, the fill (copies and
            XORs).
        rolls: leaves exchanged with collectives for redundancy.
    """

    step: int = -1
    nbytes: int = 0
    copied_bytes: int = 0
    dispatch_s: float = 0.0
    copy_s: float = 0.0
    rolls: int = 0
    fill_s: float = 0.0


def plan_snapshot(params: Any, opt_state: Any, groups: list[list[int]], redundancy: str | None,
                  node: int, donation_safe: bool, tag: str) -> Prepared:  # fmt: skip
    """Plan the snapshots of one state structure: the layout and `node`'s fetches (`tag`: the
    processes' agreement on the rolls, a collective).

    A leaf whose NamedSharding forms an even grid is described by its grid (`placement`):
    no per-device work for it here. Other leaves list every region (`write_regions`).
    """
    pbind, obind = bind_state(params, opt_state, CompiledRules(()))
    nodes = jax.process_count()
    metas: list[LeafMeta] = []
    placements: list[Placement] = []
    shard_maps: list[dict[Any, Box] | None] = []
    writers: dict[tuple[int, Box, int], tuple[Any, Box]] = {}
    grids: dict[int, GridPlacement] = {}
    for li, b in enumerate(pbind + obind):
        meta = LeafMeta(b.name, tuple(b.shape), b.dtype, b.kind)
        metas.append(meta)
        on_grid = of_binding(b)
        if on_grid is not None:
            placements.append(on_grid)
            grids[li] = on_grid
            shard_maps.append(None)
            continue
        regs = []
        for box, dev, sbox in write_regions(b):
            node = 0 if dev is None else dev.process_index
            writers[(li, box, node)] = (dev, sbox)
            regs.append((box, node))
        placements.append(explicit([(p.box, p.node, p.nbytes)
                                    for p in build_pieces([meta], [regs], nodes)]))  # fmt: skip
        if isinstance(b.value, jax.Array):
            idx = b.value.sharding.devices_indices_map(b.shape)
            shard_maps.append({d: index_to_box(i, b.shape) for d, i in idx.items()})
        else:
            shard_maps.append(None)
    layout = SnapshotLayout(metas, nodes, groups, redundancy, placements=placements)
    devices = jax.devices()
    fetches, mine = plan_fetches(layout, Sources(shard_maps, writers, grids, devices),
                                 devices, node, roll_nodes=[node])  # fmt: skip
    # every process dispatches the rolls any node needs: the union of what each needs
    rolls = agree_rolls(mine, tag) if layout.scheme is not None else []
    by_shift: dict[int, list[int]] = {}
    for li, shift in rolls:
        by_shift.setdefault(shift, []).append(li)
    # UCP_SNAPSHOT_DEVICE_COPIES=1: CPU devices too take the accelerators' path (tests)
    host_memory = not config.snapshot_device_copies() and all(
        f.device is None or f.device.platform == "cpu" for f in fetches
    )
    return Prepared(layout, layout.to_json(), fetches, by_shift, layout.gaps(node),
                     layout.size(node),
                     [] if host_memory else copies.group_by_device(fetches, donation_safe),
                     host_memory)  # fmt: skip
