"""GF(2^8) arithmetic on lanes of bytes in bit-sliced ("packet") form: nothing but XORs.

A lane of n bytes (n a multiple of 64) is read as 8 *packets* of w = n/8 bytes; bit t of packet b
is bit b of symbol t, a GF(2^8) element (polynomial 0x11d, the RAID-6 field). Multiplying every
symbol of a lane by a constant c is then a fixed 8x8 bit matrix: output packet b is the XOR of
the input packets b' for which bit b of c * x^b' is set (`columns`). Multiplying by 1 is one XOR
of the lane, by 2 (x) 11/8 of a lane, and so on (`cost`). A Reed–Solomon parity Q = sum c_i D_i
is therefore a list of plain XORs of byte ranges (`segments`), which the snapshot engine already
does for the XOR parity, in any order, and at memory speed (numpy's XOR of uint64 words); no
table lookups, no byte-wise multiplication. `benchmarks/rs2_encode.py` measures it against
byte-wise alternatives (numpy, JAX) and libraries (pyeclib/ISA-L, zfec, galois).

This is a bit-matrix code (as Jerasure's and Cauchy Reed–Solomon's): it is MDS for any two
distinct nonzero coefficients, like the byte-wise form, but its symbols are bit columns, so its
parity bytes differ from a byte-wise RAID-6 Q of the same data.

>>> gmul(0x80, 2), ginv(2), gmul(2, ginv(2))
(29, 142, 1)
>>> COEFFS[:4], [cost(c) for c in COEFFS[:4]]
((1, 2, 142, 4), [8, 11, 11, 14])
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

POLY = 0x11D  # x^8 + x^4 + x^3 + x^2 + 1


def gmul(a: int, b: int) -> int:
    """The product of two field elements."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        a <<= 1
        if a & 0x100:
            a ^= POLY
        b >>= 1
    return out


def ginv(a: int) -> int:
    """The multiplicative inverse of a nonzero element (a^254).

    Raises:
        ZeroDivisionError: a is 0.
    """
    if not a:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    out, p, e = 1, a, 254
    while e:
        if e & 1:
            out = gmul(out, p)
        p, e = gmul(p, p), e >> 1
    return out


@functools.cache
def columns(c: int) -> tuple[tuple[int, ...], ...]:
    """Per output packet b, the input packets XORed into it to multiply by `c`."""
    return tuple(tuple(s for s in range(8) if gmul(c, 1 << s) >> b & 1) for b in range(8))


def cost(c: int) -> int:
    """Packet XORs of one multiplication by `c` (8 = one XOR of the lane)."""
    return sum(map(len, columns(c)))


# Q's coefficients, one per position in a group: distinct nonzero elements, cheapest first.
COEFFS: tuple[int, ...] = tuple(sorted(range(1, 256), key=lambda c: (cost(c), c)))


def xor_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst ^= src (uint8 arrays of equal length), 8 bytes at a time where aligned."""
    n8 = (len(dst) // 8) * 8
    if n8 and dst.ctypes.data % 8 == 0 and src.ctypes.data % 8 == 0:
        d64, s64 = dst[:n8].view(np.uint64), src[:n8].view(np.uint64)
        np.bitwise_xor(d64, s64, out=d64)
        np.bitwise_xor(dst[n8:], src[n8:], out=dst[n8:])
    else:
        np.bitwise_xor(dst, src, out=dst)


def segments(c: int, w: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The XORs that add c * (bytes [lo, hi) of a lane of packet size w) into a parity lane.

    Returns (first, end, destination): XOR lane bytes [first, end) into the parity lane at
    `destination` (all in lane coordinates). Bytes outside [lo, hi) are taken as zero, so the
    ranges of a lane may be added piece by piece, in any order.
    """
    out = []
    cols = columns(c)
    for s in range(lo // w, -(-hi // w)):
        a, b = max(lo, s * w), min(hi, (s + 1) * w)
        if a >= b:
            continue
        for ob in range(8):
            if s in cols[ob]:
                out.append((a, b, ob * w + a - s * w))
    return out


def mul_xor(dst: np.ndarray, src: np.ndarray, c: int) -> None:
    """dst ^= c * src, for two lanes of equal length (a multiple of 8 bytes)."""
    if len(dst) != len(src) or len(src) % 8:
        raise ValueError(f"lanes of {len(dst)} and {len(src)} bytes (need equal, multiple of 8)")
    if c == 1:
        xor_into(dst, src)
        return
    w = len(src) // 8
    for a, b, d in segments(c, w, 0, len(src)):
        xor_into(dst[d : d + b - a], src[a:b])


@functools.cache
def program(c: int) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, ...], ...]]:
    """Multiplication by `c` with shared XORs: (temps, rows). Temp t (index 8 + t) is the XOR
    of two earlier rows (input packets 0-7, or temps); output packet b is the XOR of `rows[b]`.

    Found greedily (Paar's algorithm: the pair of inputs common to the most output packets
    becomes a temp, until no pair is shared). Multiplying by the inverses that a rebuild needs
    takes 2-3x fewer XORs than `columns`:

    >>> cost(244), sum(len(r) for r in columns(244)) - 8, len(program(244)[0]) + sum(len(r) - 1 for r in program(244)[1])
    (46, 38, 13)
    """
    rows = [set(r) for r in columns(c)]
    temps: list[tuple[int, int]] = []
    while True:
        count: dict[tuple[int, int], int] = {}
        for r in rows:
            for pair in itertools.combinations(sorted(r), 2):
                count[pair] = count.get(pair, 0) + 1
        best = max(count.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]), default=None)
        if best is None or best[1] < 2:
            break
        t = 8 + len(temps)
        temps.append(best[0])
        for r in rows:
            if best[0][0] in r and best[0][1] in r:
                r.difference_update(best[0])
                r.add(t)
    return tuple(temps), tuple(tuple(sorted(r)) for r in rows)


def _operands(src: np.ndarray, c: int) -> tuple[list[np.ndarray], tuple[tuple[int, ...], ...]]:
    """The rows of `src` and the temps of `program(c)` computed from them; the output rows."""
    temps, rows = program(c)
    ops = list(src)
    if temps:
        buf = np.empty((len(temps), *src.shape[1:]), src.dtype)
        for t, (a, b) in enumerate(temps):
            np.bitwise_xor(ops[a], ops[b], out=buf[t])
            ops.append(buf[t])
    return ops, rows


def mul_xor_rows(dst: np.ndarray, src: np.ndarray, c: int) -> None:
    """dst ^= c * src, for column blocks of lanes given as (8, n) arrays of packet rows (rows
    of equal columns of the 8 packets; any integer dtype, e.g. uint64 words)."""
    if c == 1:
        np.bitwise_xor(dst, src, out=dst)
        return
    ops, rows = _operands(src, c)
    for ob, r in enumerate(rows):
        for i in r:
            np.bitwise_xor(dst[ob], ops[i], out=dst[ob])


def mul_rows(src: np.ndarray, c: int, out: np.ndarray) -> np.ndarray:
    """c * src into `out` (not `src`), for (8, n) packet rows as `mul_xor_rows` takes."""
    if c == 1:
        np.copyto(out, src)
        return out
    ops, rows = _operands(src, c)
    for ob, r in enumerate(rows):
        if len(r) == 1:
            np.copyto(out[ob], ops[r[0]])
            continue
        np.bitwise_xor(ops[r[0]], ops[r[1]], out=out[ob])
        for i in r[2:]:
            np.bitwise_xor(out[ob], ops[i], out=out[ob])
    return out


def mul(src: np.ndarray, c: int, out: np.ndarray | None = None) -> np.ndarray:
    """c * src, into `out` (a new lane by default; not `src` itself)."""
    if len(src) % 8:
        raise ValueError(f"a lane of {len(src)} bytes (need a multiple of 8)")
    out = np.empty(len(src), np.uint8) if out is None else out
    w = len(src) // 8
    for ob, srcs in enumerate(columns(c)):  # the first input packet copied, the others XORed
        dst = out[ob * w : (ob + 1) * w]
        dst[:] = src[srcs[0] * w : (srcs[0] + 1) * w]
        for s in srcs[1:]:
            xor_into(dst, src[s * w : (s + 1) * w])
    return out


# ------------------------------------------------- columns of a lane's 8 packets, as uint64 rows


def rows_of(lane: np.ndarray, c_len: int, u: int, v: int) -> np.ndarray:
    """Columns [u, v) of the 8 packets of a lane of `c_len` bytes as (8, (v - u) / 8) uint64
    words: a view, or, for a short lane (the bytes after it read as zeros), a padded copy."""
    w = c_len // 8
    if len(lane) == c_len:
        return lane.view(np.uint64).reshape(8, w // 8)[:, u // 8 : v // 8]
    rows = np.zeros((8, (v - u) // 8), np.uint64)
    for p in range(8):
        lo, hi = p * w + u, min(p * w + v, len(lane))
        if hi > lo:
            rows[p, : (hi - lo) // 8] = lane[lo:hi].view(np.uint64)
    return rows


def rows_into(lane: np.ndarray, c_len: int, u: int, v: int) -> np.ndarray | None:
    """Columns [u, v) of a lane's packets to write into (a view; None for a short lane)."""
    return rows_of(lane, c_len, u, v) if len(lane) == c_len else None


def or_new(rows: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    """`rows`, or new words of that shape when there are none."""
    return np.empty(shape, np.uint64) if rows is None else rows


def put_rows(lane: np.ndarray, c_len: int, u: int, v: int, rows: np.ndarray) -> None:
    """Write (8, (v - u) / 8) words into columns [u, v) of a lane's packets (the part of them
    inside a short lane)."""
    w = c_len // 8
    if len(lane) == c_len:
        lane.view(np.uint64).reshape(8, w // 8)[:, u // 8 : v // 8] = rows
        return
    for p in range(8):
        lo, hi = p * w + u, min(p * w + v, len(lane))
        if hi > lo:
            lane[lo:hi].view(np.uint64)[:] = rows[p, : (hi - lo) // 8]
