"""The interface of a redundancy scheme: how a group of nodes keeps what it takes to rebuild lost
members. The schemes themselves are in `schemes` (replica, xor) and `rs2`.

A scheme answers, for a snapshot layout (`layout.SnapshotLayout`), these questions, and nothing
else in the package branches on the scheme's name:

- where redundancy bytes live: copies of other nodes' pieces placed among a node's own pieces
  (`inline_copies`, as `replica` does) and/or a redundancy area after them (`extra_bytes`, the
  parity lanes of `xor` and `rs2`);
- what each node fetches to fill them (`needs`: byte ranges of other nodes' pieces, copied or
  XORed into place); `redundancy.plan_fetches` turns them into device copies or rolls;
- which lost members of a group can be rebuilt from the members that are left (`decodable`,
  `tolerance`), which bytes that reads (`decode_ranges`) and the rebuild itself (`decode`, or
  `decode_all` for every lost member of a group at once); optionally, a rebuild of only the byte
  ranges of the lost members that a restoring process reads (`part_ranges`, `decode_parts`: by
  default the whole nodes); and optionally a rebuild that the processes which need the same
  lost nodes split between them (`share_units`, `decode_share`, `check_parts`: `share`);
- optionally, a digest of each node's own bytes that its peers keep in their redundancy areas
  (`digest_sources`, `digest`, `keep_digests`; exchanged through the coordination service before
  a snapshot commits), so that a rebuild from a stale or damaged parity is detected
  (`ParityMismatch`) instead of restoring wrong values;
- the same for each process's `extra` (small serialised bytes, exchanged through the
  coordination service): whose a node keeps redundancy for (`extra_sources`), what it keeps
  (`keep_extras`, JSON in its snapshot's index) and the rebuild of a lost node's
  (`rebuild_extra`).

A new scheme is one subclass of `RedundancyScheme`, registered in `schemes.SCHEMES` (or with
`schemes.register_scheme`); then `SnapshotManager(redundancy="<name>")` uses it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from ..errors import ChecksumError


class BlobPiece(Protocol):
    """What a scheme reads of a `layout.BlobPiece`: where its bytes lie in its node's blob."""

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class SnapshotLayout(Protocol):
    """What a scheme reads of a `layout.SnapshotLayout`.

    A Protocol, so that this module does not import `layout` (which builds on the schemes).
    """

    @property
    def by_node(self) -> Sequence[Sequence[Any]]: ...

    @property
    def group_of(self) -> Mapping[int, Sequence[int]]: ...

    @property
    def primary(self) -> Sequence[int]: ...

    def copy_offset(self, p: Any, holder: int) -> int: ...

    def copies_at(self, holder: int) -> Sequence[tuple[Any, int]]: ...


# (piece of another node, first byte, end byte, offset in this node's blob, XOR it in?)
Need = tuple[Any, int, int, int, bool]
# Per lost node, the (offset, nbytes) ranges of its pieces part that a restore reads.
Wanted = Mapping[int, Sequence[tuple[int, int]]]


def align(n: int, to: int = 64) -> int:
    """`n` rounded up to a multiple of `to`."""
    return -(-n // to) * to


class ParityMismatch(ChecksumError):
    """A node rebuilt from its group does not match the digest its peers kept of it: a parity
    (or a surviving member's bytes) is stale or damaged. A restore tries an older snapshot, then
    the persisted checkpoint; it never returns the wrong bytes."""


class RedundancyScheme:
    """Base class: no redundancy (a lost node is lost). Subclasses override what they need."""

    name: ClassVar[str] = ""
    # Groups smaller than this are merged into the previous group (`layout.make_groups`).
    min_group_size: ClassVar[int] = 2

    def default_group_size(self, nodes: int) -> int:
        """Nodes per group when the user gives none (all of them, up to 4)."""
        return min(max(nodes, 2), 4)

    def tolerance(self, group_size: int) -> int:
        """How many lost members of a group of that size are always rebuilt."""
        return 0

    def inline_copies(self, layout: SnapshotLayout, node: int) -> list[int]:
        """Nodes whose pieces `node` keeps copies of among its own pieces (placed in order)."""
        return []

    def extra_bytes(self, layout: SnapshotLayout, node: int) -> int:
        """Bytes of `node`'s redundancy area, after its pieces part."""
        return 0

    def needs(self, layout: SnapshotLayout, node: int) -> list[Need]:
        """What `node` fetches from other nodes' pieces to fill its redundancy bytes."""
        return [(p, 0, p.nbytes, off, False) for p, off in layout.copies_at(node)]

    def decodable(self, layout: SnapshotLayout, lost: int, present: Collection[int]) -> bool:
        """Whether `lost` can be rebuilt from the nodes in `present`."""
        return False

    def decode_ranges(
        self, layout: SnapshotLayout, lost: int, present: Collection[int]
    ) -> list[tuple[int, int, int]]:
        """(node, offset, nbytes) of every byte range `decode` reads to rebuild `lost` from the
        nodes in `present` (none of them lost)."""
        return []

    def decode(self, layout: SnapshotLayout, lost: int, blobs: Mapping[int, Any]) -> np.ndarray:
        """The pieces part of `lost` (`layout.primary[lost]` bytes), from the others' blobs.

        `blobs[node].view(offset, nbytes)` reads a present node's bytes; `blobs` holds the
        present members of `lost`'s group (and no lost one).

        Raises:
            ParityMismatch: the rebuilt bytes do not match what the peers kept of them.
        """
        raise ValueError(f"node {lost} is lost and the snapshot has no redundancy")

    def decode_all(
        self, layout: SnapshotLayout, lost: Sequence[int], blobs: Mapping[int, Any]
    ) -> dict[int, np.ndarray]:
        """The pieces parts of several lost members of one group (what `decode` gives each)."""
        return {n: self.decode(layout, n, blobs) for n in lost}

    def part_ranges(
        self, layout: SnapshotLayout, lost: int, present: Collection[int], want: Wanted
    ) -> list[tuple[int, int, int]]:
        """What `decode_parts` reads (as `decode_ranges`) to rebuild `want[lost]` of `lost`
        (default: what rebuilding the whole node reads)."""
        return self.decode_ranges(layout, lost, present)

    def decode_parts(
        self, layout: SnapshotLayout, lost: Sequence[int], blobs: Mapping[int, Any], want: Wanted
    ) -> dict[int, np.ndarray]:
        """`decode_all`, of which only the ranges `want[n]` of each lost node n are to be read
        (default: the whole nodes, `decode_all`). A scheme may leave other bytes zero.

        Raises:
            ParityMismatch: the rebuilt bytes do not match what the peers kept of them.
        """
        return self.decode_all(layout, lost, blobs)

    def share_units(
        self, layout: SnapshotLayout, lost: Sequence[int], present: Collection[int], want: Wanted
    ) -> list[Any]:
        """The units (JSON values) of `decode_parts(layout, lost, ..., want)` that processes which
        need the same lost nodes may split between them (`share`: each solves share i of n of
        every unit they need, then all read and check the result); [] (the default): the scheme
        cannot share a rebuild. Only a scheme with digests (`check_parts`) may share one: every
        process checks what its peers rebuilt."""
        return []

    def decode_share(
        self,
        layout: SnapshotLayout,
        lost: Sequence[int],
        blobs: Mapping[int, Any],
        parts: Sequence[tuple[Any, int, int]],
        out: Mapping[int, np.ndarray],
    ) -> None:
        """Rebuild share i of n of each unit u, (u, i, n) in `parts`, into `out` (lost node ->
        its writable pieces part), unchecked."""
        raise NotImplementedError(f"{self.name or 'no redundancy'} does not share a rebuild")

    def check_parts(
        self,
        layout: SnapshotLayout,
        lost: Sequence[int],
        blobs: Mapping[int, Any],
        want: Wanted,
        out: Mapping[int, np.ndarray],
    ) -> None:
        """Check what `decode_parts` rebuilds, as found in `out`, against the peers' digests.

        Raises:
            ParityMismatch: it does not match.
        """
        raise NotImplementedError(f"{self.name or 'no redundancy'} does not share a rebuild")

    def digest_sources(self, layout: SnapshotLayout, node: int) -> list[int]:
        """Nodes whose `digest` `node` keeps (none: no digests are exchanged)."""
        return []

    def digest(self, layout: SnapshotLayout, node: int, blob: np.ndarray) -> Any:
        """A digest (JSON) of `node`'s own bytes in its filled blob, for the peers to keep."""
        return None

    def keep_digests(
        self, layout: SnapshotLayout, node: int, blob: np.ndarray, digests: Mapping[int, Any]
    ) -> None:
        """Write what `node` keeps of its sources' digests into its blob (before it commits)."""

    def extra_sources(self, layout: SnapshotLayout, node: int) -> list[int]:
        """Nodes whose serialised `extra` `node` keeps redundancy for."""
        return []

    def keep_extras(self, layout: SnapshotLayout, node: int, raws: Mapping[int, bytes]) -> Any:
        """What `node` keeps of the extras of `extra_sources` (`raws`: node -> bytes), as JSON."""
        return None

    def rebuild_extra(
        self, layout: SnapshotLayout, lost: int, kept: Mapping[int, Any], raws: Mapping[int, bytes]
    ) -> bytes | None:
        """The serialised extra of `lost`, from what the present nodes keep (`kept`, node ->
        `keep_extras` record) and their own extras (`raws`); None when it cannot be rebuilt."""
        return None
