"""Redundancy schemes: `replica` (copies) and `xor` (one parity lane) here, `rs2` (two parities,
module `rs2`), and the registry that names them. The interface they implement is
`scheme_base.RedundancyScheme`.

A new scheme is one subclass of `RedundancyScheme`, registered in `SCHEMES` (or with
`register_scheme`); then `SnapshotManager(redundancy="<name>")` uses it.
"""

from __future__ import annotations

import base64
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from .rs2 import RS2
from .scheme_base import BlobPiece, Need, ParityMismatch, RedundancyScheme, SnapshotLayout, align

__all__ = [
    "RS2",
    "SCHEMES",
    "BlobPiece",
    "Need",
    "ParityMismatch",
    "RedundancyScheme",
    "Replica",
    "SnapshotLayout",
    "Xor",
    "align",
    "register_scheme",
    "scheme_for",
]


class Replica(RedundancyScheme):
    """Each node also keeps a copy of the previous node of its group's pieces.

    The copies are merged with the node's own pieces in (leaf, box) order, so the slabs of a
    shard split between two nodes are adjacent and a restore can hand over whole shards.
    """

    name = "replica"

    def default_group_size(self, nodes: int) -> int:
        return 2

    def inline_copies(self, layout: SnapshotLayout, node: int) -> list[int]:
        return [self.backup_of(layout, node)] if len(layout.group_of[node]) > 1 else []

    @staticmethod
    def backup_of(layout: SnapshotLayout, n: int) -> int:
        """The node whose pieces node n keeps (the previous one in its group)."""
        g = layout.group_of[n]
        return g[(g.index(n) - 1) % len(g)]

    @staticmethod
    def holder_of(layout: SnapshotLayout, n: int) -> int:
        """The node keeping node n's pieces (the next one in its group)."""
        g = layout.group_of[n]
        return g[(g.index(n) + 1) % len(g)]

    def decodable(self, layout: SnapshotLayout, lost: int, present: Collection[int]) -> bool:
        return self.holder_of(layout, lost) in present

    def tolerance(self, group_size: int) -> int:
        return 1 if group_size > 1 else 0

    def decode_ranges(
        self, layout: SnapshotLayout, lost: int, present: Collection[int]
    ) -> list[tuple[int, int, int]]:
        h = self.holder_of(layout, lost)
        return [(h, layout.copy_offset(p, h), p.nbytes) for p in layout.by_node[lost]]

    def decode(self, layout: SnapshotLayout, lost: int, blobs: Mapping[int, Any]) -> np.ndarray:
        out = np.zeros(layout.primary[lost], np.uint8)
        h = self.holder_of(layout, lost)
        for p in layout.by_node[lost]:
            out[p.offset : p.offset + p.nbytes] = blobs[h].view(layout.copy_offset(p, h), p.nbytes)
        return out

    def extra_sources(self, layout: SnapshotLayout, node: int) -> list[int]:
        return [self.backup_of(layout, node)] if len(layout.group_of[node]) > 1 else []

    def keep_extras(self, layout: SnapshotLayout, node: int, raws: Mapping[int, bytes]) -> Any:
        (b,) = raws
        return {"of": b, "data": base64.b64encode(raws[b]).decode()}

    def rebuild_extra(
        self, layout: SnapshotLayout, lost: int, kept: Mapping[int, Any], raws: Mapping[int, bytes]
    ) -> bytes | None:
        rec = kept.get(self.holder_of(layout, lost))
        if not isinstance(rec, dict) or rec.get("of") != lost:
            return None
        return base64.b64decode(rec["data"])


class Xor(RedundancyScheme):
    """One parity lane per node (SCR-style, 1/(G-1) extra memory).

    Node i's pieces part is cut into G-1 lanes of C bytes, one per other member k of its group;
    node k keeps the XOR of the lanes the others cut for it. Losing one node of a group loses its
    data and its parity lane, and its data is the XOR of the others' lanes with the parity lanes
    they keep.
    """

    name = "xor"

    @staticmethod
    def lane_bytes(layout: SnapshotLayout, node: int) -> int:
        """C: the bytes of each lane in `node`'s group."""
        g = layout.group_of[node]
        return align(-(-max(layout.primary[n] for n in g) // (len(g) - 1)))

    def lane(self, layout: SnapshotLayout, i: int, k: int) -> tuple[int, int]:
        """The bytes [start, stop) of node i's pieces part that go into node k's parity."""
        g = layout.group_of[i]
        others = [m for m in g if m != i]
        c = self.lane_bytes(layout, i)
        start = others.index(k) * c
        return start, max(start, min(start + c, layout.primary[i]))

    def extra_bytes(self, layout: SnapshotLayout, node: int) -> int:
        return self.lane_bytes(layout, node) if len(layout.group_of[node]) > 1 else 0

    def needs(self, layout: SnapshotLayout, node: int) -> list[Need]:
        out: list[Need] = []
        base = layout.primary[node]
        for i in layout.group_of[node]:
            if i == node:
                continue
            a, b = self.lane(layout, i, node)
            for p in layout.by_node[i]:
                lo, hi = max(a, p.offset), min(b, p.offset + p.nbytes)
                if lo < hi:
                    out.append((p, lo - p.offset, hi - p.offset, base + lo - a, True))
        return out

    def decodable(self, layout: SnapshotLayout, lost: int, present: Collection[int]) -> bool:
        return all(m in present for m in layout.group_of[lost] if m != lost)

    def _reads(self, layout: SnapshotLayout, lost: int) -> list[tuple[int, int, int, list[Any]]]:
        """Per other member k, (k, start, stop, reads): lost's lane [start, stop) for k is k's
        parity lane XOR the lanes (node, offset, nbytes) the remaining members cut for k."""
        out = []
        g = layout.group_of[lost]
        for k in g:
            if k == lost:
                continue
            a, b = self.lane(layout, lost, k)
            if b <= a:
                continue
            reads = []
            for i in g:
                if i in (lost, k):
                    continue
                c, d = self.lane(layout, i, k)
                if min(d - c, b - a) > 0:
                    reads.append((i, c, min(d - c, b - a)))
            out.append((k, a, b, reads))
        return out

    def tolerance(self, group_size: int) -> int:
        return 1 if group_size > 1 else 0

    def decode_ranges(
        self, layout: SnapshotLayout, lost: int, present: Collection[int]
    ) -> list[tuple[int, int, int]]:
        out = []
        for k, a, b, reads in self._reads(layout, lost):
            out.append((k, layout.primary[k], b - a))
            out += reads
        return out

    def decode(self, layout: SnapshotLayout, lost: int, blobs: Mapping[int, Any]) -> np.ndarray:
        out = np.zeros(layout.primary[lost], np.uint8)
        for k, a, b, reads in self._reads(layout, lost):
            lane = np.array(blobs[k].view(layout.primary[k], b - a))
            for i, c, n in reads:
                np.bitwise_xor(lane[:n], blobs[i].view(c, n), out=lane[:n])
            out[a:b] = lane
        return out

    def extra_sources(self, layout: SnapshotLayout, node: int) -> list[int]:
        return [m for m in layout.group_of[node] if m != node]

    def keep_extras(self, layout: SnapshotLayout, node: int, raws: Mapping[int, bytes]) -> Any:
        """The XOR of the other members' extras (zero-padded to the longest) and their lengths."""
        if not raws:
            return None
        parity = np.zeros(max(len(r) for r in raws.values()), np.uint8)
        for r in raws.values():
            parity[: len(r)] ^= np.frombuffer(r, np.uint8)
        lengths = {str(m): len(r) for m, r in sorted(raws.items())}
        return {"lengths": lengths, "parity": base64.b64encode(parity.tobytes()).decode()}

    def rebuild_extra(
        self, layout: SnapshotLayout, lost: int, kept: Mapping[int, Any], raws: Mapping[int, bytes]
    ) -> bytes | None:
        """Any other member's parity XOR the extras of the members other than it and `lost`."""
        for k in layout.group_of[lost]:
            rec = kept.get(k)
            if k == lost or not isinstance(rec, dict) or str(lost) not in rec.get("lengths", {}):
                continue
            others = [int(m) for m in rec["lengths"] if int(m) != lost]
            if any(m not in raws for m in others):
                continue
            out = np.frombuffer(base64.b64decode(rec["parity"]), np.uint8).copy()
            for m in others:
                out[: len(raws[m])] ^= np.frombuffer(raws[m], np.uint8)
            return out[: rec["lengths"][str(lost)]].tobytes()
        return None


SCHEMES: dict[str, RedundancyScheme] = {s.name: s for s in (Replica(), Xor(), RS2())}


def register_scheme(scheme: RedundancyScheme) -> RedundancyScheme:
    """Make `scheme` usable by name (`SnapshotManager(redundancy=scheme.name)`)."""
    SCHEMES[scheme.name] = scheme
    return scheme


def scheme_for(name: str | None) -> RedundancyScheme | None:
    """The scheme called `name` (None: no redundancy).

    Raises:
        ValueError: no scheme has that name.

    >>> scheme_for("xor").name, scheme_for(None)
    ('xor', None)
    """
    if name is None:
        return None
    if name not in SCHEMES:
        raise ValueError(
            f"redundancy must be None or one of {sorted(SCHEMES)}, not {name!r}; pass one of "
            "those (or register a RedundancyScheme in ucp_jax._src.memory.schemes)"
        )
    return SCHEMES[name]
