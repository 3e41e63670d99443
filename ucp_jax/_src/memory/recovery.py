"""Recovery: find the newest step complete or decodable on every node, and place it on any mesh.

A step is usable when, for every node of the job that wrote it, the node's committed snapshot of
that step (same run, same layout) is visible, or its bytes can be rebuilt from its group
(`replica`: the next node keeps a copy; `xor`: every other member is there). A restarted job's
processes agree on the step (a collective); if there is none, they restore the newest persisted
universal checkpoint instead, and say so in the log.

Each process reads only the pieces its target devices need: pieces carry their global box, so
the target layout may be any mesh, including a smaller one after a node is gone.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..errors import MismatchError, NotACheckpointError
from ..mapping.binding import LeafBinding, bind_state, unbind_state
from ..mapping.patterns import Box, box_shape, box_size, index_to_box, relative_slices
from ..mapping.rules import CompiledRules, Rule
from ..util.buffers import aligned_empty
from ..util.gcpause import gc_paused
from . import exchange
from .layout import Layout, LeafMeta, PieceRec
from .redundancy import decode_node, decode_ranges
from .shm import DATA, Blob, Entry, committed, list_nodes
from .stitch import can_stitch, stitch

log = logging.getLogger("ucp_jax")


@dataclasses.dataclass
class Candidate:
    """A step that can be recovered from shared memory.

    Attributes:
        run, step: which snapshot.
        layout: its layout.
        entries: node -> its committed snapshot, for the nodes this process sees.
        lost: nodes whose bytes must be decoded from their group.
        present: node -> the processes that see its committed snapshot (this process alone
            for a local scan; every process's view after a restore's inventory exchange).
    """

    run: int
    step: int
    layout: Layout
    entries: dict[int, Entry]
    lost: list[int]
    present: dict[int, list[int]]


@dataclasses.dataclass
class RestoreInfo:
    """What the last `SnapshotManager.restore` did.

    Attributes:
        step: the step restored.
        source: 'memory', 'redundancy' (some node decoded from its group) or 'persisted'.
        path: the persisted checkpoint, or the namespace folder.
        lost: nodes decoded from redundancy.
        seconds: wall time of the restore.
        reason: why memory was not used (for 'persisted').
        files: the snapshot files read (restored arrays may map them).
        fetched_bytes: bytes this process received from other processes (snapshots on
            machines it cannot see).
        copied_bytes: bytes this process copied to assemble regions; the rest of what it
            restored maps the snapshot's pages (on CPU devices: no copy at all).
    """

    step: int | None
    source: str
    path: str
    lost: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    reason: str = ""
    files: list[str] = dataclasses.field(default_factory=list)
    fetched_bytes: int = 0
    copied_bytes: int = 0


_layouts: dict[tuple[str, str], Layout] = {}


def _layout(root: Path, digest: str) -> Layout | None:
    for n in list_nodes(root):
        path = root / str(n) / "plans" / f"{digest}.json"
        key = (str(path), digest)
        if key in _layouts:
            return _layouts[key]
        try:
            text = path.read_text()
        except OSError:
            continue
        try:
            lay = Layout.from_json(text)
        except (ValueError, KeyError, TypeError):
            continue
        if lay.digest == digest:
            _layouts[key] = lay
            return lay
    return None


def _local_entries(root: Path) -> dict[tuple[int, int, str], dict[int, Entry]]:
    """(run, step, layout digest) -> node -> committed snapshot, for the nodes seen here."""
    by_key: dict[tuple[int, int, str], dict[int, Entry]] = {}
    for n in list_nodes(root):
        for e in committed(root / str(n)):
            if e.node == n:
                by_key.setdefault((e.run, e.step, e.plan), {})[n] = e
    return by_key


def _select(
    present: dict[tuple[int, int, str], dict[int, list[int]]],
    layout_of: Any,
    local: dict[tuple[int, int, str], dict[int, Entry]],
) -> tuple[list[Candidate], list[str]]:
    """The recoverable steps, newest first, from who sees which node's snapshot; and why not."""
    out, why = [], []
    for (run, step, digest), nodes in sorted(present.items(), reverse=True):
        lay = layout_of((run, step, digest))
        if lay is None:
            why.append(f"step {step}: its layout {digest} is on no node")
            continue
        lost = [n for n in range(lay.nodes) if n not in nodes]
        bad = [n for n in lost if not _decodable(lay, n, nodes)]
        if bad:
            why.append(f"step {step}: node(s) {bad} missing and not decodable from their group")
            continue
        entries = local.get((run, step, digest), {})
        out.append(
            Candidate(run, step, lay, entries, lost, {n: sorted(ps) for n, ps in nodes.items()})
        )
    return out, why


def scan(root: Path) -> tuple[list[Candidate], list[str]]:
    """Every step recoverable from what this process sees, newest first; and why others are not."""
    local = _local_entries(root)
    me = jax.process_index()
    present = {k: {n: [me] for n in ents} for k, ents in local.items()}
    return _select(present, lambda k: _layout(root, k[2]), local)


def agree(root: Path, tag: str) -> tuple[list[Candidate], list[str]]:
    """The recoverable steps from what *all* processes see (a collective), newest first.

    Every process sends its inventory (and publishes the layouts it holds); every process then
    computes the same candidates from their union, so a process on a machine that lost its
    shared memory still restores from memory, with bytes served by the others.
    """
    local = _local_entries(root)
    me = jax.process_index()
    mine = sorted([run, step, digest, n] for (run, step, digest), ents in local.items()
                  for n in ents)  # fmt: skip
    published = []
    if jax.process_count() > 1:
        for digest in sorted({d for _, _, d, _ in mine}):
            lay = _layout(root, digest)
            if lay is not None:
                exchange.publish_text(f"{tag}/layout/{me}/{digest}", lay.to_json())
                published.append(digest)
    everyone = exchange.allgather_json({"entries": mine, "layouts": published}, f"{tag}/inventory")
    present: dict[tuple[int, int, str], dict[int, list[int]]] = {}
    for proc, inv in enumerate(everyone):
        for run, step, digest, n in inv["entries"]:
            present.setdefault((run, step, digest), {}).setdefault(n, []).append(proc)

    def layout_of(key: tuple[int, int, str]) -> Layout | None:
        lay = _layout(root, key[2])
        if lay is None:  # this process sees no node of that step: take the layout another holds
            src = [p for p, inv in enumerate(everyone) if key[2] in inv["layouts"]]
            if src:
                lay = Layout.from_json(exchange.get_text(f"{tag}/layout/{src[0]}/{key[2]}"))
        return lay

    return _select(present, layout_of, local)


def _decodable(lay: Layout, n: int, nodes: Any) -> bool:
    if lay.redundancy == "replica":
        return lay.holder_of(n) in nodes
    if lay.redundancy == "xor":
        return all(m in nodes for m in lay.group_of[n] if m != n)
    return False


def candidates(root: Path) -> list[Candidate]:
    return scan(root)[0]


def newest_persisted(directory: Any) -> tuple[str, int] | None:
    """(path, step) of the newest committed universal checkpoint under `directory`."""
    if directory is None:
        return None
    from ..checkpoint import list_checkpoints, open_checkpoint

    best = None
    for path in list_checkpoints(directory):
        m = re.fullmatch(r"step_(\d+)", os.path.basename(path.rstrip("/")))
        if m is None:
            continue
        step = int(m.group(1))
        if best is None or step > best[1]:
            best = (path, step)
    if best is not None:
        step = open_checkpoint(best[0]).step
        best = (best[0], best[1] if step is None else int(step))
    return best


@gc_paused()
def restore(
    root: Path,
    directory: Any,
    params_target: Any,
    opt_state_target: Any,
    rules: tuple[Rule, ...],
    tag: str,
) -> tuple[Any, Any, RestoreInfo]:
    """Restore from the newest step every process can recover from memory, else from disk.

    `tag` names this restore in the coordination service (the same on every process, unique).
    """
    t0 = time.perf_counter()
    cands, why = agree(root, tag)
    chosen = cands[0] if cands else None
    if chosen is not None:
        params, opt, blobs = _read(chosen, params_target, opt_state_target, tag)
        fetched = sum(f.nbytes for f in blobs.fetched.values())
        source = "redundancy" if chosen.lost else "memory"
        info = RestoreInfo(chosen.step, source, str(root), chosen.lost, time.perf_counter() - t0)
        info.files = [str(f) for f in blobs.files]
        info.fetched_bytes, info.copied_bytes = fetched, blobs.copied
        detail = f", node(s) {chosen.lost} decoded from {chosen.layout.redundancy}" * bool(
            chosen.lost
        )
        if fetched:
            detail += f", {fetched / 2**20:.1f} MiB of it from other processes"
        log.info("ucp.memory: restored step %d from shared memory%s", chosen.step, detail)
        return params, opt, info
    reason = "; ".join(why) or f"no committed snapshot under {root} on any process"
    found = newest_persisted(directory)
    if found is None:
        raise NotACheckpointError(
            f"ucp.memory: nothing to restore: no recoverable snapshot in shared memory ({reason}) "
            f"and no persisted checkpoint under {directory}"
        )
    from ..restore import restore as ucp_restore

    log.warning(
        "ucp.memory: no snapshot in shared memory is recoverable on every node (%s); falling "
        "back to the persisted universal checkpoint %s (step %d)",
        reason,
        found[0],
        found[1],
    )
    params, opt = ucp_restore(found[0], params_target, opt_state_target, rules=rules)
    info = RestoreInfo(found[1], "persisted", found[0], [], time.perf_counter() - t0, reason)
    return params, opt, info


class _Bytes:
    """Node blobs as this process reads them: mapped when it sees them, else bytes fetched from
    the process that does, else (a lost node) rebuilt from its group."""

    def __init__(self, cand: Candidate) -> None:
        self.cand = cand
        self.fetched: dict[int, exchange.Fetched] = {}
        self._homes: dict[PieceRec, list[tuple[int, int]]] = {}
        self._open: dict[int, Any] = {}
        self.files: list[Path] = []
        self.copied = 0  # bytes assembled by copying (not views of the snapshot's pages)

    def sees(self, node: int) -> bool:
        return node in self.cand.entries

    def __getitem__(self, node: int) -> Any:
        if node not in self._open:
            if node in self.cand.entries:
                self.files.append(self.cand.entries[node].path / DATA)
                self._open[node] = Blob.open(self.cand.entries[node].path / DATA)
            elif node in self.fetched:
                self._open[node] = self.fetched[node]
            elif node in self.cand.lost:
                group = self.cand.layout.group_of[node]
                others = {m: self[m] for m in group if m != node}
                self._open[node] = _Decoded(decode_node(self.cand.layout, node, others))
            else:
                raise RuntimeError(
                    f"ucp.memory restore: node {node}'s snapshot is on another machine and none "
                    "of its bytes were fetched (an internal planning error; please report it)"
                )
        return self._open[node]

    def covers(self, node: int, offset: int, nbytes: int) -> bool:
        """Whether `view(offset, nbytes)` of that node is readable here (fetched ranges only)."""
        if node in self.cand.entries or node in self.cand.lost:
            return True
        return node in self.fetched and self.fetched[node].covers(offset, nbytes)

    def homes(self, p: PieceRec) -> list[tuple[int, int]]:
        """(node, offset) where a piece can be read, best first.

        Nodes this process sees first (its own node first of those), then nodes other
        processes see (fetched), then the piece's node rebuilt from its group (a lost node).
        """
        if p in self._homes:
            return self._homes[p]
        here = jax.process_index()
        locs = [loc for loc in self.cand.layout.locations(p) if loc[0] in self.cand.present]
        locs.sort(key=lambda loc: (not self.sees(loc[0]), loc[0] != here, loc[0] != p.node))
        if p.node in self.cand.lost:
            locs.append((p.node, p.offset))  # decoded from its group
        self._homes[p] = locs
        return locs

    def read(self, p: PieceRec) -> np.ndarray:
        node, off = self.homes(p)[0]
        return self[node].view(off, p.nbytes)

    def close(self) -> None:
        for b in self._open.values():
            if isinstance(b, Blob):
                b.close()


def _requests(cand: Candidate, regions: list[tuple[int, Box]], blobs: _Bytes) -> list[Any]:
    """The byte ranges this process must fetch to read `regions` ((leaf, box) pairs): pieces on
    nodes it does not see, and what decoding a lost node needs from group members it does not
    see. Each is served by the lowest process that sees the node."""
    lay = cand.layout
    if all(blobs.sees(n) for n in cand.present):
        return []  # every snapshot there is, this process sees
    wanted: list[tuple[int, int, int, int]] = []
    decode: set[int] = set()

    def need(node: int, off: int, n: int) -> None:
        if not blobs.sees(node) and n > 0:
            wanted.append((node, min(cand.present[node]), off, n))

    for li, box in regions:
        for p in lay.by_leaf[li]:
            if _intersect(p.box, box) is None:
                continue
            node, off = blobs.homes(p)[0]
            if node in cand.lost:
                decode.add(node)
            else:
                need(node, off, p.nbytes)
    for lost in sorted(decode):
        for node, off, n in decode_ranges(lay, lost):
            need(node, off, n)
    return exchange.merge(wanted)


class _Decoded:
    def __init__(self, data: np.ndarray) -> None:
        self.array = data

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset : offset + nbytes]


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) or not out else None


def _read(
    cand: Candidate, params_target: Any, opt_state_target: Any, tag: str
) -> tuple[Any, Any, _Bytes]:
    """Build the targets from the candidate's bytes; returns (params, opt, what was read).

    A collective (the fetch of bytes other machines hold): every process calls it.
    """
    lay = cand.layout
    pbind, obind = bind_state(params_target, opt_state_target, CompiledRules(()))
    index = {m.name: i for i, m in enumerate(lay.leaves)}
    blobs = _Bytes(cand)
    try:
        bound = [(b, _leaf_index(b, lay, index)) for b in pbind + obind]
        regions = [(li, box) for b, li in bound for box in _regions(b, lay.leaves[li])]
        blobs.fetched = exchange.fetch(
            _requests(cand, regions, blobs),
            lambda node, off, n: blobs[node].view(off, n),
            f"{tag}/fetch",
        )
        leaves = [_read_leaf(b, li, lay, blobs) for b, li in bound]
    finally:
        blobs.close()
    # Every shard of every leaf in one device_put: one dispatch instead of one per leaf.
    placed = [x for x in leaves if isinstance(x, _Placement)]
    shards = jax.device_put(
        [h for x in placed for h in x.hosts], [d for x in placed for d in x.devices]
    )
    values, at = [], 0
    for x in leaves:
        if isinstance(x, _Placement):
            n = len(x.hosts)
            values.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding,
                                                                   shards[at : at + n]))  # fmt: skip
            at += n
        else:
            values.append(x)
    params, opt = unbind_state(params_target, opt_state_target, values)
    return params, opt, blobs


@dataclasses.dataclass
class _Placement:
    """A sharded leaf to build: each local device's region (host arrays), in device order."""

    shape: tuple[int, ...]
    sharding: Any
    hosts: list[np.ndarray]
    devices: list[Any]


def _leaf_index(b: LeafBinding, lay: Layout, index: dict[str, int]) -> int:
    """The snapshot leaf a target leaf reads, checked (name, shape, dtype, sharding)."""
    li = index.get(b.name)
    if li is None:
        close = difflib.get_close_matches(b.name, list(index), n=3)
        raise MismatchError(
            f"ucp.memory restore: target leaf {b.name!r} is not in the snapshot"
            + (f" (close: {close})" if close else "")
            + "; pass targets of the same tree as the snapshotted state"
        )
    meta = lay.leaves[li]
    if tuple(b.shape) != meta.shape or b.dtype != meta.dtype:
        raise MismatchError(
            f"ucp.memory restore: target leaf {b.name!r} is {b.dtype.name}{list(b.shape)} but the "
            f"snapshot has {meta.dtype.name}{list(meta.shape)}; pass a target of the snapshotted "
            "shape and dtype (any sharding)"
        )
    if b.sharding is None and isinstance(b.value, jax.ShapeDtypeStruct):
        raise MismatchError(
            f"ucp.memory restore: target leaf {b.name!r} is a ShapeDtypeStruct without a "
            "sharding; give it sharding=NamedSharding(mesh, spec)"
        )
    return li


def _device_regions(b: LeafBinding) -> dict[Box, list[Any]]:
    """The distinct regions of a sharded leaf this process builds, each with its devices."""
    groups: dict[Box, list[Any]] = {}
    for dev, idx in b.sharding.addressable_devices_indices_map(b.shape).items():
        groups.setdefault(index_to_box(idx, b.shape), []).append(dev)
    return groups


def _regions(b: LeafBinding, meta: LeafMeta) -> list[Box]:
    """The distinct regions of a leaf this process builds (the whole leaf for a host value)."""
    if b.sharding is None:
        return [tuple((0, d) for d in meta.shape)]
    return list(_device_regions(b))


def _read_leaf(b: LeafBinding, li: int, lay: Layout, blobs: _Bytes) -> Any:
    """A host value, or the _Placement of a sharded leaf (its regions are views where possible)."""
    meta = lay.leaves[li]
    if b.sharding is None:
        full = tuple((0, d) for d in meta.shape)
        host = np.array(_assemble(full, li, lay, blobs))  # a host value: never a view
        return host if isinstance(b.value, np.ndarray) or meta.shape else host[()]
    hosts, devices = [], []
    for box, devs in _device_regions(b).items():
        # A region that is one piece is handed over as a view of the snapshot's mapping: on CPU,
        # device_put aliases it (no copy at all; the pages are read-only and never rewritten in
        # place while mapped, see SnapshotManager.restore), elsewhere it is the source of the
        # host-to-device copy.
        host = _assemble(box, li, lay, blobs)
        hosts.extend([host] * len(devs))
        devices.extend(devs)
    return _Placement(tuple(b.shape), b.sharding, hosts, devices)


def _slabs(box: Box, pieces: list[PieceRec]) -> list[PieceRec] | None:
    """The pieces in order when they are consecutive slabs (along the first axis) of `box`."""
    pieces = sorted(pieces, key=lambda p: p.box)
    for p, q in itertools.pairwise(pieces):
        if p.box[0][1] != q.box[0][0] or p.box[1:] != box[1:] or q.box[1:] != box[1:]:
            return None
    if pieces[0].box[0][0] != box[0][0] or pieces[-1].box[0][1] != box[0][1]:
        return None
    return pieces


def _contiguous(box: Box, pieces: list[PieceRec], blobs: _Bytes) -> np.ndarray | None:
    """The region as one view when its pieces are consecutive slabs of it stored back to back.

    (A shard split between replicas is stored so by the node that keeps both halves.) Else, when
    the slabs are in blobs this process maps, page aligned: the slabs mapped back to back.
    """
    slabs = _slabs(box, pieces)
    if slabs is None:
        return None
    view = _back_to_back(slabs, blobs)
    return view if view is not None else _stitched(slabs, blobs)


def _stitched(pieces: list[PieceRec], blobs: _Bytes) -> np.ndarray | None:
    """Consecutive slabs read from snapshot files here, mapped into one array (no copy)."""
    parts = []
    for p in pieces:
        node, off = blobs.homes(p)[0]
        blob = blobs[node] if blobs.sees(node) else None
        if not isinstance(blob, Blob):
            return None
        parts.append((blob.path, off, p.nbytes))
    return stitch(parts) if can_stitch(parts) else None


def _back_to_back(pieces: list[PieceRec], blobs: _Bytes) -> np.ndarray | None:
    """Consecutive slabs stored back to back in one blob, as one view of it."""
    homes = [dict(blobs.homes(p)) for p in pieces]
    for node, first in blobs.homes(pieces[0]):
        offs = [h.get(node) for h in homes]
        if None in offs:
            continue
        total = sum(p.nbytes for p in pieces)
        if all(o + p.nbytes == n for o, p, n in zip(offs, pieces, offs[1:])) and blobs.covers(
            node, first, total
        ):
            return blobs[node].view(first, total)
    return None


def _assemble(box: Box, li: int, lay: Layout, blobs: _Bytes) -> np.ndarray:
    """Region `box` of leaf `li`: a view of the snapshot's bytes when it is stored in one piece
    (or in consecutive slabs back to back), else assembled from its pieces."""
    meta = lay.leaves[li]
    shape = box_shape(box)
    covering = [p for p in lay.by_leaf[li] if _intersect(p.box, box) is not None]
    exact = [p for p in covering if p.box == box]
    if exact:
        return blobs.read(exact[0]).view(meta.dtype).reshape(shape)
    if box and covering and sum(box_size(p.box) for p in covering) == box_size(box):
        view = _contiguous(box, covering, blobs)
        if view is not None:
            return view.view(meta.dtype).reshape(shape)
    out = aligned_empty(shape, meta.dtype, prefault=True)
    blobs.copied += out.nbytes
    covered = 0
    for p in covering:
        inter = _intersect(p.box, box)
        src = blobs.read(p).view(meta.dtype).reshape(box_shape(p.box))
        out[relative_slices(inter, box)] = src[relative_slices(inter, p.box)]
        covered += box_size(inter)
    if covered != box_size(box):
        raise MismatchError(
            f"ucp.memory restore: the snapshot's pieces cover {covered} of the {box_size(box)} "
            f"elements of region {box} of {meta.name!r}; the snapshot is inconsistent"
        )
    return out
