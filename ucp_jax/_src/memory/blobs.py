"""Snapshot bytes as a restoring process reads them: mapped, fetched, or rebuilt.

A `BlobReader` gives a candidate step's node blobs: the ones this process sees are mapped from
shared memory, the ones only other processes see are fetched (`exchange`), and a lost node is
rebuilt from its group (`redundancy.decode_node`). `fetch_requests` plans which byte ranges this
process must fetch for the regions it restores.
"""

from __future__ import annotations

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

    def __init__(self, cand: Candidate) -> None:
        self.cand = cand
        self.fetched: dict[int, exchange.Fetched] = {}
        self._homes: dict[BlobPiece, list[tuple[int, int]]] = {}
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
            elif node in self.cand.lost:  # with every lost member of its group, at once
                lost = self.lost_with(node)
                others = {m: self[m] for m in self.cand.layout.group_of[node] if m not in lost}
                for m, data in decode_nodes(self.cand.layout, lost, others).items():
                    self._open[m] = Decoded(data)
            else:
                raise RuntimeError(
                    f"ucp.memory restore: node {node}'s snapshot is on another machine and none "
                    "of its bytes were fetched (an internal planning error; please report it)"
                )
        return self._open[node]

    def lost_with(self, node: int) -> list[int]:
        """The lost members of a lost node's group (it among them)."""
        return [m for m in self.cand.layout.group_of[node] if m in self.cand.lost]

    def covers(self, node: int, offset: int, nbytes: int) -> bool:
        """Whether `view(offset, nbytes)` of that node is readable here (fetched ranges only)."""
        if node in self.cand.entries or node in self.cand.lost:
            return True
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
        for b in self._open.values():
            if isinstance(b, Blob):
                b.close()


def fetch_requests(cand: Candidate, regions: list[tuple[int, Box]], blobs: BlobReader) -> list[Any]:
    """The byte ranges this process must fetch to read `regions` ((leaf, box) pairs): pieces on
    nodes it does not see, and what decoding a lost node needs from group members it does not
    see (for every lost member of its group: they are rebuilt together). Each is served by the
    lowest process that sees the node."""
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
            if intersect(p.box, box) is None:
                continue
            node, off = blobs.homes(p)[0]
            if node in cand.lost:
                decode.update(blobs.lost_with(node))
            else:
                need(node, off, p.nbytes)
    for lost in sorted(decode):
        for node, off, n in decode_ranges(lay, lost, cand.present):
            need(node, off, n)
    return exchange.merge(wanted)


class Decoded:
    def __init__(self, data: np.ndarray) -> None:
        self.array = data

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset : offset + nbytes]


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) or not out else None
