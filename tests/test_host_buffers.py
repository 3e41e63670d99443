"""Host buffers on transparent huge pages: where they lie, what they hold, what they cost.

The kernel is the referee: /proc/self/smaps says which mapping holds a buffer, whether the
mapping is advised for huge pages (VmFlags `hg`), and how much of it is resident and on huge pages.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp
from ucp_jax._src.util import buffers

HUGE = buffers.HUGE_PAGE
needs_thp = pytest.mark.skipif(
    not buffers.transparent_huge_pages(), reason="the kernel offers no transparent huge pages"
)


def mappings() -> list[dict[str, object]]:
    """This process's mappings from /proc/self/smaps: start, end, VmFlags, sizes in bytes."""
    out: list[dict[str, object]] = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                out.append({"start": lo, "end": hi, "flags": []})
            elif head[0] == "VmFlags:":
                out[-1]["flags"] = head[1:]
            elif len(head) == 3 and head[2] == "kB":
                out[-1][head[0].rstrip(":")] = int(head[1]) * 1024
    return out


def over(lo: int, hi: int) -> list[dict[str, object]]:
    """The mappings that overlap [lo, hi)."""
    return [m for m in mappings() if m["start"] < hi and lo < m["end"]]


def mapping_of(address: int) -> dict[str, object]:
    """The mapping that holds `address`."""
    (m,) = over(address, address + 1)
    return m


def rss_anon() -> int:
    """Resident anonymous memory of this process, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@needs_thp
@pytest.mark.parametrize("nbytes", [HUGE, 3_936_256, 5 * HUGE + 12_345])
def test_large_buffer_on_huge_pages_nothing_past_it(nbytes: int) -> None:
    a = buffers.aligned_empty((nbytes,), np.dtype(np.uint8))
    assert a.ctypes.data % HUGE == 0 and a.flags.writeable
    before = rss_anon()
    a[...] = 7
    grew = rss_anon() - before
    m = mapping_of(a.ctypes.data)  # the advice splits the mapping: this is the advised part
    assert "hg" in m["flags"] and m["Size"] == buffers.huge_page_bytes(nbytes), m
    assert m["AnonHugePages"] == buffers.huge_page_bytes(nbytes), m
    # the part past the last whole huge page is on 4 KiB pages: nothing resident past the buffer
    # (rounded up to huge pages, the last case would grow by 12 MiB, not 10 MiB + 12 KiB)
    assert nbytes <= grew < nbytes + (1 << 20), (grew, nbytes)
    assert (a == 7).all()


@needs_thp
def test_small_buffers_of_a_leaf_share_one_mapping() -> None:
    shapes = [(496, 992)] * 8  # 1.9 MB each in f32, too small for a huge page of its own
    outs = buffers.aligned_empties(shapes, np.dtype(np.float32))
    starts = [o.ctypes.data for o in outs]
    assert all(s % buffers.ALIGN == 0 for s in starts)
    assert all(b - a >= outs[0].nbytes for a, b in itertools.pairwise(starts))  # no overlap
    for i, o in enumerate(outs):
        o[...] = i
    assert [float(o.mean()) for o in outs] == [float(i) for i in range(8)]
    maps = {mapping_of(s)["start"] for s in starts}
    assert len(maps) == 1
    m = mapping_of(starts[0])
    assert "hg" in m["flags"] and m["AnonHugePages"] >= 6 * HUGE, m


def test_switched_off_or_small_ordinary(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("a huge-page mapping where none was to be made")

    monkeypatch.setattr(buffers, "_huge_mapping", refuse)
    small = buffers.aligned_empty((HUGE - 1,), np.dtype(np.uint8))
    assert small.ctypes.data % buffers.ALIGN == 0
    assert len(buffers.aligned_empties([(1000,), (HUGE - 2000,)], np.dtype(np.uint8))) == 2
    monkeypatch.setenv("UCP_HUGE_PAGES", "0")
    big = buffers.aligned_empty((4 * HUGE,), np.dtype(np.uint8))
    big[...] = 1
    assert big.ctypes.data % buffers.ALIGN == 0
    parts = buffers.aligned_empties([(HUGE,), (HUGE,)], np.dtype(np.uint8))
    assert [p.nbytes for p in parts] == [HUGE, HUGE]


@pytest.mark.parametrize("huge", ["1", "0"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_restored_arrays_live_in_the_buffers(
    tmp_path, monkeypatch: pytest.MonkeyPatch, huge: str, dtype: jnp.dtype
) -> None:
    """A reshard restore onto CPU devices, huge pages on and off: bit-exact, and (on) each shard
    lies on a huge-page mapping."""
    monkeypatch.setenv("UCP_HUGE_PAGES", huge)
    devs = np.array(jax.devices()[:8])
    src = NamedSharding(Mesh(devs.reshape(2, 4), ("a", "b")), P("a", "b"))
    dst = NamedSharding(Mesh(devs[::-1].reshape(4, 2), ("a", "b")), P("b", "a"))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (2048, 1024), dtype), src)
    ucp.save(tmp_path / "c", {"w": x}, step=1)
    got, _ = ucp.restore(tmp_path / "c", {"w": jax.ShapeDtypeStruct(x.shape, dtype, sharding=dst)})
    w = got["w"]
    assert w.sharding == dst
    assert np.asarray(w).tobytes() == np.asarray(x).tobytes()
    if huge == "1" and buffers.transparent_huge_pages():
        # each shard is the restore's host buffer itself, on an advised mapping (numpy advises
        # its own allocations of 4 MiB or more too: switched off, the flag proves nothing)
        shards = [s.data.unsafe_buffer_pointer() for s in w.addressable_shards]
        assert all("hg" in mapping_of(p)["flags"] for p in shards)


def test_packs_bounds() -> None:
    mib = 1 << 20
    assert buffers.packs([mib] * 20) == [(0, 8), (8, 16), (16, 20)]  # at most PACK_BYTES each
    assert buffers.packs([mib, 3 * mib, mib]) == []  # no run fills a huge page
    assert buffers.packs([HUGE - 1, HUGE - 1, 0]) == [(0, 3)]
    for sizes in ([mib] * 20, [300_000] * 100, [mib, 5 * mib, mib, mib, 3 * mib, 700_000] * 3):
        runs = buffers.packs(sizes)
        assert all(b - a > 1 for a, b in runs)
        assert all(HUGE <= sum(sizes[a:b]) <= buffers.PACK_BYTES for a, b in runs)
        assert all(sizes[k] < HUGE for a, b in runs for k in range(a, b))
        assert all(b0 <= a1 for (_, b0), (a1, _) in itertools.pairwise(runs))


@needs_thp
def test_small_leaves_of_a_restore_share_a_mapping(tmp_path) -> None:
    """Leaves each under a huge page are restored (bit-exact) onto shards that share advised
    mappings of at most PACK_BYTES; a leaf of its own size gets its own."""
    devs = np.array(jax.devices()[:8])
    sh = NamedSharding(Mesh(devs.reshape(2, 4), ("a", "b")), P("a", "b"))
    tree = {f"s{i}": jax.device_put(jnp.full((256, 512), i, jnp.float32), sh) for i in range(6)}
    tree["big"] = jax.device_put(jnp.ones((1024, 2048), jnp.float32), sh)
    ucp.save(tmp_path / "c", tree, step=1)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in tree.items()}
    got, _ = ucp.restore(tmp_path / "c", target)
    for k, v in tree.items():
        assert np.asarray(got[k]).tobytes() == np.asarray(v).tobytes(), k
    starts = {k: {mapping_of(s.data.unsafe_buffer_pointer())["start"]
                  for s in got[k].addressable_shards} for k in tree}  # fmt: skip
    small = set().union(*(starts[f"s{i}"] for i in range(6)))
    assert starts["big"].isdisjoint(small)
    # one mapping (the advice splits it: its huge-page part, then its 4 KiB tail)
    vmas = sorted((m for m in mappings() if m["start"] in small), key=lambda m: m["start"])
    assert all(a["end"] == b["start"] for a, b in itertools.pairwise(vmas)), vmas
    assert len(vmas) <= 2 and "hg" in vmas[0]["flags"], vmas
    assert vmas[-1]["end"] - vmas[0]["start"] <= buffers.PACK_BYTES, vmas
