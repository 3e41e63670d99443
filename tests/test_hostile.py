"""Hostile and damaged checkpoints: nothing read outside the folder, no crash, no silent wrong value.

Every case mutates a real checkpoint written by `ucp.save` (in a sandbox folder) and asserts the
exact outcome: the UcpError subclass and what its message names, or bit-exact values. The
importers' hostile inputs are in test_hostile_importers.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import optax
import pytest
from conftest import assert_tree_bitexact
from helpers import mesh_of, ocdbt_values, place, save_layout, targets

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli_main


def _state() -> tuple[dict, object]:
    params = {
        "a": np.arange(64 * 64, dtype=np.float32).reshape(64, 64),  # 2 chunk files (2 writers)
        "b": (np.arange(64 * 64, dtype=np.float32) * -1.0).reshape(64, 64),  # same shapes as a
        "big": np.arange(512 * 512, dtype=np.float32).reshape(512, 512),  # sharded files
        "s": np.float32(3.5),
    }
    opt = optax.adam(1e-3).init(params)
    return params, opt


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "sandbox" / "ck"
    params, opt = _state()
    # Format version 2 (one file per chunk; still read): the file-level cases below target its
    # files. The aggregated layout (version 3) has its own randomized cases at the end.
    save_layout(path, place(params, mesh_of((2,))), place(opt, mesh_of((2,))), step=5,
                layout="per-array")  # fmt: skip
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    path = tmp_path / "sandbox" / "ck"
    shutil.copytree(pristine, path)
    return path


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _chunks(ck: Path, atom: str, slot: str = "fp32") -> list[Path]:
    d = ck / "atoms" / atom / slot
    files = sorted(p for p in (d / "c").rglob("*") if p.is_file()) if (d / "c").is_dir() else []
    return files or [d / "c"]


def _edit(ck: Path, edit, *, reseal: bool = False) -> None:  # type: ignore[no-untyped-def]
    m = json.loads((ck / "manifest.json").read_text())
    edit(m)
    data = json.dumps(m).encode()
    (ck / "manifest.json").write_bytes(data)
    if reseal:  # as a forger (or a consistent tool) would: COMMIT matches the edited manifest
        sha = hashlib.sha256(data).hexdigest()
        (ck / "COMMIT").write_bytes(f"ucp/1\nmanifest-sha256 {sha}\n".encode())


def _refused(ck: Path, error: type[Exception], match: str, *, at_open: bool = False) -> None:
    """Every reader refuses: ucp.open (or a read), ucp.restore, and `ucp verify` (one line)."""
    params, opt = _state()
    if at_open:
        with pytest.raises(error, match=match):
            ucp.open(ck)
    else:
        with pytest.raises(error, match=match):
            c = ucp.open(ck)
            for name in sorted(c.atoms):
                for slot in c.atoms[name].slots:
                    c.read(name, slot)
    with pytest.raises(error, match=match):
        ucp.restore(ck, targets(params, mesh_of((4,))), targets(opt, mesh_of((4,))))
    assert cli_main(["verify", str(ck)]) == 1


# ------------------------------------------------------------------------------ reads outside


@pytest.mark.parametrize("what", ["array folder", "chunk file", "atoms folder", "manifest"])
def test_symlinks_inside_a_checkpoint_are_refused(ckpt: Path, tmp_path: Path, what: str) -> None:
    outside = tmp_path / "outside"
    if what == "array folder":
        shutil.copytree(ckpt / "atoms" / "a" / "fp32", outside)
        shutil.rmtree(ckpt / "atoms" / "a" / "fp32")
        (ckpt / "atoms" / "a" / "fp32").symlink_to(outside)
    elif what == "chunk file":
        f = _chunks(ckpt, "a")[0]
        shutil.copy(f, outside)
        f.unlink()
        f.symlink_to(outside)
    elif what == "atoms folder":
        shutil.copytree(ckpt / "atoms", outside)
        shutil.rmtree(ckpt / "atoms")
        (ckpt / "atoms").symlink_to(outside)
    else:
        shutil.copy(ckpt / "manifest.json", outside)
        (ckpt / "manifest.json").unlink()
        (ckpt / "manifest.json").symlink_to(outside)
    _refused(
        ckpt, ucp.UnsafePathError, "symbolic link", at_open=what in ("atoms folder", "manifest")
    )


def test_a_checkpoint_reached_through_a_link_is_fine(pristine: Path, tmp_path: Path) -> None:
    (tmp_path / "latest").symlink_to(pristine)  # the root itself may be a link: the user's choice
    assert ucp.open(tmp_path / "latest").read("s") == np.float32(3.5)


@pytest.mark.parametrize("path", ["../../../../etc", "/etc", "atoms/b/fp32", "atoms/a/../b/fp32"])
def test_slot_paths_come_from_the_names(ckpt: Path, path: str) -> None:
    def edit(m: dict) -> None:
        m["atoms"]["a"]["slots"]["fp32"]["path"] = path

    _edit(ckpt, edit, reseal=True)
    _refused(ckpt, ucp.NotACheckpointError, "slot paths follow from the names", at_open=True)


@pytest.mark.parametrize("name", [".", "..", ""])
def test_unusable_atom_names_in_a_manifest(ckpt: Path, name: str) -> None:
    def edit(m: dict) -> None:
        m["atoms"][name] = m["atoms"].pop("a")

    _edit(ckpt, edit, reseal=True)
    _refused(ckpt, ucp.NotACheckpointError, "not usable", at_open=True)


@pytest.mark.parametrize("key", [".", ".."])
def test_leaves_named_dot_or_dotdot_are_not_saved(tmp_path: Path, key: str) -> None:
    with pytest.raises(ucp.UnsafePathError, match="not a usable file name"):
        ucp.save(tmp_path / "ck", {key: np.ones(4, np.float32)})
    assert not (tmp_path / "ck").exists()


def test_atom_names_with_separators_stay_inside(tmp_path: Path) -> None:
    ucp.save(tmp_path / "s" / "ck", {"../../../x": np.ones(4, np.float32), "/abs": np.zeros(2)})
    assert _listing(tmp_path) == {"s", *(f"s/{p}" for p in _listing(tmp_path / "s"))}
    ck = ucp.open(tmp_path / "s" / "ck")
    np.testing.assert_array_equal(ck.read("../../../x"), np.ones(4, np.float32))


# ------------------------------------------------------------------------------ crashes, limits


def test_huge_shape_in_manifest_and_zarr_json(ckpt: Path) -> None:
    """[1e15] elements with chunks [2.5e14] (in both files): refused before any allocation."""

    def edit(m: dict) -> None:
        m["atoms"]["s"]["shape"] = [10**15]
        m["atoms"]["s"]["slots"]["fp32"]["chunks"] = [25 * 10**13]

    _edit(ckpt, edit, reseal=True)
    meta = ckpt / "atoms" / "s" / "fp32" / "zarr.json"
    z = json.loads(meta.read_text())
    z["shape"] = [10**15]
    z["chunk_grid"]["configuration"]["chunk_shape"] = [25 * 10**13]
    meta.write_text(json.dumps(z))
    _refused(ckpt, ucp.LimitError, "more than", at_open=True)


def test_big_shape_backed_by_small_files_v1(ckpt: Path) -> None:
    """A version-1 checkpoint (no checksums) whose shape grew: the file sizes give it away."""

    def edit(m: dict) -> None:
        m["format_version"] = 1
        m.pop("tables", None)  # version 1 recorded no digests (nor anything else)
        for a in m["atoms"].values():
            for s in a["slots"].values():
                s.pop("meta_sha256", None)
        m["atoms"]["a"]["shape"] = [64, 2**30]
        for s in m["atoms"]["a"]["slots"].values():
            s["chunks"] = [32, 2**30]

    _edit(ckpt, edit)
    (ckpt / "COMMIT").write_bytes(b"ucp/1\n")
    for slot in ("fp32", "exp_avg", "exp_avg_sq"):
        meta = ckpt / "atoms" / "a" / slot / "zarr.json"
        z = json.loads(meta.read_text())
        z["shape"] = [64, 2**30]
        z["chunk_grid"]["configuration"]["chunk_shape"] = [32, 2**30]
        meta.write_text(json.dumps(z))
    ck = ucp.open(ckpt)
    with pytest.raises(ucp.ChecksumError, match="bytes, expected exactly"):
        ck.read("a", "fp32", np.s_[:1, :4])
    assert ck.read("b")[1, 2] == -66.0  # other atoms still read


def test_manifest_only_shape_is_a_clear_error(ckpt: Path) -> None:
    _edit(ckpt, lambda m: m["atoms"]["s"].update(shape=[10**15]), reseal=True)
    _refused(ckpt, ucp.LimitError, "elements, more than", at_open=True)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("dtype", "int32", "data_type"), ("chunks", [16, 64], "chunk_grid")],
)
def test_manifest_slot_disagreeing_with_zarr_json(
    ckpt: Path, field: str, value: object, match: str
) -> None:
    _edit(ckpt, lambda m: m["atoms"]["a"]["slots"]["fp32"].update({field: value}), reseal=True)
    with pytest.raises(ucp.ChecksumError, match=f"zarr.json says {match}"):
        ucp.open(ckpt).read("a")
    assert cli_main(["verify", str(ckpt)]) == 1


def test_manifest_shape_disagreeing_with_zarr_json(ckpt: Path) -> None:
    _edit(ckpt, lambda m: m["atoms"]["a"].update(shape=[64, 128]), reseal=True)
    with pytest.raises(ucp.ChecksumError, match=r"zarr\.json says shape"):
        ucp.open(ckpt).read("a")
    with pytest.raises(ucp.MismatchError, match="the checkpoint has \\(64, 128\\)"):
        ucp.restore(ckpt, targets(_state()[0], mesh_of((4,))))
    assert cli_main(["verify", str(ckpt)]) == 1


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", "foo", "unknown dtype"),
        ("dtype", 123, "unknown dtype"),
        ("dtype", "object", "unknown dtype"),
        ("chunks", [0, 32], "ints >= 1"),
        ("chunks", [32], "chunks"),
        ("chunks", "32", "list of"),
        ("shape", [-1, 64], "ints >= 0"),
        ("inner_chunks", [7, 7], "do not divide"),
    ],
)
def test_malformed_slot_fields(ckpt: Path, field: str, value: object, match: str) -> None:
    _edit(ckpt, lambda m: m["atoms"]["a"]["slots"]["fp32"].update({field: value}), reseal=True)
    _refused(ckpt, (ucp.NotACheckpointError, ucp.LimitError), match, at_open=True)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m["atoms"]["a"].update(shape=[-64, 64]), "ints >= 0"),
        (lambda m: m["atoms"]["a"].update(pattern=["Replicated"]), "pattern"),
        (lambda m: m["atoms"]["a"].update(pattern=[{"axis": 0}]), "not a valid pattern"),
        (lambda m: m["rules"].append(["a", [{"axis": 0}]]), "not a valid pattern"),
        (lambda m: m["rules"].append("a"), "not \\[regex"),
        (lambda m: m.update(step="5"), "'step'"),
        (lambda m: m.update(atoms=[]), "'atoms' is not an object"),
        (lambda m: m["atoms"]["a"].update(slots={}), "no slots"),
        (lambda m: m["atoms"]["a"]["slots"].update({"../x": {}}), "slot name"),
    ],
)
def test_malformed_manifest_fields(ckpt: Path, edit, match: str) -> None:  # type: ignore[no-untyped-def]
    _edit(ckpt, edit, reseal=True)
    _refused(ckpt, (ucp.NotACheckpointError, ucp.UnsafePathError), match, at_open=True)


def test_deeply_nested_manifest(ckpt: Path) -> None:
    data = (ckpt / "manifest.json").read_bytes()
    deep = data.replace(b'"extra": null', b'"extra": ' + b"[" * 100_000 + b"]" * 100_000)
    (ckpt / "manifest.json").write_bytes(deep)
    _refused(ckpt, ucp.NotACheckpointError, "manifest", at_open=True)


def test_deleted_zarr_json(ckpt: Path) -> None:
    (ckpt / "atoms" / "a" / "fp32" / "zarr.json").unlink()
    _refused(ckpt, ucp.ChecksumError, "zarr.json is missing")


def test_edited_zarr_json(ckpt: Path) -> None:
    meta = ckpt / "atoms" / "a" / "fp32" / "zarr.json"
    meta.write_text(meta.read_text().replace('"float32"', '"int32"'))
    _refused(ckpt, ucp.ChecksumError, "zarr.json is not the one committed")


# ------------------------------------------------------------------------- silent wrong values


def test_swapped_chunk_files_within_an_array(ckpt: Path) -> None:
    f0, f1 = _chunks(ckpt, "a")[:2]
    tmp = f0.read_bytes()
    f0.write_bytes(f1.read_bytes())
    f1.write_bytes(tmp)
    _refused(ckpt, ucp.ChecksumError, "does not hold the bytes written for that position")


@pytest.mark.parametrize("atoms", [("a", "b"), ("big", "big")])
def test_swapped_chunk_files_across_arrays(ckpt: Path, atoms: tuple[str, str]) -> None:
    if atoms[0] == atoms[1]:  # sharded files (inner chunks + index) of one array
        f0, f1 = _chunks(ckpt, "big")[:2]
    else:
        f0, f1 = _chunks(ckpt, atoms[0])[0], _chunks(ckpt, atoms[1])[0]
    assert f0.stat().st_size == f1.stat().st_size
    tmp = f0.read_bytes()
    f0.write_bytes(f1.read_bytes())
    f1.write_bytes(tmp)
    _refused(ckpt, ucp.ChecksumError, "does not hold the bytes written for that position")


def test_swapped_fingerprint_tables(ckpt: Path) -> None:
    da, db = (ckpt / "atoms" / x / "fp32" / "digests" for x in ("a", "b"))
    for f in da.iterdir():
        tmp = f.read_bytes()
        f.write_bytes((db / f.name).read_bytes())
        (db / f.name).write_bytes(tmp)
    _refused(ckpt, ucp.ChecksumError, "holds the fingerprints of array")


def test_swapped_slot_paths_in_manifest(ckpt: Path) -> None:
    def edit(m: dict) -> None:
        s = m["atoms"]["a"]["slots"]
        s["exp_avg"]["path"], s["exp_avg_sq"]["path"] = (
            s["exp_avg_sq"]["path"],
            s["exp_avg"]["path"],
        )

    _edit(ckpt, edit)  # sealed or not: the paths must follow from the names
    _refused(ckpt, ucp.NotACheckpointError, "slot paths follow from the names", at_open=True)
    _edit(ckpt, lambda m: None, reseal=True)
    _refused(ckpt, ucp.NotACheckpointError, "slot paths follow from the names", at_open=True)


def test_rule_edited_to_transposed(ckpt: Path) -> None:
    _edit(ckpt, lambda m: m["rules"].append(["a", [{"type": "Transposed", "perm": [1, 0]}]]))
    _refused(ckpt, ucp.ChecksumError, "not the manifest that was committed", at_open=True)


def test_version_1_checkpoints_still_open(ckpt: Path) -> None:
    """A version-1 checkpoint (no COMMIT checksum, no tables) reads as before."""

    def edit(m: dict) -> None:  # as version 1 wrote it: no sha256 of zarr.json, no table digests
        m.update(format_version=1)
        m.pop("tables")
        for a in m["atoms"].values():
            for slot in a["slots"].values():
                slot.pop("meta_sha256")

    _edit(ckpt, edit)
    (ckpt / "COMMIT").write_bytes(b"ucp/1\n")
    for d in ckpt.rglob("digests"):
        shutil.rmtree(d)
    params, opt = _state()
    p, _ = ucp.restore(ckpt, targets(params, mesh_of((4,))), targets(opt, mesh_of((4,))))
    assert_tree_bitexact(params, p)
    assert cli_main(["verify", str(ckpt)]) == 0


def test_cli_prints_one_line(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _edit(ckpt, lambda m: m["atoms"]["a"]["slots"]["fp32"].update(dtype="foo"), reseal=True)
    assert cli_main(["inspect", str(ckpt)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown dtype" in err[0] and "Traceback" not in err[0]


# ------------------------------------------------------------------------------ leftovers


def test_leftover_of_a_killed_overwrite_is_removed(tmp_path: Path) -> None:
    old = tmp_path / ".step_2.ucp-old-0123abcd"
    (old / "atoms").mkdir(parents=True)
    (old / "COMMIT").write_text("ucp/1\n")
    ucp.save(tmp_path / "step_2", {"x": np.ones(3, np.float32)})
    assert not old.exists()
    assert sorted(os.listdir(tmp_path)) == ["step_2"]


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
    params, _ = _state()
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
    params, opt = _state()
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
