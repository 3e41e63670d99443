"""The data tied to its sealed manifest, and manifests that contradict themselves, on both layouts.

`commit.seal` records the sha256 of every fingerprint table in the manifest (`tables`); readers
compare each table they read with it, and every chunk with its table. So the data of another
save of the same tree (same `zarr.json` bytes, other values) put beside a manifest is refused,
whole or in part, naming the table. A manifest whose own records disagree (its rules against its
leaves, its format_version against its records or its folder) is refused, naming the field. The
randomized test at the end mixes these with file damage: every outcome is the saved values
bit-exact or a UcpError (figures printed).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import optax
import pytest
from conftest import assert_tree_bitexact
from helpers import mesh_of, place, save_layout, targets

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli_main

LAYOUTS = ("aggregated", "per-array")
KEEP = ("manifest.json", "COMMIT")  # what a whole-store swap keeps of the checkpoint


def _state(k: float) -> tuple[dict, object]:
    params = {
        "a": np.arange(32 * 32, dtype=np.float32).reshape(32, 32) * k,  # square: Transposed fits
        "b": np.arange(32 * 16, dtype=np.float32).reshape(32, 16) - k,
        "s": np.float32(k),
    }
    return params, optax.adam(1e-3).init(params)


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per layout: two saves of the same tree, other values and steps (A: step 1, B: step 2)."""
    root = tmp_path_factory.mktemp("sealed")
    out = {}
    for layout in LAYOUTS:
        pair = []
        for k, step in ((1.0, 1), (2.0, 2)):
            params, opt = _state(k)
            path = root / layout / f"s{step}"
            save_layout(path, place(params, mesh_of((2,))), place(opt, mesh_of((2,))),
                        step=step, layout=layout)  # fmt: skip
            pair.append(path)
        out[layout] = (pair[0], pair[1])
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _replace(dst: Path, src: Path, names: list[str]) -> None:
    """Replace `names` (files or folders, relative) of `dst` with those of `src`."""
    for n in names:
        d, s = dst / n, src / n
        if d.is_dir():
            shutil.rmtree(d)
        elif d.exists():
            d.unlink()
        if s.is_dir():
            shutil.copytree(s, d)
        elif s.exists():
            shutil.copy(s, d)


def _swap_store(dst: Path, src: Path) -> None:
    """Everything but manifest.json and COMMIT of `dst` replaced by `src`'s."""
    _replace(dst, src, sorted((set(os.listdir(dst)) | set(os.listdir(src))) - set(KEEP)))


def _reseal(ck: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Edit manifest.json and recompute COMMIT to match (as a tool or a forger would)."""
    m = json.loads((ck / "manifest.json").read_text())
    edit(m)
    data = json.dumps(m).encode()
    (ck / "manifest.json").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    (ck / "COMMIT").write_bytes(f"ucp/1\nmanifest-sha256 {sha}\n".encode())


def _refused(ck: Path, error: type[Exception], match: str) -> None:
    """ucp.open + reading every array, ucp.restore and `ucp verify` all refuse."""
    params, opt = _state(1.0)
    with pytest.raises(error, match=match):
        c = ucp.open(ck)
        for name in sorted(c.atoms):
            for slot in c.atoms[name].slots:
                c.read(name, slot)
    with pytest.raises(error, match=match):
        ucp.restore(ck, targets(params, mesh_of((4,))), targets(opt, mesh_of((4,))))
    assert cli_main(["verify", str(ck)]) == 1


# ---------------------------------------------------------------------- data tied to manifest


@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_store_swapped_from_another_save_is_refused(saves, tmp_path, layout) -> None:
    a, b = saves[layout]
    ck = _copy(a, tmp_path / "ck")
    _swap_store(ck, b)
    table = "digests/p0.json" if layout == "aggregated" else "atoms/.*/digests/p0.json"
    _refused(ck, ucp.ChecksumError, f"fingerprint table {table} is not the one sealed in "
             "manifest.json .*another save's")  # fmt: skip


def test_one_array_folder_swapped_from_another_save_is_refused(saves, tmp_path) -> None:
    a, b = saves["per-array"]
    ck = _copy(a, tmp_path / "ck")
    _replace(ck, b, ["atoms/b/fp32"])
    _refused(ck, ucp.ChecksumError, "table atoms/b/fp32/digests/p0.json is not the one sealed")
    assert ucp.open(ck).read("a").tobytes() == _state(1.0)[0]["a"].tobytes()  # others read


@pytest.mark.parametrize("part", ["ocdbt.p0", "d+manifest.ocdbt"])
def test_one_database_swapped_from_another_save_is_refused(saves, tmp_path, part) -> None:
    a, b = saves["aggregated"]
    ck = _copy(a, tmp_path / "ck")
    _replace(ck, b, part.split("+"))
    _refused(ck, ucp.ChecksumError, "another save|missing|not the one (sealed|committed)")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_manifest_without_table_digests_still_opens(saves, tmp_path, layout) -> None:
    """A manifest written before the digests were recorded (no `tables`) reads as before."""
    ck = _copy(saves[layout][0], tmp_path / "ck")
    _reseal(ck, lambda m: m.pop("tables"))
    params, opt = _state(1.0)
    p, o = ucp.restore(ck, targets(params, mesh_of((4,))), targets(opt, mesh_of((4,))))
    assert_tree_bitexact(params, p)
    assert_tree_bitexact(opt, o)
    assert cli_main(["verify", str(ck)]) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_table_digests_edited_are_refused(saves, tmp_path, layout) -> None:
    ck = _copy(saves[layout][0], tmp_path / "ck")

    def edit(m: dict) -> None:
        k = sorted(m["tables"])[0]
        m["tables"][k] = "0" * 64

    _reseal(ck, edit)
    _refused(ck, ucp.ChecksumError, "not the one sealed")
    _reseal(ck, lambda m: m.update(tables={"x.json": "nothex"}))
    with pytest.raises(ucp.NotACheckpointError, match="'tables' is not a map"):
        ucp.open(ck)


# ------------------------------------------------------------------ manifests that contradict


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rule_added_for_a_leaf_saved_without_one_is_refused(saves, tmp_path, layout) -> None:
    ck = _copy(saves[layout][0], tmp_path / "ck")
    _reseal(ck, lambda m: m["rules"].append(["a", [{"type": "Transposed", "perm": [1, 0]}]]))
    _refused(ck, ucp.NotACheckpointError, "leaf 'a' was saved with no rule, but the manifest's "
             "rules give it rule #0 .*contradicts itself")  # fmt: skip


def test_leaf_rule_and_atom_pattern_edits_are_refused(tmp_path) -> None:
    params = {"w": np.arange(16, dtype=np.float32).reshape(4, 4)}
    ck = tmp_path / "ck"
    ucp.save(ck, params, rules=[("w", ucp.Transposed((1, 0)))])
    ck2 = _copy(ck, tmp_path / "ck2")
    _reseal(ck, lambda m: m["leaves"]["w"].update(rule=None))
    with pytest.raises(ucp.NotACheckpointError, match="saved with no rule, but"):
        ucp.open(ck)
    _reseal(ck2, lambda m: m["atoms"]["w"].update(pattern=[]))
    with pytest.raises(ucp.NotACheckpointError, match="atom 'w' records pattern"):
        ucp.open(ck2)
    _reseal(ck2, lambda m: (m["atoms"]["w"].update(pattern=m["rules"][0][1]),
                            m["leaves"]["w"].update(rule=7)))  # fmt: skip
    with pytest.raises(ucp.NotACheckpointError, match="records rule 7, but the manifest has 1"):
        ucp.open(ck2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("value", [1, 2, 3, 0, -1, "3", 3.0, None, True, 99])
def test_edited_format_version_is_a_ucp_error(saves, tmp_path, layout, value) -> None:
    ck = _copy(saves[layout][0], tmp_path / "ck")
    _reseal(ck, lambda m: m.update(format_version=value))
    own = 3 if layout == "aggregated" else 2
    if value == own and type(value) is int:
        assert ucp.open(ck).read("s") == np.float32(1.0)
        return
    want = {99: (ucp.FormatVersionError, "newer than this ucp_jax reads"),
            1: (ucp.NotACheckpointError, "says format_version 1, but it records the checksums"),
            2: (ucp.NotACheckpointError, "says format_version 2, but the folder holds the layout "
                "of format version 3"),
            3: (ucp.NotACheckpointError, "says format_version 3, but the folder holds the layout "
                "of format version 2")}  # fmt: skip
    error, match = want.get(value, (ucp.NotACheckpointError, "unreadable format version"))
    if type(value) is not int:
        error, match = ucp.NotACheckpointError, "unreadable format version"
    with pytest.raises(error, match=match):
        ucp.open(ck)
    assert cli_main(["verify", str(ck)]) == 1


@pytest.mark.parametrize("fmt", ["ucp/\u00b2", "ucp/x", "ucp/", "ucp"])
def test_a_format_string_without_a_version_number_is_a_ucp_error(saves, tmp_path, fmt) -> None:
    # a manifest with no format_version takes it from `format` ("ucp/1"); "ucp/²" passed
    # str.isdigit and then failed int() with a bare ValueError
    ck = _copy(saves["aggregated"][0], tmp_path / "ck")
    _reseal(ck, lambda m: (m.pop("format_version"), m.update(format=fmt)))
    with pytest.raises(ucp.NotACheckpointError):
        ucp.open(ck)
    assert cli_main(["verify", str(ck)]) == 1


# -------------------------------------------------------------------------------- messages


@pytest.mark.parametrize(
    "gone, match",
    [
        ("manifest.ocdbt", "database is incomplete: manifest.ocdbt is missing"),
        ("ocdbt.p0", "database is incomplete: ocdbt.p0/manifest.ocdbt is missing"),
        ("d", "a data file of the checkpoint is missing"),
    ],
)
def test_a_missing_database_is_named(saves, tmp_path, gone, match) -> None:
    ck = _copy(saves["aggregated"][0], tmp_path / "ck")
    target = ck / gone
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    _refused(ck, ucp.ChecksumError, match)


def test_a_linked_atoms_folder_is_named(saves, tmp_path) -> None:
    ck = _copy(saves["per-array"][0], tmp_path / "ck")
    shutil.move(ck / "atoms", tmp_path / "elsewhere")
    (ck / "atoms").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ucp.UnsafePathError, match=r"ck/atoms: atoms folder .* symbolic link"):
        ucp.open(ck)


# ------------------------------------------------------------------------------ randomized

MUTATIONS = ("store_swap", "part_swap", "table_swap", "manifest_edit", "file_damage", "rm")


def _mutate(ck: Path, other: Path, layout: str, rng: random.Random) -> str:
    kind = rng.choice(MUTATIONS)
    files = sorted(p for p in ck.rglob("*") if p.is_file() and p.name not in KEEP)
    if kind == "store_swap":
        _swap_store(ck, other)
    elif kind == "part_swap":  # a folder or file of the data replaced by the other save's
        parts = sorted(str(p.relative_to(other)) for p in other.rglob("*")
                       if p.name not in KEEP and "/c/" not in f"/{p.relative_to(other)}/")  # fmt: skip
        _replace(ck, other, [rng.choice(parts)])
    elif kind == "table_swap":  # fingerprint tables only (version 2: files; 3: the whole db)
        tables = sorted(str(p.relative_to(other)) for p in other.rglob("digests/*.json"))
        _replace(ck, other, [rng.choice(tables)] if tables else ["ocdbt.p0"])
    elif kind == "manifest_edit":
        _reseal(ck, rng.choice(_EDITS))
    elif kind == "file_damage":
        f = rng.choice(files)
        data = bytearray(f.read_bytes())
        if data and rng.random() < 0.5:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            data = data[: rng.randrange(len(data) + 1)]
        f.write_bytes(bytes(data))
    else:
        f = rng.choice(files)
        f.unlink()
    return kind


_EDITS = [
    lambda m: m["rules"].append(["a", [{"type": "Transposed", "perm": [1, 0]}]]),
    lambda m: m["rules"].append([".*", [{"type": "Transposed", "perm": [1, 0]}]]),
    lambda m: m.update(format_version=m["format_version"] ^ 1),
    lambda m: m.update(format_version=m["format_version"] - 1),
    lambda m: m.update(format_version=str(m["format_version"])),
    lambda m: m.pop("tables"),  # harmless alone: the data is this save's
    lambda m: m.update(step=m["step"] + 1),  # harmless: a step is what it says
    lambda m: m["tables"].update({k: "f" * 64 for k in list(m["tables"])[:1]}),
    lambda m: m["leaves"]["a"].update(rule=0),
]


def _fuzz(saves: dict, tmp_path: Path, layout: str, seed: int, n: int) -> Counter[tuple[str, str]]:
    a, b = saves[layout]
    params, opt = _state(1.0)
    ref = {}
    c = ucp.open(a)
    for name in c.atoms:
        for slot in c.atoms[name].slots:
            ref[(name, slot)] = c.read(name, slot).tobytes()
    rng = random.Random(seed)
    counts: Counter[tuple[str, str]] = Counter()
    for i in range(n):
        ck = _copy(a, tmp_path / f"m{i}")
        kind = _mutate(ck, b, layout, rng)
        try:
            c = ucp.open(ck)
            for (name, slot), want in ref.items():
                if c.read(name, slot).tobytes() != want:
                    outcome = "WRONG VALUES"
                    break
            else:
                outcome = "exact"
            if i % 8 == 0 and outcome == "exact":
                p, o = ucp.restore(ck, targets(params, mesh_of((4,))), targets(opt, mesh_of((4,))))
                assert_tree_bitexact(params, p)
                assert_tree_bitexact(opt, o)
        except ucp.UcpError as e:
            outcome = type(e).__name__
        except Exception as e:  # counted: the test fails on any
            outcome = f"FOREIGN {type(e).__name__}: {e}"
        counts[(kind, outcome)] += 1
        shutil.rmtree(ck)
    return counts


@pytest.mark.parametrize("layout", LAYOUTS)
def test_randomized_swaps_edits_and_damage(saves, tmp_path, layout) -> None:
    """150 seeded mutations (whole-store and partial swaps from another save, resealed manifest
    edits, damaged and deleted files): bit-exact values or a UcpError; figures printed."""
    counts = _fuzz(saves, tmp_path, layout, 20261128, 150)
    print(f"\nrandomized, {layout} (mutation, outcome): count")
    for k in sorted(counts):
        print(f"  {k[0]:14s} {k[1]:22s} {counts[k]}")
    bad = {k: v for k, v in counts.items() if k[1].startswith(("WRONG", "FOREIGN"))}
    assert not bad, bad
    assert {k for k, _ in counts} == set(MUTATIONS)
    assert counts[("store_swap", "ChecksumError")] == sum(
        v for (k, _), v in counts.items() if k == "store_swap"
    )
