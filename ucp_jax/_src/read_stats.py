"""What a restore read: bytes needed, read, padded, staged and the chunks touched (`ucp.last_read_stats`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class ReadStats:
    """What the last restore in this process read.

    Attributes:
        bytes_needed: bytes of the distinct regions this process's devices need.
        bytes_read: bytes requested from storage (padding is never read).
        bytes_padding: bytes filled with zeros by VocabPadded.
        reads: number of region reads issued.
        bytes_chunks: bytes of the stored chunks those reads touch (storage reads whole chunks;
            more than bytes_read when a region cuts through chunks).
        bytes_staged: bytes placed on devices through pinned host memory (`UCP_STAGING`).
    """

    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_padding: int = 0
    reads: int = 0
    bytes_chunks: int = 0
    bytes_staged: int = 0

    @property
    def amplification(self) -> float:
        """bytes_read / (bytes_needed - padding): 1.00 means every needed byte was read once."""
        want = self.bytes_needed - self.bytes_padding
        return self.bytes_read / want if want else 1.0

    @property
    def chunk_amplification(self) -> float:
        """bytes_chunks / bytes_read: 1.00 means every chunk touched was wholly needed."""
        return self.bytes_chunks / self.bytes_read if self.bytes_read else 1.0


def chunk_bytes_touched(box: Sequence[tuple[int, int]], shape: Sequence[int], chunk: Sequence[int],
                        itemsize: int) -> int:  # fmt: skip
    """Bytes of the whole chunks of a regular grid that a box touches."""
    n = itemsize
    for (lo, hi), dim, c in zip(box, shape, chunk):
        if hi <= lo:
            return 0
        n *= min(-(-hi // c) * c, dim) - (lo // c) * c
    return n


_last_stats = ReadStats()


def last_read_stats() -> ReadStats:
    """Read statistics of the last `restore` in this process.

    >>> isinstance(last_read_stats(), ReadStats)
    True
    """
    return _last_stats


def record(stats: ReadStats) -> None:
    """Make `stats` what `last_read_stats` returns (a restore's, once it has read everything)."""
    global _last_stats
    _last_stats = stats
