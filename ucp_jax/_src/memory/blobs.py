"""Snapshot bytes as a restoring process reads them: mapped, fetched, or rebuilt.

A `BlobReader` gives a candidate step's node blobs: the ones this process sees are mapped from
shared memory, the ones only other processes see are fetched (`exchange`), and a lost node is
rebuilt from its group (`redundancy.decode_nodes`): only the byte ranges of it this process reads
(`wanted`), where the scheme can rebuild part of a node (rs2: the lanes that hold them), unless
the processes of its machine rebuilt it together (`share`).
`fetch_requests` plans which byte ranges this process must fetch for the regions it restores.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..mapping.boxes import Box
from . import exchange
from .layout import BlobPiece
from .redundancy import decode_nodes, decode_ranges
from .shm import DATA, Blob

if TYPE_CHECKING:
    from .candidate import Candidate


class BlobReader:
    """Node blobs as this process reads them: mapped when it sees them, else bytes fetched from
    the process that does, else (a lost node) rebuilt from its group."""

    def __init__(self, cand: Candidate, opened: dict[int, Blob] | None = None) -> None:
        self.cand = cand
        self._mapped = dict(opened or {})  # blobs already mapped (to check them: `integrity`)
        self.fetched: dict[int, exchange.Fetched] = {}
        self._homes: dict[BlobPiece, list[tuple[int, int]]] = {}
        self._open: dict[int, Any] = {}
        self.files: list[Path] = []
        self.copied = 0  # bytes assembled by copying (not views of the snapshot's pages)
        # lost node -> the (offset, nbytes) of it this process reads (None: all of every node)
        self.want: dict[int, list[tuple[int, int]]] | None = None
        self._spans: dict[int, list[tuple[int, int]]] = {}
        self.notes: list[str] = []  # how lost nodes were rebuilt with peers (`share`)

    def sees(self, node: int) -> bool:
        return node in self.cand.entries

    def __getitem__(self, node: int) -> Any:
        if node not in self._open:
            if node in self.cand.entries:
                path = self.cand.entries[node].path / DATA
                self.files.append(path)
                mapped = self._mapped.pop(node, None)
                self._open[node] = mapped if mapped is not None else Blob.open(path)
            elif node in self.fetched:
                self._open[node] = self.fetched[node]
            elif node in self.cand.lost:  # with every lost member of its group, at once
                lost = self.lost_with(node)
                others = {m: self[m] for m in self.cand.layout.group_of[node] if m not in lost}
                want = None if self.want is None else {m: self.want.get(m, []) for m in lost}
                for m, data in decode_nodes(self.cand.layout, lost, others, want).items():
                    self._open[m] = Decoded(data, None if want is None else want[m])
            else:
                raise RuntimeError(
                    f"ucp.memory restore: node {node}'s snapshot is on another machine and none "
                    "of its bytes were fetched (an internal planning error; please report it)"
                )
        return self._open[node]

    def rebuilt(self, node: int, data: Decoded) -> None:
        """A lost node's bytes, rebuilt elsewhere (`share`): read instead of rebuilding them."""
        self._open[node] = data

    def lost_with(self, node: int) -> list[int]:
        """The lost members of a lost node's group (it among them)."""
        return [m for m in self.cand.layout.group_of[node] if m in self.cand.lost]

    def covers(self, node: int, offset: int, nbytes: int) -> bool:
        """Whether `view(offset, nbytes)` of that node is readable here (fetched ranges only)."""
        if node in self.cand.entries:
            return True
        if node in self.cand.lost:  # rebuilt: the parts of it planned
            if self.want is None:
                return True
            if node not in self._spans:
                self._spans[node] = _spans(self.want.get(node, []))
            return _inside(self._spans[node], offset, nbytes)
        return node in self.fetched and self.fetched[node].covers(offset, nbytes)

    def homes(self, p: BlobPiece) -> list[tuple[int, int]]:
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

    def read(self, p: BlobPiece) -> np.ndarray:
        node, off = self.homes(p)[0]
        return self[node].view(off, p.nbytes)

    def close(self) -> None:
        for b in [*self._open.values(), *self._mapped.values()]:
            if isinstance(b, Blob):
                b.close()


def wanted(
    cand: Candidate, regions: list[tuple[int, Box]], blobs: BlobReader
) -> dict[int, list[tuple[int, int]]]:
    """Per lost node whose group has a node this process reads (every lost member of such a
    group), the (offset, nbytes) of its pieces that reading `regions` takes (maybe none)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for li, box in regions:
        for p in cand.layout.covering(li, box):
            node, off = blobs.homes(p)[0]
            if node in cand.lost:
                for m in blobs.lost_with(node):
                    out.setdefault(m, [])
                out[node].append((off, p.nbytes))
    return out


def fetch_requests(cand: Candidate, regions: list[tuple[int, Box]], blobs: BlobReader) -> list[Any]:
    """The byte ranges this process must fetch to read `regions` ((leaf, box) pairs): pieces on
    nodes it does not see, and what rebuilding the wanted parts of lost nodes needs from group
    members it does not see (`blobs.want`, or all of every lost member of their groups). Each is
    served by the lowest process that sees the node."""
    lay = cand.layout
    if all(blobs.sees(n) for n in cand.present):
        return []  # every snapshot there is, this process sees
    requests: list[tuple[int, int, int, int]] = []
    decode: set[int] = set()

    def need(node: int, off: int, n: int) -> None:
        if not blobs.sees(node) and n > 0:
            requests.append((node, min(cand.present[node]), off, n))

    for li, box in regions:
        for p in lay.covering(li, box):
            node, off = blobs.homes(p)[0]
            if node in cand.lost:
                decode.update(blobs.lost_with(node))
            else:
                need(node, off, p.nbytes)
    for lost in sorted(decode):
        for node, off, n in decode_ranges(lay, lost, cand.present, blobs.want):
            need(node, off, n)
    return exchange.merge(requests)


def _spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, nbytes) ranges merged into sorted, disjoint [start, end) spans."""
    out: list[list[int]] = []
    for off, n in sorted(r for r in ranges if r[1] > 0):
        if out and off <= out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n)
        else:
            out.append([off, off + n])
    return [(a, b) for a, b in out]


def _inside(spans: list[tuple[int, int]], offset: int, nbytes: int) -> bool:
    i = bisect.bisect_right(spans, offset, key=lambda s: s[0]) - 1
    return nbytes <= 0 or (i >= 0 and offset + nbytes <= spans[i][1])


class Decoded:
    """A rebuilt node's pieces part; with `ranges`, only those bytes were asked for (the rest
    may not be rebuilt), and a view outside them is an error, not zeros."""

    def __init__(self, data: np.ndarray, ranges: list[tuple[int, int]] | None = None) -> None:
        self.array = data
        self.spans = None if ranges is None else _spans(ranges)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if self.spans is not None and not _inside(self.spans, offset, nbytes):
            raise RuntimeError(
                f"ucp.memory restore: bytes [{offset}, {offset + nbytes}) of a rebuilt node "
                "were read but not planned for rebuilding (an internal planning error; please "
                "report it)"
            )
        return self.array[offset : offset + nbytes]


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) or not out else None
