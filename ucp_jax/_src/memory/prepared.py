"""What a snapshot of one state structure copies (`Prepared`, planned once, cached by the
`SnapshotManager`), and the statistics of the last snapshot (`SnapshotStats`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from . import copies
from .layout import SnapshotLayout
from .redundancy import Fetch


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
