"""Randomized corruption of whole checkpoints: 300 seeded mutations each of a format version 2
checkpoint (one file per chunk) and of a version 3 one (aggregated: OCDBT data files), every
outcome bit-exact values or a UcpError, never another exception or a silent wrong value.

The case-by-case damage is in test_hostile.py.
"""

from __future__ import annotations

import os
import random
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import assert_tree_bitexact
from helpers import mesh_of, ocdbt_values, place, save_layout, targets
from hostile_helpers import hostile_state
from hostile_helpers import pristine as pristine  # the fixture

import ucp_jax as ucp

# --------------------------------------------------------------------- randomized corruption

MUTATIONS = ("flip", "truncate", "delete", "swap", "append", "manifest", "zarr_json", "table")


def _mutate(ck: Path, rng: random.Random) -> str:
    files = sorted(p for p in ck.rglob("*") if p.is_file())
    kind = rng.choice(MUTATIONS)
    if kind == "manifest":
        f = ck / "manifest.json"
    elif kind == "zarr_json":
        f = rng.choice([p for p in files if p.name == "zarr.json"])
    elif kind == "table":
        f = rng.choice([p for p in files if p.parent.name == "digests"])
    else:
        f = rng.choice([p for p in files if "/c" in str(p.relative_to(ck))] or files)
    swap_with: list[Path] = []
    if kind == "swap":  # a file of the same size where there is one
        size = f.stat().st_size
        same = [p for p in files if p != f and p.stat().st_size == size and p.name != "COMMIT"]
        swap_with = same or [p for p in files if p != f]
    _mutate_file(f, kind if kind in ("truncate", "delete", "append", "swap") else "flip",
                 swap_with, rng)  # fmt: skip
    return kind


def _flip_range(f: Path, off: int, n: int, rng: random.Random) -> None:
    data = bytearray(f.read_bytes())
    for _ in range(rng.randint(1, 3)):
        i = off + rng.randrange(n)
        data[i] ^= 1 << rng.randrange(8)
    f.write_bytes(bytes(data))


def _mutate_file(f: Path, kind: str, swap_with: list[Path], rng: random.Random) -> None:
    """One whole-file mutation of `f`: flip (1-3 bits), truncate, delete, append, or swap its
    bytes with a file from `swap_with`."""
    data = f.read_bytes()
    if kind == "flip" and data:
        _flip_range(f, 0, len(data), rng)
    elif kind == "truncate":
        f.write_bytes(data[: rng.randrange(len(data) + 1)])
    elif kind == "delete":
        f.unlink()
    elif kind == "append":
        f.write_bytes(data + rng.randbytes(rng.randint(1, 64)))
    elif kind == "swap":
        g = rng.choice(swap_with)
        other = g.read_bytes()
        g.write_bytes(data)
        f.write_bytes(other)


def _corrupt_300(
    pristine: Path, tmp_path: Path, seed: int, mutate: Callable[[Path, random.Random], str]
) -> Counter[tuple[str, str]]:
    """300 seeded mutations of copies of `pristine`: each copy is read whole (and every 10th
    restored) and must give bit-exact values or a UcpError; (mutation, outcome) counts."""
    params, _ = hostile_state()
    ref = {}
    c = ucp.open(pristine)
    for name in c.atoms:
        for slot in c.atoms[name].slots:
            ref[(name, slot)] = c.read(name, slot).tobytes()
    rng = random.Random(seed)
    counts: Counter[tuple[str, str]] = Counter()
    for i in range(300):
        ck = tmp_path / f"m{i}"
        shutil.copytree(pristine, ck)
        kind = mutate(ck, rng)
        try:
            c = ucp.open(ck)
            for (name, slot), want in ref.items():
                assert c.read(name, slot).tobytes() == want, (kind, name, slot)
            outcome = "exact"
        except ucp.UcpError as e:
            outcome = type(e).__name__
        if i % 10 == 0:  # the restore path too, on a part of them
            try:
                p, _ = ucp.restore(ck, targets(params, mesh_of((4,))))
                assert_tree_bitexact(params, p)
            except ucp.UcpError:
                pass  # refused: fine (a damaged file the reads above did not need, or the same)
        counts[(kind, outcome)] += 1
        shutil.rmtree(ck)
    for k in sorted(counts):
        print(f"  {k[0]:10s} {k[1]:20s} {counts[k]}")
    assert sum(counts.values()) == 300
    return counts


def test_randomized_corruption(pristine: Path, tmp_path: Path) -> None:
    """300 seeded mutations: every outcome is bit-exact values or a UcpError; counts printed."""
    print("\nrandomized corruption (mutation, outcome): count")
    counts = _corrupt_300(pristine, tmp_path, 20261122, _mutate)
    assert {k for k, _ in counts} == set(MUTATIONS)


# ------------------------------------------- randomized corruption, aggregated layout (version 3)

MUTATIONS_V3 = ("flip", "truncate", "delete", "swap", "append", "manifest", "zarr_json",
                "table", "value_flip", "value_swap")  # fmt: skip


@pytest.fixture(scope="module")
def pristine_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile3") / "sandbox" / "ck"
    params, opt = hostile_state()
    save_layout(path, place(params, mesh_of((2,))), place(opt, mesh_of((2,))), step=5,
                layout="aggregated")  # fmt: skip
    assert ucp.open(path).manifest.version == 3
    return path


def _mutate_v3(ck: Path, values: dict[str, tuple[str, int, int]], rng: random.Random) -> str:
    """One mutation of a version-3 checkpoint: of its files (data files, B-tree nodes, the
    databases' manifests, manifest.json) or of one stored value inside a data file."""
    files = sorted(p for p in ck.rglob("*") if p.is_file() and p.name != "COMMIT")
    kind = rng.choice(MUTATIONS_V3)
    if kind in ("zarr_json", "table", "value_flip"):
        want = {"zarr_json": "/zarr.json", "table": "digests/", "value_flip": "/c"}[kind]
        key = rng.choice(sorted(k for k in values if want in k))
        f, off, n = values[key]
        _flip_range(Path(f), off, n, rng)
        return kind
    if kind == "value_swap":  # two stored chunks of one size exchanged inside their data files
        by_size: dict[int, list[str]] = {}
        for k, (_, _, n) in values.items():
            if "/c" in k:
                by_size.setdefault(n, []).append(k)
        pairs = sorted(ks for ks in by_size.values() if len(ks) > 1)
        a, b = rng.sample(rng.choice(pairs), 2)
        (fa, oa, n), (fb, ob, _) = values[a], values[b]
        da, db = Path(fa).read_bytes()[oa : oa + n], Path(fb).read_bytes()[ob : ob + n]
        for f, off, d in ((fa, oa, db), (fb, ob, da)):
            buf = bytearray(Path(f).read_bytes())
            buf[off : off + n] = d
            Path(f).write_bytes(bytes(buf))
        return kind
    f = ck / "manifest.json" if kind == "manifest" else rng.choice(files)
    _mutate_file(f, "flip" if kind == "manifest" else kind, [p for p in files if p != f], rng)
    return kind


def test_randomized_corruption_aggregated(pristine_v3: Path, tmp_path: Path) -> None:
    """300 seeded mutations of a version-3 checkpoint: bit-exact values or a UcpError, never
    another exception or a wrong value; counts printed."""
    values = {k: (os.path.relpath(f, pristine_v3), o, n)
              for k, (f, o, n) in ocdbt_values(pristine_v3).items()}  # fmt: skip

    def mutate(ck: Path, rng: random.Random) -> str:
        return _mutate_v3(ck, {k: (str(ck / f), o, n) for k, (f, o, n) in values.items()}, rng)

    print("\nrandomized corruption, version 3 (mutation, outcome): count")
    counts = _corrupt_300(pristine_v3, tmp_path, 20261123, mutate)
    assert {k for k, _ in counts} == set(MUTATIONS_V3)
