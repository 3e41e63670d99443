"""Redundancy in motion: what each node copies for its group, and where it gets it from.

Each node fills its blob with *fetches*: device regions copied to host. Its own pieces come from
its own devices. Its redundancy bytes (what its scheme's `needs` names: another node's pieces, or
the XOR lanes the others cut for it; see `schemes`) come, per piece, from

- its own devices, when one of them holds that region too (data-parallel replicas hold the same
  bytes): no communication at all;
- otherwise a *roll* of the leaf: each device's shard is sent to the device with the same local
  index on the node `shift` places further in its group (`lax.ppermute` in a `shard_map` over all
  devices, i.e. the jax collectives the training already uses); the node copies the shard its
  partner sent. Rolls are dispatched with the snapshot on the training thread, so they are
  ordered with the training computations and never run from a background thread.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..mapping.boxes import Box
from .exchange import allgather_json
from .gf256 import xor_into
from .layout import SnapshotLayout
from .placement import GridPlacement
from .scheme_base import Wanted, align


def _inside(a: Box, b: Box) -> bool:
    return all(b0 <= a0 and a1 <= b1 for (a0, a1), (b0, b1) in zip(a, b))


@dataclasses.dataclass
class Fetch:
    """One device region this node copies to host, and where its bytes go in the blob.

    Attributes:
        leaf: leaf index.
        kind: 'orig' (a shard of the leaf), 'roll' (a shard a partner sent) or 'host' (a host
            value, the same on every process).
        shift: for 'roll', the ring shift of the roll.
        device: the local device holding it (None for 'host').
        box: the region, in global leaf coordinates.
        shard_box: the box of the shard it is cut from.
        dests: (blob offset, first byte, end byte, xor?) of the region's bytes.
    """

    leaf: int
    kind: str
    shift: int
    device: Any
    box: Box
    shard_box: Box
    dests: list[tuple[int, int, int, bool]] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.leaf, self.kind, self.shift, getattr(self.device, "id", None), self.box)


class Sources:
    """Per leaf: which device holds which shard box, and which device wrote each piece.

    Args:
        shard_maps: per leaf, {device: shard box} (None for host values and grid leaves).
        writers: (leaf, box, node) -> (device or None, shard box) of the listed pieces.
        grids: leaf -> its GridPlacement, for the leaves whose writers and holders follow
            from their grid (not listed in `shard_maps` and `writers`).
        devices: every device of the job (to name the grid leaves' devices by id).
    """

    def __init__(
        self,
        shard_maps: Sequence[dict[Any, Box] | None],
        writers: dict[tuple[int, Box, int], tuple[Any, Box]],
        grids: Mapping[int, GridPlacement] | None = None,
        devices: Sequence[Any] = (),
    ) -> None:
        self.shard_maps = shard_maps
        self.writers = writers
        self.grids = dict(grids or {})
        self._by_id = {d.id: d for d in devices} if self.grids else {}

    def _device(self, g: GridPlacement, pos: int) -> Any:
        return self._by_id[int(g.table.ids.reshape(-1)[pos])]

    def writer(self, leaf: int, box: Box, node: int) -> tuple[Any, Box]:
        """The device (None for a host value) that writes piece `box` of node `node`, and the
        box of the shard it is cut from."""
        g = self.grids.get(leaf)
        if g is None:
            return self.writers[(leaf, box, node)]
        pos, sbox = g.writer(box)
        return self._device(g, pos), sbox

    def local(self, leaf: int, box: Box, node: int) -> tuple[Any, Box] | None:
        """A device of `node` holding `box` of the leaf (the lowest id), and its shard box."""
        g = self.grids.get(leaf)
        if g is not None:
            held, sbox = g.holders(box, node)
            return (self._device(g, held[0]), sbox) if held else None
        m = self.shard_maps[leaf]
        if m is None:
            return None
        for dev in sorted((d for d in m if d.process_index == node), key=lambda d: d.id):
            if _inside(box, m[dev]):
                return dev, m[dev]
        return None


def plan_fetches(
    layout: SnapshotLayout,
    sources: Sources,
    devices: Any,
    me: int,
    roll_nodes: Collection[int] | None = None,
) -> tuple[list[Fetch], list[tuple[int, int]]]:
    """This node's fetches, and the rolls (leaf, shift) that the nodes `roll_nodes` need.

    Every process must dispatch the same collectives in the same order: the rolls of every
    node. With `roll_nodes` None this computes them all here (O(the whole job)); the engine
    passes `[me]` and takes the union over the processes instead (`union_rolls`).
    """
    fetches: dict[tuple[Any, ...], Fetch] = {}
    by_proc = devices_by_process(devices)

    def add(f: Fetch, dest: tuple[int, int, int, bool]) -> None:
        fetches.setdefault(f.key, f).dests.append(dest)

    for p in layout.by_node[me]:
        dev, sbox = sources.writer(p.leaf, p.box, me)
        kind = "host" if dev is None else "orig"
        add(Fetch(p.leaf, kind, 0, dev, p.box, sbox), (p.offset, 0, p.nbytes, False))
    rolls: set[tuple[int, int]] = set()
    nodes = sorted({*(range(layout.nodes) if roll_nodes is None else roll_nodes), me})
    for k in nodes:
        needs = layout.scheme.needs(layout, k) if layout.scheme is not None else []
        for p, lo, hi, dest, xor in needs:
            dev, sbox = sources.writer(p.leaf, p.box, p.node)
            if dev is None:
                f = Fetch(p.leaf, "host", 0, None, p.box, sbox)
            elif (hit := sources.local(p.leaf, p.box, k)) is not None:
                f = Fetch(p.leaf, "orig", 0, hit[0], p.box, hit[1])
            else:
                s = layout.shift(p.node, k)
                rolls.add((p.leaf, s))
                if k != me:
                    continue
                f = Fetch(p.leaf, "roll", s, partner(dev, s, layout, by_proc), p.box, sbox)
            if k == me:
                add(f, (dest, lo, hi, xor))
    return _merge_rows(list(fetches.values()), layout), sorted(rolls)


def encode_rolls(rolls: Collection[tuple[int, int]]) -> list[list[int]]:
    """Rolls (leaf, shift) as [shift, first leaf, end leaf] runs (compact: leaves in a row)."""
    out: list[list[int]] = []
    for s, li in sorted((s, li) for li, s in rolls):
        if out and out[-1][0] == s and out[-1][2] == li:
            out[-1][2] = li + 1
        else:
            out.append([s, li, li + 1])
    return out


def union_rolls(encoded: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, int]]:
    """The union of several `encode_rolls` lists, as sorted (leaf, shift) pairs."""
    return sorted({(li, s) for runs in encoded for s, a, e in runs for li in range(a, e)})


def agree_rolls(mine: Collection[tuple[int, int]], tag: str) -> list[tuple[int, int]]:
    """The rolls of the whole job: the union of those each process's node needs (`mine` here),
    gathered through the coordination service under `tag` (a collective)."""
    return union_rolls(allgather_json(encode_rolls(mine), tag))


def _merge_rows(fetches: list[Fetch], layout: SnapshotLayout) -> list[Fetch]:
    """One fetch per shard when this node needs all of it in row slabs (e.g. its own half of a
    data-parallel shard and, for its neighbour, the other half): the whole shard is copied once,
    without cutting it on the device, and each slab is a byte range of it."""
    groups: dict[tuple[Any, ...], list[Fetch]] = {}
    for f in fetches:
        if f.kind != "host" and f.box and f.box != f.shard_box:
            key = (f.leaf, f.kind, f.shift, f.device.id, f.shard_box)
            groups.setdefault(key, []).append(f)
    merged: dict[int, Fetch] = {}
    drop: set[int] = set()
    for fs in groups.values():
        sb = fs[0].shard_box
        if len(fs) < 2 or any(f.box[1:] != sb[1:] for f in fs):
            continue
        rows = sorted(f.box[0] for f in fs)
        if rows[0][0] != sb[0][0] or rows[-1][1] != sb[0][1]:
            continue
        if any(a[1] != b[0] for a, b in itertools.pairwise(rows)):
            continue
        row_bytes = layout.leaves[fs[0].leaf].dtype.itemsize * int(
            np.prod([b - a for a, b in sb[1:]], dtype=np.int64)
        )
        whole = Fetch(fs[0].leaf, fs[0].kind, fs[0].shift, fs[0].device, sb, sb)
        for f in fs:
            skip = (f.box[0][0] - sb[0][0]) * row_bytes
            whole.dests.extend((off, lo + skip, hi + skip, x) for off, lo, hi, x in f.dests)
            drop.add(id(f))
        merged[id(fs[0])] = whole
    out = []
    for f in fetches:
        if id(f) in merged:
            out.append(merged[id(f)])
        elif id(f) not in drop:
            out.append(f)
    return out


def devices_by_process(devices: Sequence[Any]) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
        out.setdefault(d.process_index, []).append(d)
    return out


def partner(
    dev: Any, shift: int, layout: SnapshotLayout, by_proc: Mapping[int, Sequence[Any]]
) -> Any:
    """The device with `dev`'s local index on the node `shift` places further in its group.

    Args:
        by_proc: the job's devices per process (`devices_by_process`).
    """
    g = layout.group_of[dev.process_index]
    to = g[(g.index(dev.process_index) + shift) % len(g)]
    mine, theirs = by_proc[dev.process_index], by_proc[to]
    if len(mine) != len(theirs):
        raise ValueError(
            f"redundancy: process {dev.process_index} has {len(mine)} devices and process {to} "
            f"{len(theirs)}; exchanging non-replicated shards needs equal device counts per "
            "process (or use redundancy=None)"
        )
    return theirs[mine.index(dev)]


@functools.lru_cache(maxsize=64)
def _roll_fn(devices: tuple[Any, ...], perm: tuple[tuple[int, int], ...], n: int) -> Any:
    mesh = jax.sharding.Mesh(np.array(devices), ("ucp_nodes",))

    def body(*xs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jax.lax.ppermute(x, "ucp_nodes", list(perm)) for x in xs)

    spec = (P("ucp_nodes"),) * n
    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(fn), NamedSharding(mesh, P("ucp_nodes"))


def roll(xs: Sequence[jax.Array], shift: int, layout: SnapshotLayout) -> list[jax.Array]:
    """Send every device's shard of each of `xs` to its partner `shift` nodes on (one collective).

    Returns one array per input, of shape (devices * shard rows, *shard shape[1:]): on each device,
    the shard its partner sent, in the shard's own shape.
    """
    devices = tuple(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    index = {d: i for i, d in enumerate(devices)}
    by_proc = devices_by_process(devices)
    perm = tuple((index[d], index[partner(d, shift, layout, by_proc)]) for d in devices)
    fn, sharding = _roll_fn(devices, perm, len(xs))
    flats = []
    for x in xs:
        if set(x.sharding.device_set) != set(devices):
            raise ValueError(
                f"redundancy: a leaf of shape {x.shape} lives on {len(x.sharding.device_set)} of "
                f"the {len(devices)} devices; exchanging it needs all of them (or redundancy=None)"
            )
        shards = {s.device: s.data for s in x.addressable_shards}
        shapes = {tuple(a.shape) for a in shards.values()}
        if len(shapes) != 1 or not x.ndim:
            raise ValueError(
                f"redundancy: shards {sorted(shapes)} of {x.shape} cannot be exchanged"
            )
        shape = shapes.pop()
        glob = (len(devices) * shape[0], *shape[1:])  # shards stacked along axis 0: no reshape
        local = [shards[d] for d in devices if d in shards]
        flats.append(jax.make_array_from_single_device_arrays(glob, sharding, local))
    return list(fn(*flats))


def decode_ranges(
    layout: SnapshotLayout, lost: int, present: Collection[int], want: Wanted | None = None
) -> list[tuple[int, int, int]]:
    """(node, offset, nbytes) of every byte range `decode_node` reads to rebuild node `lost`
    from the nodes in `present` (`decode_nodes` with `want`: to rebuild `want[lost]`)."""
    if layout.scheme is None:
        return []
    if want is not None:
        return layout.scheme.part_ranges(layout, lost, present, want)
    return layout.scheme.decode_ranges(layout, lost, present)


def decode_node(layout: SnapshotLayout, lost: int, blobs: dict[int, Any]) -> np.ndarray:
    """Rebuild the pieces part of node `lost` from the other nodes of its group.

    Args:
        layout: the snapshot layout.
        lost: the node whose blob is gone.
        blobs: node -> an object with `.view(offset, nbytes)` for every present node of its group.

    Returns:
        The lost node's pieces part (layout.primary[lost] bytes; the copies it kept for other
        nodes left zero).

    Raises:
        ValueError: the snapshot has no redundancy.
    """
    if layout.scheme is None:
        raise ValueError(f"node {lost} is lost and the snapshot has no redundancy")
    return layout.scheme.decode(layout, lost, blobs)


def decode_nodes(
    layout: SnapshotLayout,
    lost: Sequence[int],
    blobs: dict[int, Any],
    want: Wanted | None = None,
) -> dict[int, Any]:
    """Rebuild the pieces parts of several lost members of one group at once (`decode_node` of
    each; a scheme with two parities solves for both together). With `want` (lost node ->
    (offset, nbytes) ranges a restore reads), only those ranges are sure to be rebuilt (rs2
    rebuilds only the lanes that hold them).

    Raises:
        ValueError: the snapshot has no redundancy.
        ParityMismatch: a rebuilt node does not match the digest its peers kept of it.
    """
    if layout.scheme is None:
        raise ValueError(f"node(s) {list(lost)} are lost and the snapshot has no redundancy")
    if want is not None:
        return layout.scheme.decode_parts(layout, lost, blobs, want)
    return layout.scheme.decode_all(layout, lost, blobs)


# Bytes of a node's redundancy area filled at a time: every XOR into a block while it is in cache
# (L2), each source byte read once. benchmarks/rs2_encode.py --engine --xor-block 256 512 1024
# (k = 4 and 8, load 4-5): 1 MiB was fastest for xor and rs2, 0-25% faster than 512 KiB.
XOR_BLOCK = 1 << 20


def fill(
    blob: np.ndarray,
    layout: SnapshotLayout,
    node: int,
    fetches: Sequence[Fetch],
    gaps: Sequence[tuple[int, int]],
    datas: list[Any],
) -> int:
    """Write a node's blob from its fetches' data (XOR into its parity lanes); returns bytes read.

    `copy_out` then `xor_fill`. `datas[i]` (a device or host array of fetch i's region) is
    released.
    """
    copied, later = copy_out(blob, layout, node, fetches, gaps, datas)
    xor_fill(blob[layout.primary[node] :], later)
    return copied


# What `xor_fill` writes into a redundancy area: (offset in it, source bytes, XOR? else copy).
Later = tuple[int, np.ndarray, bool]


def _later_spans(f: Fetch, start: int) -> list[list[int]]:
    """The byte ranges [lo, hi) of a fetch's region that go into the redundancy area (from
    blob offset `start`: XORed, or copied there), merged."""
    out: list[list[int]] = []
    for lo, hi in sorted((lo, hi) for off, lo, hi, x in f.dests if (x or off >= start) and hi > lo):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def stage_bytes(layout: SnapshotLayout, node: int, fetches: Sequence[Fetch]) -> int:
    """Bytes of the buffer `copy_out` stages the redundancy sources of these fetches in."""
    start = layout.primary[node]
    return sum(align(hi - lo) for f in fetches for lo, hi in _later_spans(f, start))


def copy_out(
    blob: np.ndarray,
    layout: SnapshotLayout,
    node: int,
    fetches: Sequence[Fetch],
    gaps: Sequence[tuple[int, int]],
    datas: list[Any],
    stage: np.ndarray | None = None,
) -> tuple[int, list[Later]]:
    """Copy a node's pieces part into its blob (zeroing the gaps); return what goes into its
    redundancy area, for `xor_fill`, and the bytes read.

    With `stage` (`stage_bytes` of it), the sources of the redundancy area are copied into it
    first, so that `datas` may be overwritten as soon as this returns and the XORs may run later.
    (What that would cost a step of a donated state on CPU devices; benchmarks/rs2_encode.py
    --engine measures it against XORing at once, which costs the step less, and is what the
    engine does: docs/fault_tolerance_rs2.md.)
    """
    for off, n in gaps:
        blob[off : off + n] = 0
    start, at = layout.primary[node], 0
    later: list[Later] = []
    copied = 0
    for i, f in enumerate(fetches):
        raw = np.ascontiguousarray(np.asarray(datas[i])).reshape(-1).view(np.uint8)
        datas[i] = None  # let the device copy go (once its XORs are done)
        copied += raw.nbytes
        staged: list[tuple[int, int, np.ndarray]] = []
        if stage is not None:
            for lo, hi in _later_spans(f, start):
                staged.append((lo, hi, stage[at : at + hi - lo]))
                staged[-1][2][:] = raw[lo:hi]
                at += align(hi - lo)
        for off, lo, hi, x in f.dests:
            if not x and off < start:
                blob[off : off + hi - lo] = raw[lo:hi]
            elif hi > lo:
                src = next((b[lo - a : hi - a] for a, e, b in staged if a <= lo and hi <= e), None)
                later.append((off - start, raw[lo:hi] if src is None else src, x))
    return copied, later


def xor_fill(red: np.ndarray, later: Sequence[Later]) -> None:
    """Fill a redundancy area: zeros, then the sources copied into it, then those XORed into it
    (a byte is one or the other); a block (`XOR_BLOCK`) at a time, every write into a block while
    it is in cache, the first source that covers a whole block copied instead of zeros."""
    blocks: list[list[tuple[int, int, np.ndarray, bool]]] = [
        [] for _ in range(-(-len(red) // XOR_BLOCK))
    ]
    for d0, src, x in later:
        d1 = d0 + len(src)
        for b in range(d0 // XOR_BLOCK, -(-d1 // XOR_BLOCK)):
            a, e = max(d0, b * XOR_BLOCK), min(d1, (b + 1) * XOR_BLOCK)
            blocks[b].append((a, e, src[a - d0 : e - d0], x))
    for b, parts in enumerate(blocks):
        b0, b1 = b * XOR_BLOCK, min(len(red), (b + 1) * XOR_BLOCK)
        parts.sort(key=lambda t: (t[3], t[0]))  # copies first
        if parts and parts[0][:2] == (b0, b1):
            red[b0:b1] = parts.pop(0)[2]
        else:
            red[b0:b1] = 0
        for a, e, src, x in parts:
            if x:
                xor_into(red[a:e], src)
            else:
                red[a:e] = src
