"""How to compute rs2's Q parity: the candidates measured against memcpy, on this machine.

Encodes one stripe (P = XOR and Q = sum c_i D_i over GF(2^8)) of `--lanes` data lanes of `--mib`
MiB each, and reports bytes of data encoded per second, against numpy's memcpy of the same bytes
in the same run (best of `--repeats`):

- `bit-sliced XORs (ucp_jax)`: what rs2 does (`memory/gf256.py`): Q as XORs of byte ranges, lane
  by lane in any order, exactly as the engine fills a parity from other nodes' pieces;
- `numpy SWAR Horner`: byte-wise Q by Horner's rule, multiply-by-2 as shift and conditional XOR
  on uint64 words, in 64 KiB chunks (all lanes at hand, in order);
- `numpy table lookup`: byte-wise Q, `dst ^= MUL[c][src]` (a 256-entry table per coefficient);
- `JAX jit Horner`: the same Horner rule fused by XLA (CPU), the lanes copied in and P, Q out
  (the device-resident time, without the copies, is shown too);
- with `--engine`: the snapshot engine's own fill of one node's blob for none, xor and rs2 (a
  simulated job of k nodes), and rebuilds of one and two lost nodes, against memcpy;
- libraries, where installed: pyeclib with ISA-L (`isa_l_rs_vand`, whose m=2 parities are exactly
  RAID-6's P and byte-wise Q), zfec (its own Vandermonde code), galois (GF(2^8) arrays).

Usage::

    python benchmarks/rs2_encode.py --lanes 2 --mib 8     # a group of 4
    python benchmarks/rs2_encode.py --lanes 6 --mib 8     # a group of 8
    python benchmarks/rs2_encode.py --engine              # + the engine's fill and rebuild
    pip install pyeclib zfec galois  # to measure the libraries too
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

_SPEC = importlib.util.spec_from_file_location(
    "gf256", Path(__file__).resolve().parents[1] / "ucp_jax" / "_src" / "memory" / "gf256.py"
)
gf = importlib.util.module_from_spec(_SPEC)  # type: ignore[arg-type]
_SPEC.loader.exec_module(gf)  # type: ignore[union-attr]  # (numpy only: any environment)


def best(fs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The best time of each, measured in interleaved rounds (a busy machine slows all alike)."""
    out = {}
    for name, f in fs.items():
        f()  # warm up: compile, fault pages
        out[name] = float("inf")
    for _ in range(repeats):
        for name, f in fs.items():
            t0 = time.perf_counter()
            f()
            out[name] = min(out[name], time.perf_counter() - t0)
    return out


def candidates(lanes: np.ndarray) -> dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]]:
    nd, n = lanes.shape
    p, q = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    out: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = {}

    def memcpy() -> tuple[np.ndarray, np.ndarray]:
        np.copyto(dst, lanes)
        return p, q

    dst = np.empty_like(lanes)
    out["memcpy (the same bytes)"] = memcpy

    def xor_p() -> None:
        p[:] = 0
        for i in range(nd):
            gf.xor_into(p, lanes[i])

    def p_only() -> tuple[np.ndarray, np.ndarray]:
        xor_p()
        return p, q

    out["P only (XOR, as xor does)"] = p_only

    def bitsliced() -> tuple[np.ndarray, np.ndarray]:
        xor_p()
        q[:] = 0
        for i in range(nd):
            gf.mul_xor(q, lanes[i], gf.COEFFS[i])
        return p, q

    out["bit-sliced XORs (ucp_jax rs2)"] = bitsliced

    m7, m1, g = np.uint64(0x7F7F7F7F7F7F7F7F), np.uint64(0x0101010101010101), np.uint64(0x1D)
    words = [lane.view(np.uint64) for lane in lanes]

    def swar() -> tuple[np.ndarray, np.ndarray]:
        p64, q64 = p.view(np.uint64), q.view(np.uint64)
        step = 8192
        t1, t2 = np.empty(step, np.uint64), np.empty(step, np.uint64)
        for a in range(0, len(p64), step):
            b = min(a + step, len(p64))
            pp, qq, u, v = p64[a:b], q64[a:b], t1[: b - a], t2[: b - a]
            pp[:] = qq[:] = words[nd - 1][a:b]
            for i in range(nd - 2, -1, -1):  # Q = Q * 2 ^ D_i
                np.right_shift(qq, np.uint64(7), out=u)
                np.bitwise_and(u, m1, out=u)
                np.multiply(u, g, out=u)
                np.bitwise_and(qq, m7, out=v)
                np.left_shift(v, np.uint64(1), out=v)
                np.bitwise_xor(u, v, out=qq)
                np.bitwise_xor(qq, words[i][a:b], out=qq)
                np.bitwise_xor(pp, words[i][a:b], out=pp)
        return p, q

    out["numpy SWAR Horner (byte-wise)"] = swar
    table = np.array([[gf.gmul(a, c) for a in range(256)] for c in range(256)], np.uint8)
    pow2 = [1]  # Horner's coefficients: 2^i
    for _ in range(nd):
        pow2.append(gf.gmul(pow2[-1], 2))

    def lookup() -> tuple[np.ndarray, np.ndarray]:
        xor_p()
        q[:] = lanes[0]
        for i in range(1, nd):
            np.bitwise_xor(q, table[pow2[i]][lanes[i]], out=q)
        return p, q

    out["numpy table lookup (byte-wise)"] = lookup
    try:
        import jax
        import jax.numpy as jnp

        @jax.jit
        def horner(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            pj = qj = x[-1]
            for i in range(x.shape[0] - 2, -1, -1):
                qj = ((qj & 0x7F7F7F7F) << 1) ^ (((qj >> 7) & 0x01010101) * 0x1D) ^ x[i]
                pj = pj ^ x[i]
            return pj, qj

        l32 = lanes.view(np.uint32)

        def jaxed() -> tuple[np.ndarray, np.ndarray]:
            pj, qj = horner(jnp.asarray(l32))
            p.view(np.uint32)[:] = np.asarray(pj)
            q.view(np.uint32)[:] = np.asarray(qj)
            return p, q

        resident = jnp.asarray(l32)
        out["JAX jit Horner (byte-wise, host copies)"] = jaxed
        out["JAX jit Horner (device-resident, no copies)"] = lambda: jax.block_until_ready(
            horner(resident)
        )
    except ImportError:
        pass
    try:
        from pyeclib.ec_iface import ECDriver

        drv = ECDriver(k=nd, m=2, ec_type="isa_l_rs_vand")

        def pyeclib() -> tuple[np.ndarray, np.ndarray]:
            frags = drv.encode(lanes.tobytes())
            hdr = len(frags[0]) - n
            p[:] = np.frombuffer(frags[nd], np.uint8, offset=hdr)
            q[:] = np.frombuffer(frags[nd + 1], np.uint8, offset=hdr)
            return p, q

        out["pyeclib isa_l_rs_vand (byte-wise)"] = pyeclib
    except ImportError:
        pass
    try:
        import zfec

        enc = zfec.Encoder(nd, nd + 2)

        def zfec_() -> tuple[np.ndarray, np.ndarray]:
            a, b = enc.encode([lane.tobytes() for lane in lanes], [nd, nd + 1])
            p[:], q[:] = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
            return p, q

        out["zfec (its own code)"] = zfec_
    except ImportError:
        pass
    try:
        import galois

        field = galois.GF(2**8)
        gl = [field(lane) for lane in lanes]

        def galois_() -> tuple[np.ndarray, np.ndarray]:
            xor_p()
            acc = gl[0].copy()
            for i in range(1, nd):
                acc += gl[i] * field(pow2[i])
            q[:] = acc.view(np.ndarray)
            return p, q

        out["galois (byte-wise)"] = galois_
    except ImportError:
        pass
    return out


def engine(k: int, mib: float, repeats: int) -> list[str]:
    """The engine's own fill of one node's blob (none, xor, rs2) and rebuilds, in one process.

    A job of k nodes x 2 fake devices with one leaf sharded over all devices (each node's share
    `mib` MiB); node 0's blob is filled from numpy copies of its fetches' regions exactly as the
    snapshot engine fills it, best of `repeats` interleaved; then rs2 (and xor) rebuild one and
    two lost nodes from the others' blobs.
    """
    import dataclasses

    from ucp_jax._src.memory.layout import LeafMeta, SnapshotLayout, build_pieces, make_groups
    from ucp_jax._src.memory.redundancy import Sources, decode_nodes, fill, plan_fetches
    from ucp_jax._src.memory.schemes import scheme_for

    @dataclasses.dataclass(frozen=True)
    class Dev:
        id: int
        process_index: int

    devs = [Dev(i, i // 2) for i in range(2 * k)]
    rows = max(1, int(mib * 2**20) // (2 * 4096 * 4))  # float32 rows of 4096 per device
    arr = np.random.default_rng(0).standard_normal((rows * 2 * k, 4096)).astype(np.float32)
    boxes = {d: ((rows * d.id, rows * (d.id + 1)), (0, 4096)) for d in devs}
    meta = [LeafMeta("w", arr.shape, arr.dtype, "param")]
    regions = [[(boxes[d], d.process_index) for d in devs]]
    writers = {(0, boxes[d], d.process_index): (d, boxes[d]) for d in devs}
    jobs, blobs = {}, {}
    for name in ("none", "xor", "rs2"):
        red = None if name == "none" else name
        lay = SnapshotLayout(meta, k, make_groups(k, k, 3 if red == "rs2" else 2), red,
                             build_pieces(meta, regions, k))  # fmt: skip
        per = []
        for n in range(k):
            f, _ = plan_fetches(lay, Sources([boxes], writers), devs, n)
            datas = [np.ascontiguousarray(arr[tuple(slice(a, b) for a, b in x.box)]) for x in f]
            per.append((f, datas))
        jobs[name] = (lay, per)
        blobs[name] = {n: np.zeros(lay.size(n), np.uint8) for n in range(k)}
        for n, (f, datas) in enumerate(per):
            fill(blobs[name][n], lay, n, f, lay.gaps(n), list(datas))
    rs2 = scheme_for("rs2")
    lay = jobs["rs2"][0]
    digests = {n: rs2.digest(lay, n, blobs["rs2"][n]) for n in range(k)}
    for n in range(k):
        rs2.keep_digests(lay, n, blobs["rs2"][n], {m: digests[m] for m in range(k) if m != n})

    class View:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def view(self, off: int, nb: int) -> np.ndarray:
            return self.a[off : off + nb]

    share = jobs["none"][0].size(0)
    src, dst = np.ones(share, np.uint8), np.zeros(share, np.uint8)
    tasks: dict[str, Callable[[], object]] = {
        "memcpy of a node's share": lambda: np.copyto(dst, src)
    }
    for name, (lay, per) in jobs.items():
        f, datas = per[0]
        scratch = np.zeros_like(blobs[name][0])  # (the sealed blobs stay for the rebuilds)
        tasks[f"fill, {name}"] = lambda lay=lay, f=f, datas=datas, b=scratch: fill(
            b, lay, 0, f, lay.gaps(0), list(datas)
        )
    for name, losses in (("xor", [[1]]), ("rs2", [[1], [1, 2]])):
        lay = jobs[name][0]
        for lost in losses:
            others = {m: View(blobs[name][m]) for m in range(k) if m not in lost}
            tasks[f"rebuild {len(lost)} lost, {name}"] = lambda lay=lay, lost=lost, others=others: (
                decode_nodes(lay, lost, others)
            )
    times = best(tasks, repeats)
    m = times["memcpy of a node's share"]
    out = [f"the engine, k = {k}: a node's share {share / 2**20:.1f} MiB; best of {repeats}",
           f"{'':30}{'bytes':>10}{'ms':>9}{'GB/s':>8}{'of memcpy':>11}{'vs xor':>8}"]  # fmt: skip
    for name, t in times.items():
        if name.startswith("fill"):
            nb = jobs[name.split(", ")[1]][0].size(0)
        elif name.startswith("rebuild"):
            nb = share * int(name.split()[1])
        else:
            nb = share
        ref = times.get(name.replace("rs2", "xor").replace("2 lost", "1 lost"), t)
        out.append(f"{name:30}{nb / 2**20:7.1f}MiB{t * 1e3:9.1f}{nb / t / 1e9:8.2f}"
                   f"{m / t * nb / share:10.0%}{t / ref:7.2f}x")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=2, help="data lanes per stripe (k - 2)")
    ap.add_argument("--mib", type=float, default=8.0, help="MiB per lane")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument(
        "--engine",
        action="store_true",
        help="also time the engine's fill of a node's blob (none, xor, rs2) and rs2's rebuilds "
        "(needs ucp_jax importable)",
    )
    args = ap.parse_args()
    n = int(args.mib * 2**20) // 512 * 512
    lanes = np.random.default_rng(0).integers(0, 256, (args.lanes, n), dtype=np.uint8)
    rows = list(best(candidates(lanes), args.repeats).items())
    base = rows[0][1]
    print(f"one stripe: {args.lanes} data lanes x {n / 2**20:.1f} MiB = {lanes.nbytes / 2**20:.0f} "
          f"MiB encoded into P and Q (best of {args.repeats})")  # fmt: skip
    print(f"{'method':46}{'ms':>9}{'GB/s':>8}{'of memcpy':>11}")
    for name, t in rows:
        print(f"{name:46}{t * 1e3:9.1f}{lanes.nbytes / t / 1e9:8.2f}{base / t:10.0%}")
    if args.engine:
        print()
        print("\n".join(engine(args.lanes + 2, args.mib * args.lanes, args.repeats)))


if __name__ == "__main__":
    main()
