"""Damaged checkpoints fail loudly and name what is damaged; they never restore wrong values.

Chunk files carry crc32c checksums (zarr3 `crc32c` codec, also on the shard index), so a flipped
byte, a truncated or a missing chunk file raises ucp.ChecksumError naming the atom, from
`ucp.restore`, `Checkpoint.read` and `ucp verify`. A broken manifest raises NotACheckpointError, a
newer format FormatVersionError.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import assert_tree_bitexact
from helpers import float_params, mesh_of, place, save_layout, targets

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli_main


def _reference() -> dict:
    ref = float_params()
    # 4 MiB, saved in 2 shard files of 2 MiB, each holding 1 MiB inner chunks and a shard index.
    ref["big"] = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)
    return ref


def _atoms(ref: dict) -> dict[str, np.ndarray]:
    """The reference's leaves by atom name ('dense.kernel', ...)."""
    paths, _ = jax.tree_util.tree_flatten_with_path(ref)
    return {".".join(k.key for k in path): np.asarray(x) for path, x in paths}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corrupt") / "ck"
    # Format version 2 (one file per chunk): these cases damage chunk files; the aggregated
    # layout's cases are in test_aggregated.py.
    save_layout(path, place(_reference(), mesh_of((2,))), step=3, layout="per-array")
    ck = ucp.open(path)
    assert ck.atoms["big"].slots["fp32"].inner_chunks is not None, "big should be sharded"
    assert ck.atoms["dense.kernel"].slots["fp32"].inner_chunks is None
    return path


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the pristine checkpoint, to damage."""
    path = tmp_path / "ck"
    shutil.copytree(pristine, path)
    return path


def _chunk_files(ckpt: Path, atom: str) -> list[Path]:
    d = ckpt / "atoms" / atom / "fp32"
    files = sorted(p for p in (d / "c").rglob("*") if p.is_file())
    if not files:  # a scalar: one chunk file named `c`
        files = [d / "c"]
    return files


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _damage(ckpt: Path, atom: str, how: str) -> None:
    """Damage the first chunk file of `atom` (the one holding its first rows)."""
    f = _chunk_files(ckpt, atom)[0]
    size = f.stat().st_size
    if how == "flip-data":
        _flip(f, size // 2)  # inside the (first inner) chunk's data; the checksum is at the end
    elif how == "flip-index":
        _flip(f, size - 12)  # inside the shard index at the end of the file
    elif how == "truncate":
        with open(f, "r+b") as fh:
            fh.truncate(size // 2)
    elif how == "delete":
        f.unlink()
    else:
        raise ValueError(how)


CASES = [
    pytest.param("dense.kernel", "flip-data", id="f32-chunk-flip"),
    pytest.param("emb.embedding", "flip-data", id="bf16-chunk-flip"),
    pytest.param("scale", "flip-data", id="scalar-flip"),
    pytest.param("big", "flip-data", id="shard-inner-chunk-flip"),
    pytest.param("big", "flip-index", id="shard-index-flip"),
    pytest.param("dense.kernel", "truncate", id="chunk-truncated"),
    pytest.param("big", "truncate", id="shard-truncated"),
    pytest.param("dense.kernel", "delete", id="chunk-missing"),
]


@pytest.mark.parametrize(("atom", "how"), CASES)
def test_damaged_chunk_raises_checksum_error(ckpt, atom, how, capsys):
    ref = _reference()
    by_atom = _atoms(ref)
    _damage(ckpt, atom, how)
    named = f"'{atom}'"

    with pytest.raises(ucp.ChecksumError, match=named):
        ucp.restore(ckpt, targets(ref, mesh_of((4, 2))))
    with pytest.raises(ucp.ChecksumError, match=named):
        ucp.open(ckpt).read(atom)

    # Other atoms are untouched and still read; so are regions of other chunk files of this one.
    ck = ucp.open(ckpt)
    for other in ("dense.bias", "big", "dense.kernel"):
        if other != atom:
            assert ck.read(other).tobytes() == by_atom[other].tobytes()
    if by_atom[atom].ndim:
        rows = ck.atoms[atom].slots["fp32"].chunks[0]
        tail = np.s_[rows:]
        if how == "delete":  # a missing file fails the whole array: its holes would read as zeros
            with pytest.raises(ucp.ChecksumError, match="missing"):
                ck.read(atom, index=tail)
        else:
            assert ck.read(atom, index=tail).tobytes() == by_atom[atom][tail].tobytes()

    # `ucp verify` reports the damaged atom, and only it.
    assert cli_main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert fails and all(named in line for line in fails), out
    assert "1 problem(s)" in out, out


def test_pristine_checkpoint_verifies_and_restores(pristine, capsys):
    ref = _reference()
    out, _ = ucp.restore(pristine, targets(ref, mesh_of((4, 2))))
    assert_tree_bitexact(ref, out)
    assert cli_main(["verify", str(pristine)]) == 0
    assert capsys.readouterr().out.startswith("OK ")


def _ucp_command() -> list[str]:
    exe = Path(sys.executable).parent / "ucp"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "ucp_jax._src.cli"]


def test_verify_command_exit_codes(ckpt, pristine):
    """The installed `ucp verify` (a subprocess): 0 when sound, 1 naming the corrupted atom."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    ok = subprocess.run(
        [*_ucp_command(), "verify", str(pristine)], capture_output=True, text=True, env=env
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    _damage(ckpt, "dense.kernel", "flip-data")
    bad = subprocess.run(
        [*_ucp_command(), "verify", str(ckpt)], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "'dense.kernel'" in bad.stdout and "checksum" in bad.stdout, bad.stdout


# --------------------------------------------------------------------------- manifest and COMMIT


def _edit_manifest(ckpt: Path, edit) -> None:  # type: ignore[no-untyped-def]
    m = json.loads((ckpt / "manifest.json").read_text())
    edit(m)
    (ckpt / "manifest.json").write_text(json.dumps(m))


def _assert_refused(ckpt: Path, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ucp.open(ckpt)
    with pytest.raises(error, match=match):
        ucp.restore(ckpt, targets(_reference(), mesh_of((8,))))
    assert cli_main(["verify", str(ckpt)]) == 1


def test_manifest_not_json(ckpt):
    data = (ckpt / "manifest.json").read_bytes()
    (ckpt / "manifest.json").write_bytes(data[: len(data) // 2])
    _assert_refused(ckpt, ucp.NotACheckpointError, "manifest.json is not valid JSON")


def test_manifest_garbage_bytes(ckpt):
    (ckpt / "manifest.json").write_bytes(b"\x00\xff\xfe garbage")
    _assert_refused(ckpt, ucp.NotACheckpointError, "manifest")


def test_manifest_missing_fields(ckpt):
    _edit_manifest(ckpt, lambda m: m.pop("atoms"))
    _assert_refused(ckpt, ucp.NotACheckpointError, "manifest")


def test_manifest_unreadable_format_version(ckpt):
    _edit_manifest(ckpt, lambda m: m.update(format_version="one"))
    _assert_refused(ckpt, ucp.NotACheckpointError, "format version")


def test_manifest_newer_format_version(ckpt):
    _edit_manifest(ckpt, lambda m: m.update(format_version=99))
    _assert_refused(ckpt, ucp.FormatVersionError, "version 99 is newer")


def test_manifest_newer_format_string(ckpt):
    def edit(m: dict) -> None:
        m["format"] = "ucp/4"
        del m["format_version"]

    _edit_manifest(ckpt, edit)
    _assert_refused(ckpt, ucp.FormatVersionError, "version 4 is newer")


def test_manifest_of_another_format(ckpt):
    _edit_manifest(ckpt, lambda m: m.update(format="orbax/1"))
    _assert_refused(ckpt, ucp.NotACheckpointError, "not a universal checkpoint")


def test_manifest_missing(ckpt):
    (ckpt / "manifest.json").unlink()
    _assert_refused(ckpt, ucp.NotACheckpointError, "manifest.json missing")


def test_commit_missing(ckpt):
    (ckpt / "COMMIT").unlink()
    _assert_refused(ckpt, ucp.NotACheckpointError, "no COMMIT")
    assert ucp.list_checkpoints(ckpt.parent) == []
