"""Before a restore reads a step: check each node's blob against the CRC-32 kept at its commit.

Shared memory outlives the trainer, so its bytes can be damaged after a snapshot commits (a
stray write through a mapping, a bad DIMM, a tool that touched the file). A node whose blob no
longer matches the CRC-32 in its `index.json` is treated as lost: rebuilt from its group when
the scheme allows, else the restore moves on to an older step, never to wrong values.

Each node is checked by one process that sees it (spread over the processes of a machine), so
the work per process is its share of its machine's blobs; the damaged nodes are then agreed
with every process (one small exchange) so that all restore the same step the same way.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jax

from . import exchange
from .candidate import Candidate
from .shm import DATA, Blob, blob_crc


def checker(node: int, present: dict[int, list[int]]) -> int:
    """The process that checks `node`'s blob: one of those that see it, spread by node.

    >>> checker(5, {5: [0, 1, 2, 3]})
    1
    """
    procs = present[node]
    return procs[node % len(procs)]


def check(cand: Candidate, opened: dict[int, Blob]) -> dict[int, str]:
    """Damaged nodes among those this process checks: node -> what was found.

    The blobs it maps to check are left in `opened` (node -> Blob), for the restore to read
    without mapping them again.
    """
    me = jax.process_index()
    mine = [n for n, e in sorted(cand.entries.items())
            if e.crc32 is not None and checker(n, cand.present) == me]  # fmt: skip

    def one(node: int) -> str | None:
        entry = cand.entries[node]
        try:
            blob = Blob.open(entry.path / DATA)
        except OSError as e:
            return f"its data file cannot be read ({e})"
        opened[node] = blob
        got = blob_crc(blob.array)
        if got != entry.crc32:
            return (f"{entry.path / DATA} has CRC-32 {got:#010x}, not the {entry.crc32:#010x} "
                    "it was committed with (damaged in shared memory)")  # fmt: skip
        return None

    with ThreadPoolExecutor(max(1, min(4, len(mine)))) as pool:
        found = dict(zip(mine, pool.map(one, mine)))
    return {n: why for n, why in found.items() if why is not None}


def agree_damaged(cand: Candidate, opened: dict[int, Blob], tag: str) -> dict[int, str]:
    """Every process's damaged nodes of `cand` (a collective when there are several)."""
    mine = check(cand, opened)
    if jax.process_count() == 1:
        return mine
    everyone = exchange.allgather_json({str(n): w for n, w in mine.items()}, f"{tag}/integrity")
    return {int(n): w for d in everyone for n, w in d.items()}


def without(cand: Candidate, damaged: dict[int, str]) -> Candidate:
    """The candidate with its damaged nodes counted as lost."""
    return dataclasses.replace(
        cand,
        entries={n: e for n, e in cand.entries.items() if n not in damaged},
        lost=sorted(set(cand.lost) | set(damaged)),
        present={n: ps for n, ps in cand.present.items() if n not in damaged},
    )
