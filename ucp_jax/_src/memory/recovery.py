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
import json
import logging
import mmap
import os
import re
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..errors import MismatchError, NotACheckpointError
from ..patterns import Box, box_shape, box_size, index_to_box
from ..plan import LeafBinding, bind_state, unbind_state
from ..rules import CompiledRules, Rule
from .layout import Layout, PieceRec
from .redundancy import decode_node
from .shm import DATA, Blob, Entry, committed, list_nodes

log = logging.getLogger("ucp_jax")


@dataclasses.dataclass
class Candidate:
    """A step that can be recovered from shared memory.

    Attributes:
        run, step: which snapshot.
        layout: its layout.
        entries: node -> its committed snapshot, for the nodes that have one.
        lost: nodes whose bytes must be decoded from their group.
    """

    run: int
    step: int
    layout: Layout
    entries: dict[int, Entry]
    lost: list[int]

    @property
    def key(self) -> list[Any]:
        return [self.run, self.step, self.layout.digest]


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
    """

    step: int | None
    source: str
    path: str
    lost: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    reason: str = ""
    files: list[str] = dataclasses.field(default_factory=list)


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


def scan(root: Path) -> tuple[list[Candidate], list[str]]:
    """Every recoverable step under a namespace folder, newest first; and why others are not."""
    by_key: dict[tuple[int, int, str], dict[int, Entry]] = {}
    for n in list_nodes(root):
        for e in committed(root / str(n)):
            if e.node == n:
                by_key.setdefault((e.run, e.step, e.plan), {})[n] = e
    out, why = [], []
    for (run, step, digest), entries in sorted(by_key.items(), reverse=True):
        lay = _layout(root, digest)
        if lay is None:
            why.append(f"step {step}: its layout {digest} is on no node")
            continue
        lost = [n for n in range(lay.nodes) if n not in entries]
        bad = [n for n in lost if not _decodable(lay, n, entries)]
        if bad:
            why.append(f"step {step}: node(s) {bad} missing and not decodable from their group")
            continue
        out.append(Candidate(run, step, lay, entries, lost))
    return out, why


def _decodable(lay: Layout, n: int, entries: dict[int, Entry]) -> bool:
    if lay.redundancy == "replica":
        return lay.holder_of(n) in entries
    if lay.redundancy == "xor":
        return all(m in entries for m in lay.group_of[n] if m != n)
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


def _allgather_json(obj: Any, tag: str) -> list[Any]:
    """Every process's `obj`, through the coordination service's key-value store (no compile)."""
    if jax.process_count() == 1:
        return [obj]
    from jax._src import distributed

    from ..sync import BARRIER_TIMEOUT_S

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("several jax processes but no jax.distributed client to agree with")
    client.key_value_set(f"{tag}/{jax.process_index()}", json.dumps(obj))
    ms = int(BARRIER_TIMEOUT_S * 1000)
    return [
        json.loads(client.blocking_key_value_get(f"{tag}/{i}", ms))
        for i in range(jax.process_count())
    ]


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
    cands, why = scan(root)
    keys = _allgather_json([c.key for c in cands], tag)
    common = set(map(tuple, keys[0])).intersection(*(map(tuple, k) for k in keys[1:]))
    chosen = next((c for c in cands if tuple(c.key) in common), None)
    if chosen is not None:
        params, opt, files = _read(chosen, params_target, opt_state_target)
        source = "redundancy" if chosen.lost else "memory"
        info = RestoreInfo(chosen.step, source, str(root), chosen.lost, time.perf_counter() - t0)
        info.files = [str(f) for f in files]
        detail = f", node(s) {chosen.lost} decoded from {chosen.layout.redundancy}" * bool(
            chosen.lost
        )
        log.info("ucp.memory: restored step %d from shared memory%s", chosen.step, detail)
        return params, opt, info
    reason = "; ".join(why) or f"no committed snapshot under {root}"
    if cands:
        reason = "the processes see no common recoverable step"
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
    """A node's blob bytes: its mapped data file, or its pieces part rebuilt from its group."""

    def __init__(self, cand: Candidate) -> None:
        self.cand = cand
        self._open: dict[int, Any] = {}
        self.files: list[Path] = []

    def __getitem__(self, node: int) -> Any:
        if node not in self._open:
            if node in self.cand.entries:
                self.files.append(self.cand.entries[node].path / DATA)
                self._open[node] = Blob.open(self.cand.entries[node].path / DATA)
            else:
                group = self.cand.layout.group_of[node]
                others = {m: self[m] for m in group if m != node}
                self._open[node] = _Decoded(decode_node(self.cand.layout, node, others))
        return self._open[node]

    def homes(self, p: PieceRec) -> list[tuple[int, int]]:
        """(node, offset) where a piece can be read, best first.

        This process's own node first (on a cluster, the only shared memory it can see), then
        the piece's node, then the node keeping its replica; a lost node's pieces come from its
        decoded bytes last.
        """
        here = jax.process_index()
        ents = self.cand.entries
        locs = [loc for loc in self.cand.layout.locations(p) if loc[0] in ents]
        locs.sort(key=lambda loc: (loc[0] != here, loc[0] != p.node))
        if p.node not in ents:
            locs.append((p.node, p.offset))  # decoded from its group
        return locs

    def read(self, p: PieceRec) -> np.ndarray:
        node, off = self.homes(p)[0]
        return self[node].view(off, p.nbytes)

    def close(self) -> None:
        for b in self._open.values():
            if isinstance(b, Blob):
                b.close()


class _Decoded:
    def __init__(self, data: np.ndarray) -> None:
        self.array = data

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset : offset + nbytes]


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) or not out else None


def _rel(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def _read(
    cand: Candidate, params_target: Any, opt_state_target: Any
) -> tuple[Any, Any, list[Path]]:
    lay = cand.layout
    pbind, obind = bind_state(params_target, opt_state_target, CompiledRules(()))
    index = {m.name: i for i, m in enumerate(lay.leaves)}
    blobs = _Bytes(cand)
    try:
        leaves = [_read_leaf(b, lay, index, blobs) for b in pbind + obind]
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
    return params, opt, blobs.files


@dataclasses.dataclass
class _Placement:
    """A sharded leaf to build: each local device's region (host arrays), in device order."""

    shape: tuple[int, ...]
    sharding: Any
    hosts: list[np.ndarray]
    devices: list[Any]


def _read_leaf(b: LeafBinding, lay: Layout, index: dict[str, int], blobs: _Bytes) -> Any:
    """A host value, or the _Placement of a sharded leaf (its regions are views where possible)."""
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
    if b.sharding is None:
        if isinstance(b.value, jax.ShapeDtypeStruct):
            raise MismatchError(
                f"ucp.memory restore: target leaf {b.name!r} is a ShapeDtypeStruct without a "
                "sharding; give it sharding=NamedSharding(mesh, spec)"
            )
        full = tuple((0, d) for d in meta.shape)
        host = np.array(_assemble(full, li, lay, blobs))  # a host value: never a view
        return host if isinstance(b.value, np.ndarray) or meta.shape else host[()]
    groups: dict[Box, list[Any]] = {}
    for dev, idx in b.sharding.addressable_devices_indices_map(b.shape).items():
        groups.setdefault(index_to_box(idx, b.shape), []).append(dev)
    hosts, devices = [], []
    for box, devs in groups.items():
        # A region that is one piece is handed over as a view of the snapshot's mapping: on CPU,
        # device_put aliases it (no copy at all; the pages are read-only and never rewritten in
        # place while mapped, see SnapshotManager.restore), elsewhere it is the source of the
        # host-to-device copy.
        host = _assemble(box, li, lay, blobs)
        hosts.extend([host] * len(devs))
        devices.extend(devs)
    return _Placement(tuple(b.shape), b.sharding, hosts, devices)


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary (big ones pre-faulted)."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n >= 1 << 20 and hasattr(mmap, "MAP_POPULATE"):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        mm = mmap.mmap(-1, n, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return np.frombuffer(mm, np.uint8).view(dtype).reshape(shape)  # page aligned
    buf = np.empty(n + 64, np.uint8)
    off = -buf.ctypes.data % 64
    return buf[off : off + n].view(dtype).reshape(shape)


def _contiguous(box: Box, pieces: list[PieceRec], blobs: _Bytes) -> np.ndarray | None:
    """The region as one view when its pieces are consecutive slabs of it stored back to back.

    (A shard split between replicas is stored so by the node that keeps both halves.)
    """
    pieces = sorted(pieces, key=lambda p: p.box)
    for p, q in itertools.pairwise(pieces):
        if p.box[0][1] != q.box[0][0] or p.box[1:] != box[1:] or q.box[1:] != box[1:]:
            return None
    if pieces[0].box[0][0] != box[0][0] or pieces[-1].box[0][1] != box[0][1]:
        return None
    homes = [dict(blobs.homes(p)) for p in pieces]
    for node, first in blobs.homes(pieces[0]):
        offs = [h.get(node) for h in homes]
        if None in offs:
            continue
        if all(o + p.nbytes == n for o, p, n in zip(offs, pieces, offs[1:])):
            return blobs[node].view(first, sum(p.nbytes for p in pieces))
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
    out = _aligned_empty(shape, meta.dtype)
    covered = 0
    for p in covering:
        inter = _intersect(p.box, box)
        src = blobs.read(p).view(meta.dtype).reshape(box_shape(p.box))
        out[_rel(inter, box)] = src[_rel(inter, p.box)]
        covered += box_size(inter)
    if covered != box_size(box):
        raise MismatchError(
            f"ucp.memory restore: the snapshot's pieces cover {covered} of the {box_size(box)} "
            f"elements of region {box} of {meta.name!r}; the snapshot is inconsistent"
        )
    return out
