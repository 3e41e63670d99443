"""`rs2`'s redundancy of each process's `extra` (a data loader's state: small serialised bytes,
exchanged through the coordination service): every member of a group keeps P and Q of the other
members' extras in its snapshot's index, and a lost member's is solved from any two lost."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .gf256 import COEFFS, ginv, mul, mul_xor, xor_into
from .scheme_base import SnapshotLayout, align


class RS2Extras:
    """The extras part of `rs2.RS2` (a mixin)."""

    def coef(self, g: Sequence[int], n: int) -> int:
        """The Q coefficient of member n of group g (for the extras: by position in the group)."""
        return COEFFS[list(g).index(n)]

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
