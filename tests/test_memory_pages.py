"""Snapshot blobs on huge-page tmpfs: detection from mountinfo, and a real mount in a namespace.

Restoring maps the snapshot's pages; with 4 KiB pages that is ~0.1 s per GiB of page-table work,
with 2 MiB pages ~1 ms. Blobs ask for huge pages (a tmpfs mounted huge=advise needs the hint); the
worker mounts such a tmpfs in its own mount namespace and checks the pages really are 2 MiB, on
the side that wrote the snapshot and on the side that restored it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucp_jax._src.memory.shm import huge_pages, tmpfs_huge

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


def test_snapshots_on_a_huge_page_tmpfs_are_2mib_pages(tmp_path):
    if not Path("/sys/kernel/mm/transparent_hugepage").exists():
        pytest.skip("this kernel has no transparent huge pages")
    cmd = _namespace_command()
    if cmd is None:
        pytest.skip("cannot make a mount namespace here (not root, no user namespaces)")
    report = tmp_path / "report.json"
    worker = Path(__file__).parent / "mp" / "huge_pages_worker.py"
    proc = subprocess.run(
        [*cmd, sys.executable, str(worker), str(tmp_path / "mnt"), str(report)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["huge_pages"] is True
    assert r["source"] == "memory" and r["bitexact"] is True
    # The blob (8 MiB + 8 MiB + small) is mapped with 2 MiB entries when written and when restored.
    assert r["blob_bytes"] >= 16 << 20
    assert r["written_pmd_kib"] >= 12 << 10, r
    assert r["restored_pmd_kib"] >= 12 << 10, r
