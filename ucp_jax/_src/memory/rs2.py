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

import base64
import os
import zlib
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .gf256 import COEFFS, ginv, mul, mul_xor, segments, xor_into
from .scheme_base import Need, ParityMismatch, RedundancyScheme, SnapshotLayout, align


def _crc(a: np.ndarray) -> int:
    """The CRC-32 of a byte range (a contiguous uint8 array)."""
    return zlib.crc32(np.ascontiguousarray(a).data)


LANE_ALIGN = 512  # C / 8 (a packet) is a multiple of 64 bytes
_MAGIC = int.from_bytes(b"ucp-rs2\x01", "little")


class RS2(RedundancyScheme):
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

    def coef(self, g: Sequence[int], n: int) -> int:
        """The Q coefficient of member n of group g (for the extras: by position in the group)."""
        return COEFFS[list(g).index(n)]

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
        self, layout: SnapshotLayout, g: Sequence[int], missing: Collection[int]
    ) -> list[tuple[int, list[int], list[int]]]:
        """Per stripe with lost data lanes: (stripe, its lost data members, parities used)."""
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
            out.append((s, gone, alive[: len(gone)]))
        return out

    def decode_ranges(
        self, layout: SnapshotLayout, lost: int, present: Collection[int]
    ) -> list[tuple[int, int, int]]:
        g, _, _ = self._group(layout, lost)
        missing = [n for n in g if n not in present]
        c_len = self.lane_bytes(layout, lost)
        out = []
        for s, gone, use in self._plan(layout, g, missing):
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
        """Every stripe with lost lanes is solved on its own, in threads (numpy's XORs and
        zlib's CRC release the GIL), each writing its lanes of the lost nodes."""
        g, _, _ = self._group(layout, lost[0])
        missing = [n for n in g if n not in blobs]
        out = {n: np.zeros(layout.primary[n], np.uint8) for n in missing}
        plan = self._plan(layout, g, missing)
        with ThreadPoolExecutor(max(1, min(len(plan), os.cpu_count() or 1))) as pool:
            for f in [pool.submit(self._solve, layout, g, missing, p, blobs, out) for p in plan]:
                f.result()  # (a ParityMismatch of any stripe raises here)
        return {n: out[n] for n in lost}

    def _solve(
        self,
        layout: SnapshotLayout,
        g: list[int],
        missing: list[int],
        plan: tuple[int, list[int], list[int]],
        blobs: Mapping[int, Any],
        out: dict[int, np.ndarray],
    ) -> None:
        """Rebuild stripe s's lost data lanes (`gone`) from the parities `use`, check each
        against the digest a parity holder kept of it, and write it into `out`."""
        s, gone, use = plan
        c_len = self.lane_bytes(layout, g[0])
        acc = [np.array(blobs[h].view(off, c_len)) for h, off in
               (self.parity_at(layout, g, s, w) for w in use)]  # fmt: skip
        for i in self.data_of(layout, g, s):
            a, b = self.lane(layout, i, s)
            if i in missing or b <= a:
                continue
            d = blobs[i].view(a, b - a)
            if b - a < c_len:  # a short last lane: zeros after it
                d = np.concatenate([d, np.zeros(c_len - (b - a), np.uint8)])
            for t, w in enumerate(use):
                mul_xor(acc[t], d, 1 if w == 0 else self.stripe_coef(layout, g, s, i))
        if len(gone) == 1:
            cu = self.stripe_coef(layout, g, s, gone[0])
            lanes = [acc[0] if use == [0] else mul(acc[0], ginv(cu))]
        else:  # P' = D_u ^ D_v, Q' = c_u D_u ^ c_v D_v
            cu, cv = (self.stripe_coef(layout, g, s, n) for n in gone)
            mul_xor(acc[1], acc[0], cv)
            du = mul(acc[1], ginv(cu ^ cv))
            xor_into(acc[0], du)
            lanes = [du, acc[0]]
        h = self.parity_at(layout, g, s, use[0])[0]
        table = self._table(layout, h, blobs[h])
        for n, d in zip(gone, lanes):
            a, b = self.lane(layout, n, s)
            want = int(table[1 + use[0] * len(g) + g.index(n)])
            got = _crc(d[: b - a])
            if got != want:
                raise ParityMismatch(
                    f"rs2: node {n}'s lane of stripe {s}, rebuilt from the parities of node(s) "
                    f"{[self.holders(layout, g, s)[w] for w in use]} with node(s) "
                    f"{sorted(missing)} of group {g} lost, does not match the digest node {h} "
                    f"kept of it (CRC-32 {got:#010x} != {want:#010x}): a parity or a surviving "
                    "member's bytes are stale or damaged"
                )
            out[n][a:b] = d[: b - a]

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
        return [_crc(blob[a:b]) for a, b in
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

    # ------------------------------------------------------------------------------- extras

    def extra_sources(self, layout: SnapshotLayout, node: int) -> list[int]:
        return [n for n in layout.group_of[node] if n != node]

    def keep_extras(self, layout: SnapshotLayout, node: int, raws: Mapping[int, bytes]) -> Any:
        """P and Q of the other members' extras (zero-padded to a multiple of 64 bytes)."""
        if not raws:
            return None
        g = layout.group_of[node]
        n = align(max(max(map(len, raws.values())), 1))
        p, q = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
        for m_, r in raws.items():
            d = np.zeros(n, np.uint8)
            d[: len(r)] = np.frombuffer(r, np.uint8)
            xor_into(p, d)
            mul_xor(q, d, self.coef(g, m_))
        return {
            "lengths": {str(m_): len(r) for m_, r in sorted(raws.items())},
            "p": base64.b64encode(p.tobytes()).decode(),
            "q": base64.b64encode(q.tobytes()).decode(),
        }

    def rebuild_extra(
        self, layout: SnapshotLayout, lost: int, kept: Mapping[int, Any], raws: Mapping[int, bytes]
    ) -> bytes | None:
        """From any present member's P and Q: one or two unknown extras among its sources."""
        g = layout.group_of[lost]
        for h in g:
            rec = kept.get(h)
            if h == lost or not isinstance(rec, dict) or str(lost) not in rec.get("lengths", {}):
                continue
            srcs = [int(x) for x in rec["lengths"]]
            gone = [x for x in srcs if x not in raws or x == lost]
            if len(gone) > 2:
                continue
            acc = [np.frombuffer(base64.b64decode(rec[f]), np.uint8).copy() for f in ("p", "q")]
            n = len(acc[0])
            for x in srcs:
                if x in gone:
                    continue
                d = np.zeros(n, np.uint8)
                d[: len(raws[x])] = np.frombuffer(raws[x], np.uint8)
                xor_into(acc[0], d)
                mul_xor(acc[1], d, self.coef(g, x))
            if len(gone) == 1:
                out = acc[0]
            else:
                other = gone[1] if gone[0] == lost else gone[0]
                mul_xor(acc[1], acc[0], self.coef(g, other))
                out = mul(acc[1], ginv(self.coef(g, lost) ^ self.coef(g, other)))
            return out[: rec["lengths"][str(lost)]].tobytes()
        return None
