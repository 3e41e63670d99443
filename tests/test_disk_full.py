"""A disk that fills up mid-write: a real small file system (tmpfs with a size limit).

Every writer (save, async save, a snapshot's persist, the Orbax handler in a CheckpointManager,
an import, the exports) is run into a disk that has less space left than it needs: the error is a
`StorageFullError` that says the disk is full and names the destination; the earlier checkpoint
is intact and restores bit-exact; nothing half-written is there (no staging folder, nothing
listed); the space of the failed attempt is given back; and once space is freed the same write
succeeds. Skipped where mounting is not allowed (not root, or in a container without the right).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_tree_bitexact
from helpers import mesh_of, place, targets

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli_main

MiB = 1 << 20
DISK = 16 * MiB


class Disk:
    """A tmpfs of DISK bytes at `root`; `ballast(free)` fills it until `free` bytes are left."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._ballast = root / "ballast"

    def used(self) -> int:
        st = os.statvfs(self.root)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def ballast(self, leave: int) -> None:
        n = max(self.free() - leave, 0)
        with open(self._ballast, "ab") as f:
            f.write(b"\0" * n)

    def unballast(self) -> None:
        self._ballast.unlink(missing_ok=True)

    def names(self) -> list[str]:
        return sorted(n for n in os.listdir(self.root) if n != "ballast")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    root = tmp_path / "disk"
    root.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(root)],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        yield Disk(root)
    finally:
        if subprocess.run(["umount", str(root)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)


def _tree(k: float) -> dict:
    return {"w": np.full((1024, 1024), k, np.float32), "b": np.arange(1024, dtype=np.float32) * k}


def _check_failed_cleanly(disk: Disk, err: BaseException, used: int, kept: list[str]) -> None:
    """The error says the disk is full and where; nothing is left of the attempt but `kept`."""
    assert "disk is full" in str(err) and str(disk.root) in str(err), err
    assert disk.names() == kept, disk.names()
    assert disk.used() <= used + 64 * 1024, (disk.used(), used)  # its space is given back


def _intact(path: Path, k: float) -> None:
    ref = _tree(k)
    out, _ = ucp.restore(path, targets(ref, mesh_of((2,))))
    assert_tree_bitexact(ref, out)
    assert cli_main(["verify", str(path)]) == 0


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_save_into_a_full_disk(disk: Disk, monkeypatch, layout: str, how: str) -> None:
    monkeypatch.setenv("UCP_LAYOUT", layout)
    ucp.save(disk.root / "step_1", place(_tree(1.0), mesh_of((2,))), step=1)
    disk.ballast(leave=MiB + MiB // 2)  # the next save needs 4 MiB: it fills up mid-write
    used = disk.used()
    save = ucp.save if how == "save" else (lambda *a, **k: ucp.async_save(*a, **k).wait())
    with pytest.raises(ucp.StorageFullError) as e:
        save(disk.root / "step_2", place(_tree(2.0), mesh_of((2,))), step=2)
    _check_failed_cleanly(disk, e.value, used, ["step_1"])
    assert isinstance(e.value, OSError) and e.value.errno == 28
    _intact(disk.root / "step_1", 1.0)
    assert ucp.list_checkpoints(disk.root) == [str(disk.root / "step_1")]
    disk.unballast()
    save(disk.root / "step_2", place(_tree(2.0), mesh_of((2,))), step=2)  # space freed: it works
    _intact(disk.root / "step_2", 2.0)


def test_overwrite_into_a_full_disk_keeps_the_old_checkpoint(disk: Disk) -> None:
    ucp.save(disk.root / "step_1", _tree(1.0), step=1)
    disk.ballast(leave=MiB)
    with pytest.raises(ucp.StorageFullError):
        ucp.save(disk.root / "step_1", _tree(2.0), step=1, overwrite=True)
    assert disk.names() == ["step_1"]
    _intact(disk.root / "step_1", 1.0)


def test_persist_of_a_snapshot_into_a_full_disk(disk: Disk, tmp_path: Path) -> None:
    from ucp_jax.memory import SnapshotManager

    mgr = SnapshotManager(disk.root, persist_every=1, shm_dir=tmp_path / "shm", namespace="full")
    try:
        mgr.snapshot(1, place(_tree(1.0), mesh_of((2,))))
        mgr.wait()
        disk.ballast(leave=MiB)
        used = disk.used()
        mgr.snapshot(2, place(_tree(2.0), mesh_of((2,))))
        with pytest.raises(ucp.StorageFullError) as e:
            mgr.wait()
        assert "background snapshot/persist failed" in str(e.value)
        _check_failed_cleanly(disk, e.value, used, ["step_1"])
        _intact(disk.root / "step_1", 1.0)
        disk.unballast()
        mgr.snapshot(3, place(_tree(3.0), mesh_of((2,))))
        mgr.wait()
        _intact(disk.root / "step_3", 3.0)
    finally:
        mgr.close()


def test_orbax_checkpoint_manager_into_a_full_disk(disk: Disk) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    import ucp_jax.orbax as uo

    opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
    tree = place(_tree(1.0), mesh_of((2,)))
    with ocp.CheckpointManager(disk.root, options=opts) as mgr:
        mgr.save(1, args=uo.UniversalSave(tree))
        mgr.wait_until_finished()
        disk.ballast(leave=MiB)
        used = disk.used()
        with pytest.raises(ucp.StorageFullError) as e:
            mgr.save(2, args=uo.UniversalSave(place(_tree(2.0), mesh_of((2,)))))
            mgr.wait_until_finished()
        assert "disk is full" in str(e.value)
        assert disk.used() <= used + 64 * 1024
        assert mgr.all_steps() == [1]
        _intact(disk.root / "1" / "default", 1.0)
        disk.unballast()
        mgr.save(3, args=uo.UniversalSave(place(_tree(3.0), mesh_of((2,)))))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3]
    _intact(disk.root / "3" / "default", 3.0)


def test_import_into_a_full_disk(disk: Disk, tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from ucp_jax._src.frameworks.hf.safetensors import import_safetensors

    src = tmp_path / "m.safetensors"
    safetensors_numpy.save_file(_tree(1.0), src)
    disk.ballast(leave=MiB)
    used = disk.used()
    with pytest.raises(ucp.StorageFullError) as e:
        import_safetensors(src, disk.root / "imported")
    _check_failed_cleanly(disk, e.value, used, [])
    disk.unballast()
    out = import_safetensors(src, disk.root / "imported")
    assert np.array_equal(ucp.open(out).read("w"), _tree(1.0)["w"])


@pytest.mark.parametrize("kind", ["hf", "deepspeed-universal"])
def test_export_into_a_full_disk(disk: Disk, tmp_path: Path, kind: str) -> None:
    pytest.importorskip("torch")
    from ucp_jax._src.frameworks.deepspeed.export import export_deepspeed_universal
    from ucp_jax._src.frameworks.hf.export import export_hf
    from ucp_jax._src.frameworks.hf.safetensors import AtomFrom

    src = tmp_path / "src"
    ucp.save(src, _tree(1.0), step=1)

    def export(dst: Path, overwrite: bool = False) -> None:
        if kind == "hf":
            mapping = {"w": AtomFrom(("w.weight",)), "b": AtomFrom(("b.bias",))}
            export_hf(src, dst, mapping=mapping, config={"model_type": "x"}, overwrite=overwrite)
        else:
            export_deepspeed_universal(src, dst, overwrite=overwrite)

    export(disk.root / "old")  # an earlier export, to be kept when its overwrite fails
    before, names = sorted(os.listdir(disk.root / "old")), disk.names()
    disk.ballast(leave=MiB)
    used = disk.used()
    for dst, overwrite in ((disk.root / "new", False), (disk.root / "old", True)):
        with pytest.raises(ucp.StorageFullError) as e:
            export(dst, overwrite)
        _check_failed_cleanly(disk, e.value, used, names)
    assert sorted(os.listdir(disk.root / "old")) == before
    disk.unballast()
    export(disk.root / "new")
    assert "new" in os.listdir(disk.root)
