"""Snapshot pages: huge pages on tmpfs (detected from mountinfo, and real), a full tmpfs, and
slabs of two files mapped back to back into one array (`stitch`).

Restoring maps the snapshot's pages; with 4 KiB pages that is ~0.1 s per GiB of page-table work,
with 2 MiB pages ~1 ms. Blobs ask for huge pages (a tmpfs mounted huge=advise needs the hint); a
worker mounts such a tmpfs in its own mount namespace and checks the pages really are 2 MiB, on
the side that wrote the snapshot and on the side that restored it. Another mounts a tmpfs too
small for the snapshot: a clear error, not a SIGBUS, and nothing left behind.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mp.runner import worker_env

from ucp_jax._src.memory.shm import huge_pages, tmpfs_huge
from ucp_jax._src.memory.stitch import PAGE, can_stitch, stitch

ROOT = "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
SHM = "25 22 0:23 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw,size=24684092k{opts}\n"


@pytest.mark.parametrize(
    ("opts", "path", "enabled", "want"),
    [
        ("", "/dev/shm/ucp-x", "always within_size advise [never] deny force", False),
        (",huge=within_size", "/dev/shm/ucp-x", "", True),
        (",huge=always", "/dev/shm", "", True),
        (",huge=advise", "/dev/shm/a/b", "", True),
        (",huge=never", "/dev/shm/a", "", False),
        (",huge=within_size", "/dev/shmem/a", "", False),  # not under /dev/shm
        ("", "/dev/shm/a", "always within_size advise never deny [force]", True),
        (",huge=always", "/dev/shm/a", "always within_size advise never [deny] force", False),
    ],
)
def test_tmpfs_huge_reads_the_mount_of_the_folder(opts, path, enabled, want):
    assert tmpfs_huge(ROOT + SHM.format(opts=opts), path, enabled) is want


def test_tmpfs_huge_takes_the_innermost_and_latest_mount():
    info = ROOT + SHM.format(opts=",huge=always")
    over = "40 25 0:50 / /dev/shm/data rw - ext4 /dev/vdb rw\n"
    assert tmpfs_huge(info + over, "/dev/shm/data/ucp-x") is False  # a disk mounted inside
    assert tmpfs_huge(info + over, "/dev/shm/other") is True
    again = "41 25 0:51 / /dev/shm rw - tmpfs tmpfs rw\n"  # mounted over /dev/shm later
    assert tmpfs_huge(info + again, "/dev/shm/x") is False
    spaced = "42 22 0:52 / /mnt/my\\040shm rw - tmpfs tmpfs rw,huge=advise\n"
    assert tmpfs_huge(ROOT + spaced, "/mnt/my shm/ucp-x") is True
    assert tmpfs_huge(ROOT, "/dev/shm/x") is False  # ext4 root
    assert tmpfs_huge("garbage\n\n", "/x") is False


def test_huge_pages_of_this_machine_agrees_with_st_blksize(tmp_path):
    # A tmpfs with huge=always/within_size reports 2 MiB blocks for its files (advise reports 4 KiB).
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    os.truncate(probe, 4 << 20)
    if os.stat(probe).st_blksize == 2 << 20:
        assert huge_pages(tmp_path)
    assert isinstance(huge_pages("/dev/shm"), bool)


def _namespace_command() -> list[str] | None:
    """A command prefix that runs a process in a new mount namespace where it may mount a tmpfs."""
    for cmd in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        try:
            ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return cmd
    return None


def _in_tmpfs(tmp_path: Path, mode: str) -> dict:
    """Run tests/mp/tmpfs_worker.py MODE in a mount namespace of its own; its report."""
    cmd = _namespace_command()
    if cmd is None:
        pytest.skip("cannot make a mount namespace here (not root, no user namespaces)")
    report = tmp_path / "report.json"
    worker = Path(__file__).parent / "mp" / "tmpfs_worker.py"
    proc = subprocess.run(
        [*cmd, sys.executable, str(worker), mode, str(tmp_path / "mnt"), str(report)],
        env=worker_env(8), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(report.read_text())


def test_snapshots_on_a_huge_page_tmpfs_are_2mib_pages(tmp_path):
    if not Path("/sys/kernel/mm/transparent_hugepage").exists():
        pytest.skip("this kernel has no transparent huge pages")
    r = _in_tmpfs(tmp_path, "huge")
    assert r["huge_pages"] is True
    assert r["source"] == "memory" and r["bitexact"] is True
    # The blob (8 MiB + 8 MiB + small) is mapped with 2 MiB entries when written and when restored.
    assert r["blob_bytes"] >= 16 << 20
    assert r["written_pmd_kib"] >= 12 << 10, r
    assert r["restored_pmd_kib"] >= 12 << 10, r


def test_a_full_tmpfs_is_a_clear_error_and_leaves_nothing(tmp_path):
    r = _in_tmpfs(tmp_path, "full")
    assert r["errno"] == errno.ENOSPC, r
    assert "no room for a 16.0 MiB snapshot" in r["error"] and "keep fewer snapshots" in r["error"]
    assert r["latest"] is None
    assert not any(f.endswith("data.bin") for f in r["files"]), r["files"]
    assert r["free_after"] >= r["total"] - (1 << 20), r  # the pages it got were given back


def test_a_tmpfs_too_small_for_the_commit_leaves_no_torn_snapshot(tmp_path):
    """Room for a snapshot's data but not its commit (or not even the data): each snapshot fails
    with ENOSPC saying so, and nothing torn stays to take the room; once the tmpfs grows, the
    same manager snapshots again."""
    r = _in_tmpfs(tmp_path, "tight")
    for err, files in zip(r["errors"], r["files"]):
        assert err is not None and err[1] == errno.ENOSPC, r
        assert "no room" in err[0] and "keep=K needs room for K + 1" in err[0], err
        assert not any(f.endswith("data.bin") or "COMMIT" in f for f in files), files
    assert r["latest"] == 3


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_stitch_maps_ranges_of_two_files_back_to_back(tmp_path):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 255, 5 * PAGE, np.uint8), rng.integers(0, 255, 3 * PAGE, np.uint8)
    (tmp_path / "a").write_bytes(a.tobytes())
    (tmp_path / "b").write_bytes(b.tobytes())
    parts = [(tmp_path / "a", PAGE, 2 * PAGE), (tmp_path / "b", 0, PAGE), (tmp_path / "a", 0, 100)]
    assert can_stitch(parts)
    arr = stitch(parts)
    assert not arr.flags.writeable
    assert arr.tobytes() == a[PAGE : 3 * PAGE].tobytes() + b[:PAGE].tobytes() + a[:100].tobytes()
    view = arr.view(np.float32)[1:]  # a view of it, as a restore hands to device_put
    addr = arr.ctypes.data
    assert addr % PAGE == 0 and _mapped(addr)
    del arr
    gc.collect()
    assert _mapped(addr)  # the view keeps the mapping
    assert view.size == (3 * PAGE + 100) // 4 - 1
    del view
    gc.collect()
    assert not _mapped(addr)


def test_stitch_needs_page_aligned_starts_and_whole_pages(tmp_path):
    f = tmp_path / "f"
    assert not can_stitch([(f, 64, PAGE), (f, 2 * PAGE, 10)])  # a start off a page
    assert not can_stitch([(f, 0, PAGE + 64), (f, 2 * PAGE, 10)])  # a middle part not whole pages
    assert not can_stitch([(f, 0, PAGE)])  # one part: a plain view does
    assert can_stitch([(f, 0, PAGE), (f, 2 * PAGE, 10)])
