"""Placing a recovered step on the target mesh: each device's region, zero-copy where possible.

A region stored as one piece, or as consecutive slabs back to back (in one blob, or page aligned
in several: `stitch`), is handed over as a view of the snapshot's pages; on CPU `device_put`
aliases it, so nothing is copied. Other regions are assembled from their pieces.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..errors import MismatchError
from ..mapping.binding import LeafBinding, bind_state, device_regions, unbind_state
from ..mapping.boxes import Box, box_shape, box_size, relative_slices
from ..mapping.keys import rewrap
from ..mapping.rules import CompiledRules
from ..util.buffers import aligned_empty
from . import exchange, share
from .blobs import BlobReader, fetch_requests, intersect, wanted
from .candidate import Candidate
from .layout import BlobPiece, LeafMeta, SnapshotLayout
from .shm import Blob
from .stitch import can_stitch, stitch


def read_candidate(
    cand: Candidate,
    params_target: Any,
    opt_state_target: Any,
    tag: str,
    root: Path | None = None,
    scratch: list[Path] | None = None,
    opened: dict[int, Blob] | None = None,
) -> tuple[Any, Any, BlobReader]:
    """Build the targets from the candidate's bytes; returns (params, opt, what was read).

    A collective (the fetch of bytes other machines hold): every process calls it. With `root`
    (this process's namespace folder), lost nodes that processes of one machine all read are
    rebuilt once, shared (`share`; the files it writes are added to `scratch`, for
    `share.cleanup` once every process is done with them). `opened`: node blobs already mapped
    (`integrity.check`), read from rather than mapped again.
    """
    lay = cand.layout
    pbind, obind = bind_state(params_target, opt_state_target, CompiledRules(()))
    index = {m.name: i for i, m in enumerate(lay.leaves)}
    blobs = BlobReader(cand, opened)
    try:
        bound = [(b, _leaf_index(b, lay, index)) for b in pbind + obind]
        regions = [(li, box) for b, li in bound for box in _regions(b, lay.leaves[li])]
        blobs.want = wanted(cand, regions, blobs)  # a lost node: only what is read is rebuilt
        requests = fetch_requests(cand, regions, blobs)
        # one gather: the fetch requests, and what a rebuild shared on a machine takes
        everyone = exchange.allgather_json(
            {"requests": requests, "share": share.offer(cand, blobs, root)}, f"{tag}/fetch/requests"
        )
        blobs.fetched = exchange.fetch(
            requests,
            lambda node, off, n: blobs[node].view(off, n),
            f"{tag}/fetch",
            [e["requests"] for e in everyone],
        )
        offers = [e["share"] for e in everyone]
        blobs.notes = share.rebuild(cand, blobs, offers, root, f"{tag}/share",
                                    [] if scratch is None else scratch)  # fmt: skip
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
    values = rewrap(values, [b.key_impl for b, _ in bound])
    params, opt = unbind_state(params_target, opt_state_target, values)
    return params, opt, blobs


@dataclasses.dataclass
class _Placement:
    """A sharded leaf to build: each local device's region (host arrays), in device order."""

    shape: tuple[int, ...]
    sharding: Any
    hosts: list[np.ndarray]
    devices: list[Any]


def _leaf_index(b: LeafBinding, lay: SnapshotLayout, index: dict[str, int]) -> int:
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


def _regions(b: LeafBinding, meta: LeafMeta) -> list[Box]:
    """The distinct regions of a leaf this process builds (the whole leaf for a host value)."""
    if b.sharding is None:
        return [tuple((0, d) for d in meta.shape)]
    return list(device_regions(b))


def _read_leaf(b: LeafBinding, li: int, lay: SnapshotLayout, blobs: BlobReader) -> Any:
    """A host value, or the _Placement of a sharded leaf (its regions are views where possible)."""
    meta = lay.leaves[li]
    if b.sharding is None:
        full = tuple((0, d) for d in meta.shape)
        host = np.array(_assemble(full, li, lay, blobs))  # a host value: never a view
        return host if isinstance(b.value, np.ndarray) or meta.shape else host[()]
    hosts, devices = [], []
    for box, devs in device_regions(b).items():
        # A region that is one piece is handed over as a view of the snapshot's mapping: on CPU,
        # device_put aliases it (no copy at all; the pages are read-only and never rewritten in
        # place while mapped, see SnapshotManager.restore), elsewhere it is the source of the
        # host-to-device copy.
        host = _assemble(box, li, lay, blobs)
        hosts.extend([host] * len(devs))
        devices.extend(devs)
    return _Placement(tuple(b.shape), b.sharding, hosts, devices)


def _slabs(box: Box, pieces: list[BlobPiece]) -> list[BlobPiece] | None:
    """The pieces in order when they are consecutive slabs (along the first axis) of `box`."""
    pieces = sorted(pieces, key=lambda p: p.box)
    for p, q in itertools.pairwise(pieces):
        if p.box[0][1] != q.box[0][0] or p.box[1:] != box[1:] or q.box[1:] != box[1:]:
            return None
    if pieces[0].box[0][0] != box[0][0] or pieces[-1].box[0][1] != box[0][1]:
        return None
    return pieces


def _contiguous(box: Box, pieces: list[BlobPiece], blobs: BlobReader) -> np.ndarray | None:
    """The region as one view when its pieces are consecutive slabs of it stored back to back.

    (A shard split between replicas is stored so by the node that keeps both halves.) Else, when
    the slabs are in blobs this process maps, page aligned: the slabs mapped back to back.
    """
    slabs = _slabs(box, pieces)
    if slabs is None:
        return None
    view = _back_to_back(slabs, blobs)
    return view if view is not None else _stitched(slabs, blobs)


def _stitched(pieces: list[BlobPiece], blobs: BlobReader) -> np.ndarray | None:
    """Consecutive slabs read from snapshot files here, mapped into one array (no copy)."""
    parts = []
    for p in pieces:
        node, off = blobs.homes(p)[0]
        blob = blobs[node] if blobs.sees(node) else None
        if not isinstance(blob, Blob):
            return None
        parts.append((blob.path, off, p.nbytes))
    return stitch(parts) if can_stitch(parts) else None


def _back_to_back(pieces: list[BlobPiece], blobs: BlobReader) -> np.ndarray | None:
    """Consecutive slabs stored back to back in one blob, as one view of it."""
    homes = [dict(blobs.homes(p)) for p in pieces]
    for node, first in blobs.homes(pieces[0]):
        found = [h.get(node) for h in homes]
        offs = [o for o in found if o is not None]
        if len(offs) < len(found):
            continue
        total = sum(p.nbytes for p in pieces)
        if all(o + p.nbytes == n for o, p, n in zip(offs, pieces, offs[1:])) and blobs.covers(
            node, first, total
        ):
            return blobs[node].view(first, total)
    return None


def _assemble(box: Box, li: int, lay: SnapshotLayout, blobs: BlobReader) -> np.ndarray:
    """Region `box` of leaf `li`: a view of the snapshot's bytes when it is stored in one piece
    (or in consecutive slabs back to back), else assembled from its pieces."""
    meta = lay.leaves[li]
    shape = box_shape(box)
    covering = lay.covering(li, box)
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
        inter = intersect(p.box, box)
        assert inter is not None  # `covering` holds the pieces that intersect `box`
        src = blobs.read(p).view(meta.dtype).reshape(box_shape(p.box))
        out[relative_slices(inter, box)] = src[relative_slices(inter, p.box)]
        covered += box_size(inter)
    if covered != box_size(box):
        raise MismatchError(
            f"ucp.memory restore: the snapshot's pieces cover {covered} of the {box_size(box)} "
            f"elements of region {box} of {meta.name!r}; the snapshot is inconsistent"
        )
    return out
