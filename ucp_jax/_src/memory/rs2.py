"""`rs2`: two parities per group, P (XOR) and Q (Reed–Solomon over GF(2^8)); any two lost members
of a group are rebuilt, bit-exact.

In a group of k nodes (positions 0..k-1) there are k *stripes*. Stripe s keeps its P on the
member at position s and its Q on the member at position s+1 (mod k); its data are one lane of
each of the other k-2 members. Each member's pieces part is cut into k-2 lanes of C bytes (C: the
group's largest pieces part / (k-2), rounded up to 512 bytes; the last lanes may be short or
empty, read as zeros), one per stripe it is a data member of, in stripe order. A member's
redundancy area is

    [P of its stripe (C) | Q of the previous stripe (C) | digest table]

- P = the XOR of the stripe's data lanes, Q = sum c_i * lane_i, c_i the coefficient of member i's
  place among the stripe's data members (`gf256.COEFFS`: the cheapest first; 1 for the first,
  so its share of Q is a plain XOR). Q is computed in bit-sliced form
  (`gf256.segments`), so both parities are XORs of byte ranges of other nodes' pieces, and the
  engine fills them exactly as it fills `xor`'s lane (device copies or rolls, then XOR on the
  host).
- The digest table: the CRC-32s of the data lanes of the two stripes, as their owners computed
  them from their own filled blobs (exchanged through the coordination
  service before the snapshot commits). A rebuilt lane that does not match raises
  `ParityMismatch`: a stale or damaged parity never gives wrong values.

Memory: 2C per node, 2/(k-2) of a snapshot (k=4: 100%, k=6: 50%, k=8: 33%), against 1/(k-1) for
`xor`. A group of two keeps P only (each member the other's copy) and survives one loss.

Rebuild, per stripe with lost data lanes:
- one lost lane u: P ^ the other lanes; or, when P's holder is lost too, (Q ^ sum c_i D_i) / c_u;
- two lost lanes u, v: P' = P ^ sum D_i, Q' = Q ^ sum c_i D_i over the others;
  D_u = (Q' ^ c_v P') / (c_u ^ c_v), D_v = P' ^ D_u.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from .gf256 import (
    COEFFS,
    ginv,
    mul_rows,
    mul_xor_rows,
    or_new,
    put_rows,
    rows_into,
    rows_of,
    segments,
)
from .rs2_extra import RS2Extras
from .scheme_base import (
    Need,
    ParityMismatch,
    RedundancyScheme,
    SnapshotLayout,
    Wanted,
    align,
)
from .shm import blob_crc

LANE_ALIGN = 512  # C / 8 (a packet) is a multiple of 64 bytes
_MAGIC = int.from_bytes(b"ucp-rs2\x01", "little")
# Columns of the 8 packets solved at a time in a rebuild (8 x 256 KiB of each lane read and
# written while in cache). benchmarks/rs2_encode.py --engine --solve-cols 32 128 256 512 (k = 4
# and 8, load 4-5): 256 KiB within 10% of the fastest in every case; 32 KiB 1.4-2x slower (the
# numpy calls per block), 512 KiB 1.4x slower at k = 8.
SOLVE_COLS = 256 << 10


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The threads that solve and check lanes (one per core; numpy and zlib-ng release the GIL):
    kept, since starting threads for every rebuild costs milliseconds on a busy machine."""
    return ThreadPoolExecutor(max(1, os.cpu_count() or 1), thread_name_prefix="ucp-rs2")


if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads
    os.register_at_fork(after_in_child=_pool.cache_clear)


class RS2(RS2Extras, RedundancyScheme):
    """Two parities per group (P = XOR, Q = Reed–Solomon): any two lost members are rebuilt."""

    name = "rs2"
    min_group_size = 3

    def default_group_size(self, nodes: int) -> int:
        return min(max(nodes, 2), 6)

    def tolerance(self, group_size: int) -> int:
        return min(2, group_size - 1)

    # ---------------------------------------------------------------------------- geometry

    @staticmethod
    def _group(layout: SnapshotLayout, node: int) -> tuple[list[int], int, int]:
        """(group, k, m): the node's group, its size, and its parities per stripe."""
        g = list(layout.group_of[node])
        if len(g) > len(COEFFS):
            raise ValueError(f"rs2: a group of {len(g)} nodes; at most {len(COEFFS)}")
        return g, len(g), min(2, len(g) - 1)

    def holders(self, layout: SnapshotLayout, g: Sequence[int], s: int) -> list[int]:
        """The members keeping stripe s's parities: [P's, Q's]."""
        k = len(g)
        return [g[(s + w) % k] for w in range(min(2, k - 1))]

    def data_of(self, layout: SnapshotLayout, g: Sequence[int], s: int) -> list[int]:
        """The members with a data lane in stripe s, in group order."""
        h = self.holders(layout, g, s)
        return [n for n in g if n not in h]

    def stripes_of(self, layout: SnapshotLayout, node: int) -> list[int]:
        """The stripes `node` has a data lane in, in order (its lanes, in blob order)."""
        g, k, _ = self._group(layout, node)
        return [s for s in range(k) if node not in self.holders(layout, g, s)]

    def lane_bytes(self, layout: SnapshotLayout, node: int) -> int:
        """C: the bytes of each lane (and parity) in `node`'s group."""
        g, k, m = self._group(layout, node)
        return align(-(-max(layout.primary[n] for n in g) // (k - m)), LANE_ALIGN)

    def lane(self, layout: SnapshotLayout, node: int, s: int) -> tuple[int, int]:
        """Bytes [start, stop) of `node`'s pieces part that are its lane of stripe s."""
        c = self.lane_bytes(layout, node)
        a = self.stripes_of(layout, node).index(s) * c
        return a, max(a, min(a + c, layout.primary[node]))

    def parity_at(
        self, layout: SnapshotLayout, g: Sequence[int], s: int, w: int
    ) -> tuple[int, int]:
        """(holder, blob offset) of stripe s's parity w (0: P, 1: Q)."""
        h = self.holders(layout, g, s)[w]
        return h, layout.primary[h] + w * self.lane_bytes(layout, h)

    def table_at(self, layout: SnapshotLayout, node: int) -> tuple[int, int]:
        """(offset, nbytes) of `node`'s digest table."""
        _, k, m = self._group(layout, node)
        return layout.primary[node] + m * self.lane_bytes(layout, node), align(8 * (1 + m * k))

    def stripe_coef(self, layout: SnapshotLayout, g: Sequence[int], s: int, n: int) -> int:
        """The Q coefficient of data member n in stripe s: by its place among the stripe's k-2
        data members, so every stripe takes the k-2 cheapest (1 is a plain XOR, 2 costs 11/8)."""
        return COEFFS[self.data_of(layout, g, s).index(n)]

    def extra_bytes(self, layout: SnapshotLayout, node: int) -> int:
        if len(layout.group_of[node]) < 2:
            return 0
        _, m = self._group(layout, node)[1:]
        return m * self.lane_bytes(layout, node) + self.table_at(layout, node)[1]

    # ------------------------------------------------------------------------------ encode

    def needs(self, layout: SnapshotLayout, node: int) -> list[Need]:
        g, k, m = self._group(layout, node)
        if k < 2:
            return []
        j, c_len = g.index(node), self.lane_bytes(layout, node)
        out: list[Need] = []
        for w in range(m):  # P of stripe j, Q of stripe j - 1
            s = (j - w) % k
            base = layout.primary[node] + w * c_len
            for i in self.data_of(layout, g, s):
                a, b = self.lane(layout, i, s)
                for p in layout.by_node[i]:
                    lo, hi = max(a, p.offset), min(b, p.offset + p.nbytes)
                    if lo >= hi:
                        continue
                    if w == 0:
                        out.append((p, lo - p.offset, hi - p.offset, base + lo - a, True))
                        continue
                    c = self.stripe_coef(layout, g, s, i)
                    for x, y, d in segments(c, c_len // 8, lo - a, hi - a):
                        out.append((p, x + a - p.offset, y + a - p.offset, base + d, True))
        return out

    # ------------------------------------------------------------------------------ decode

    def decodable(self, layout: SnapshotLayout, lost: int, present: Collection[int]) -> bool:
        g = layout.group_of[lost]
        return sum(n not in present for n in g) <= self.tolerance(len(g))

    def _plan(
        self,
        layout: SnapshotLayout,
        g: Sequence[int],
        missing: Collection[int],
        want: Wanted | None = None,
    ) -> list[tuple[int, list[int], list[int]]]:
        """Per stripe with lost data lanes: (stripe, its lost data members, parities used); with
        `want`, only the stripes with a lost lane that overlaps a wanted range."""
        out = []
        for s in range(len(g)):
            gone = [n for n in self.data_of(layout, g, s) if n in missing]
            if not gone:
                continue
            alive = [w for w, h in enumerate(self.holders(layout, g, s)) if h not in missing]
            if len(alive) < len(gone):
                raise ValueError(
                    f"rs2: node(s) {sorted(missing)} of group {list(g)} are lost; it rebuilds at "
                    f"most {self.tolerance(len(g))} lost member(s) of a group"
                )
            if want is None or any(self._overlaps(layout, n, s, want) for n in gone):
                out.append((s, gone, alive[: len(gone)]))
        return out

    def _overlaps(self, layout: SnapshotLayout, n: int, s: int, want: Wanted) -> bool:
        a, b = self.lane(layout, n, s)
        return any(off < b and a < off + nb for off, nb in want.get(n, ()) if nb > 0)

    def decode_ranges(
        self, layout: SnapshotLayout, lost: int, present: Collection[int]
    ) -> list[tuple[int, int, int]]:
        return self._ranges(layout, lost, present, None)

    def part_ranges(
        self, layout: SnapshotLayout, lost: int, present: Collection[int], want: Wanted
    ) -> list[tuple[int, int, int]]:
        return self._ranges(layout, lost, present, want)

    def _ranges(
        self, layout: SnapshotLayout, lost: int, present: Collection[int], want: Wanted | None
    ) -> list[tuple[int, int, int]]:
        g, _, _ = self._group(layout, lost)
        missing = [n for n in g if n not in present]
        c_len = self.lane_bytes(layout, lost)
        out = []
        for s, gone, use in self._plan(layout, g, missing, want):
            if lost not in gone:
                continue
            for i in self.data_of(layout, g, s):
                a, b = self.lane(layout, i, s)
                if i not in missing and b > a:
                    out.append((i, a, b - a))
            for w in use:
                out.append((*self.parity_at(layout, g, s, w), c_len))
            h = self.parity_at(layout, g, s, use[0])[0]
            out.append((h, *self.table_at(layout, h)))
        return out

    def decode(self, layout: SnapshotLayout, lost: int, blobs: Mapping[int, Any]) -> np.ndarray:
        return self.decode_all(layout, [lost], blobs)[lost]

    def decode_all(
        self, layout: SnapshotLayout, lost: Sequence[int], blobs: Mapping[int, Any]
    ) -> dict[int, np.ndarray]:
        return self._decode(layout, lost, blobs, None)

    def decode_parts(
        self, layout: SnapshotLayout, lost: Sequence[int], blobs: Mapping[int, Any], want: Wanted
    ) -> dict[int, np.ndarray]:
        """Only the lanes that hold wanted bytes are rebuilt (and checked); the others stay 0."""
        return self._decode(layout, lost, blobs, want)

    def _decode(
        self,
        layout: SnapshotLayout,
        lost: Sequence[int],
        blobs: Mapping[int, Any],
        want: Wanted | None,
    ) -> dict[int, np.ndarray]:
        """Every stripe with lost (wanted) lanes is solved in column blocks of `SOLVE_COLS`
        (each block of the 8 packets of every lane it reads stays in cache), the blocks in
        threads (numpy releases the GIL); then each rebuilt lane is checked against its digest
        (CRC-32, zlib-ng's: also in threads)."""
        g, _, _ = self._group(layout, lost[0])
        missing = [n for n in g if n not in blobs]
        out = {n: np.zeros(layout.primary[n], np.uint8) for n in missing}
        plan = self._plan(layout, g, missing, want)
        self._run(layout, g, missing, blobs, out, self._tasks(layout, g, [(p, 0, 1) for p in plan]))
        self._run(layout, g, missing, blobs, out, [], [(p, n) for p in plan for n in p[1]])
        return {n: out[n] for n in lost}

    def _tasks(
        self, layout: SnapshotLayout, g: list[int], parts: list[tuple[Any, int, int]]
    ) -> list[Any]:
        """Column blocks of `SOLVE_COLS` of share i of n of each planned stripe's columns
        ((plan entry, i, n) in `parts`; shares of whole 64-byte words)."""
        w = self.lane_bytes(layout, g[0]) // 8
        tasks = []
        for p, i, n in parts:
            step = align(-(-w // n), 64)
            a, b = min(w, i * step), min(w, (i + 1) * step)
            tasks += [(p, u, min(u + SOLVE_COLS, b)) for u in range(a, b, SOLVE_COLS)]
        return tasks

    def _run(
        self,
        layout: SnapshotLayout,
        g: list[int],
        missing: list[int],
        blobs: Mapping[int, Any],
        out: dict[int, np.ndarray],
        tasks: list[Any],
        checks: Sequence[Any] = (),
    ) -> None:
        """Solve `tasks` (`_solve`), or check lanes (`_check`), in threads."""
        jobs = [(self._solve, t) for t in tasks] + [(self._check, c) for c in checks]
        if not jobs:
            return
        futures = [_pool().submit(fn, layout, g, missing, t, blobs, out) for fn, t in jobs]
        wait(futures)  # all of them, before any error is raised (they write into `out`)
        for f in futures:
            f.result()  # (a ParityMismatch of any lane raises here)

    # ------------------------------------------------------------- a rebuild shared (`share`)

    def share_units(
        self, layout: SnapshotLayout, lost: Sequence[int], present: Collection[int], want: Wanted
    ) -> list[Any]:
        """The stripes `decode_parts` solves: a shared rebuild splits each one's columns."""
        g, _, _ = self._group(layout, lost[0])
        return [p[0] for p in self._plan(layout, g, [n for n in g if n not in present], want)]

    def decode_share(
        self,
        layout: SnapshotLayout,
        lost: Sequence[int],
        blobs: Mapping[int, Any],
        parts: Sequence[tuple[Any, int, int]],
        out: Mapping[int, np.ndarray],
    ) -> None:
        """Solve share i of n of the columns of each stripe s, (s, i, n) in `parts`, into `out`
        (lost node -> its pieces part, writable), unchecked: `check_parts` checks them."""
        g, _, _ = self._group(layout, lost[0])
        missing = [n for n in g if n not in blobs]
        plan = {p[0]: p for p in self._plan(layout, g, missing)}
        tasks = self._tasks(layout, g, [(plan[s], i, n) for s, i, n in parts])
        self._run(layout, g, missing, blobs, dict(out), tasks)

    def check_parts(
        self,
        layout: SnapshotLayout,
        lost: Sequence[int],
        blobs: Mapping[int, Any],
        want: Wanted,
        out: Mapping[int, np.ndarray],
    ) -> None:
        """Check the lanes `decode_parts` would rebuild, as found in `out`, against their digests.

        Raises:
            ParityMismatch: a lane does not match (a stale or damaged parity, or wrong bytes).
        """
        g, _, _ = self._group(layout, lost[0])
        missing = [n for n in g if n not in blobs]
        checks = [(p, n) for p in self._plan(layout, g, missing, want) for n in p[1]]
        self._run(layout, g, missing, blobs, dict(out), [], checks)

    def _solve(
        self,
        layout: SnapshotLayout,
        g: list[int],
        missing: list[int],
        task: tuple[tuple[int, list[int], list[int]], int, int],
        blobs: Mapping[int, Any],
        out: dict[int, np.ndarray],
    ) -> None:
        """Rebuild columns [u, v) of the 8 packets of stripe s's lost data lanes (`gone`) from
        the parities `use` (as (8, columns) arrays of uint64 words), into `out`."""
        (s, gone, use), u, v = task
        c_len = self.lane_bytes(layout, g[0])
        shape = (8, (v - u) // 8)
        # Rebuilt columns go straight into the lost lanes (a short lane: through a buffer).
        dests = [rows_into(out[n][slice(*self.lane(layout, n, s))], c_len, u, v) for n in gone]
        data = []  # the surviving data lanes' columns
        for i in self.data_of(layout, g, s):
            a, b = self.lane(layout, i, s)
            if i not in missing and b > a:
                data.append((rows_of(blobs[i].view(a, b - a), c_len, u, v), i))
        acc = []
        for t, w in enumerate(use):  # P' = P ^ sum D_i, Q' = Q ^ sum c_i D_i over the others
            into = dests[-1] if t == 0 and (len(gone) == 2 or use == [0]) else None
            x = np.empty(shape, np.uint64) if into is None else into
            h, off = self.parity_at(layout, g, s, w)
            par = rows_of(blobs[h].view(off, c_len), c_len, u, v)
            coefs = [1 if w == 0 else self.stripe_coef(layout, g, s, i) for _, i in data]
            first = next((j for j, c in enumerate(coefs) if c == 1), None)
            if first is None:
                np.copyto(x, par)
            else:
                np.bitwise_xor(par, data[first][0], out=x)
            for j, (d, _) in enumerate(data):
                if j != first:
                    mul_xor_rows(x, d, coefs[j])
            acc.append(x)
        if len(gone) == 1:
            cu = self.stripe_coef(layout, g, s, gone[0])
            lanes = [acc[0] if use == [0] else mul_rows(acc[0], ginv(cu), or_new(dests[0], shape))]
        else:  # P' = D_u ^ D_v, Q' = c_u D_u ^ c_v D_v: D_u = (Q' ^ c_v P') / (c_u ^ c_v)
            cu, cv = (self.stripe_coef(layout, g, s, n) for n in gone)
            mul_xor_rows(acc[1], acc[0], cv)
            du = mul_rows(acc[1], ginv(cu ^ cv), or_new(dests[0], shape))
            np.bitwise_xor(acc[0], du, out=acc[0])  # D_v
            lanes = [du, acc[0]]
        for n, d, into in zip(gone, lanes, dests):
            if into is None:
                put_rows(out[n][slice(*self.lane(layout, n, s))], c_len, u, v, d)

    def _check(
        self,
        layout: SnapshotLayout,
        g: list[int],
        missing: list[int],
        check: tuple[tuple[int, list[int], list[int]], int],
        blobs: Mapping[int, Any],
        out: dict[int, np.ndarray],
    ) -> None:
        """Check node n's rebuilt lane of stripe s against the digest a parity holder kept."""
        (s, _, use), n = check
        h = self.parity_at(layout, g, s, use[0])[0]
        table = self._table(layout, h, blobs[h])
        a, b = self.lane(layout, n, s)
        want = int(table[1 + use[0] * len(g) + g.index(n)])
        got = blob_crc(out[n][a:b])
        if got != want:
            raise ParityMismatch(
                f"rs2: node {n}'s lane of stripe {s}, rebuilt from the parities of node(s) "
                f"{[self.holders(layout, g, s)[w] for w in use]} with node(s) "
                f"{sorted(missing)} of group {g} lost, does not match the digest node {h} "
                f"kept of it (CRC-32 {got:#010x} != {want:#010x}): a parity or a surviving "
                "member's bytes are stale or damaged"
            )

    def _table(self, layout: SnapshotLayout, h: int, blob: Any) -> np.ndarray:
        off, nbytes = self.table_at(layout, h)
        table = np.frombuffer(np.array(blob.view(off, nbytes)).tobytes(), np.uint64)
        if int(table[0]) != _MAGIC:
            raise ParityMismatch(
                f"rs2: node {h} kept no digest table (its snapshot was committed without one): "
                "its parities cannot be checked"
            )
        return table

    # ------------------------------------------------------------------------------ digests

    def digest_sources(self, layout: SnapshotLayout, node: int) -> list[int]:
        return [n for n in layout.group_of[node] if n != node]

    def digest(self, layout: SnapshotLayout, node: int, blob: np.ndarray) -> Any:
        """The CRC-32s of `node`'s data lanes, in stripe order.

        A rebuild from a damaged parity spreads an error over the bytes of a lane (bit-sliced
        symbols), in patterns that can cancel in a sum of words; CRC-32 catches every error of
        one or two bits in a lane (under 512 MiB) and any other but about one in 2^32.
        """
        if len(layout.group_of[node]) < 2:
            return None
        return [blob_crc(blob[a:b]) for a, b in
                (self.lane(layout, node, s) for s in self.stripes_of(layout, node))]  # fmt: skip

    def keep_digests(
        self, layout: SnapshotLayout, node: int, blob: np.ndarray, digests: Mapping[int, Any]
    ) -> None:
        g, k, m = self._group(layout, node)
        if k < 2:
            return
        off, nbytes = self.table_at(layout, node)
        table = np.zeros(nbytes // 8, np.uint64)
        table[0] = _MAGIC
        j = g.index(node)
        for w in range(m):
            s = (j - w) % k
            for i in self.data_of(layout, g, s):
                table[1 + w * k + g.index(i)] = int(digests[i][self.stripes_of(layout, i).index(s)])
        blob[off : off + nbytes] = table.view(np.uint8)
