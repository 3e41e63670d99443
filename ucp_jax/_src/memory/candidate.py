"""A snapshot step that can be recovered from shared memory: which nodes hold it, which are lost."""

from __future__ import annotations

import dataclasses

from .layout import SnapshotLayout
from .shm import Entry


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
    layout: SnapshotLayout
    entries: dict[int, Entry]
    lost: list[int]
    present: dict[int, list[int]]
