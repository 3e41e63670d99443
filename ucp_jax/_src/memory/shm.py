"""Per-node shared-memory snapshot store: one folder per node, one blob per step, COMMIT last.

    <shm_dir>/ucp-<namespace>/<node>/          node = jax.process_index() of the job that wrote it
        plans/<hash>.json      the snapshot layout (every node keeps the whole job's layout)
        step_<n>/data.bin      this node's bytes: its own pieces, then its redundancy bytes
        step_<n>/index.json    {"format", "step", "run", "plan", "node", "nbytes", "crc32"[,
                               "extra", "extra_kept"]} (crc32: of data.bin as committed; its
                               extra, what it keeps of its peers')
        step_<n>/COMMIT        written last (holds the crc32 of index.json); without it the
                               folder is a torn snapshot and is ignored
        .free/                 retired blobs kept for the next snapshot (no fresh page faults)

The files live in tmpfs, outside the trainer: a SIGKILLed trainer's committed snapshots survive,
and a restarted job reattaches by namespace. Deleting a node folder is how a node is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import mmap
import os
import re
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from zlib_ng import zlib_ng

FORMAT = "ucp-mem/1"
DEFAULT_SHM_DIR = "/dev/shm"
COMMIT = "COMMIT"
INDEX = "index.json"
DATA = "data.bin"
_STEP_RE = re.compile(r"step_(\d+)")


def namespace_root(namespace: str, shm_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding every node's snapshots of one job namespace."""
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", namespace):
        raise ValueError(
            f"namespace {namespace!r} must be letters, digits, '_', '-' or '.' (it names a folder)"
        )
    return Path(shm_dir or DEFAULT_SHM_DIR) / f"ucp-{namespace}"


@dataclasses.dataclass(frozen=True)
class Entry:
    """A committed snapshot of one node.

    Attributes:
        node: the process index that wrote it.
        step: the training step.
        run: id of the job run that wrote it (newer runs have larger ids).
        plan: hash of the layout it follows (plans/<hash>.json).
        nbytes: size of data.bin.
        path: its folder.
        crc32: the CRC-32 of data.bin as committed (`blob_crc`); None for a snapshot written
            without one.
    """

    node: int
    step: int
    run: int
    plan: str
    nbytes: int
    path: Path
    crc32: int | None = None

    @property
    def key(self) -> tuple[int, int]:
        """Order of snapshots: newest run first, then newest step."""
        return (self.run, self.step)


def read_entry(path: Path, why: list[str] | None = None) -> Entry | None:
    """The committed snapshot in `path`, or None when it is torn (no COMMIT, or a stale one).

    A folder whose COMMIT matches its index.json but whose index or data.bin is then wrong was
    damaged after it committed: None too, with what is wrong appended to `why` (a restore logs
    it; a torn folder is a snapshot cut short by a kill and says nothing).
    """
    try:
        commit = (path / COMMIT).read_text().strip()
    except OSError:
        return None
    try:
        raw = (path / INDEX).read_bytes()
    except OSError as e:
        _damaged(why, path, f"its {INDEX} cannot be read ({e.strerror or e})")
        return None
    if commit != f"{FORMAT} {zlib.crc32(raw):08x}":
        if commit.startswith(f"{FORMAT} "):
            _damaged(why, path, f"its {INDEX} does not match the CRC-32 in {COMMIT}")
        return None
    try:
        d = json.loads(raw)
        crc = d.get("crc32")
        entry = Entry(int(d["node"]), int(d["step"]), int(d["run"]), str(d["plan"]),
                      int(d["nbytes"]), path, None if crc is None else int(crc, 16))  # fmt: skip
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        _damaged(why, path, f"its {INDEX} is not a snapshot index ({type(e).__name__}: {e})")
        return None
    if d.get("format") != FORMAT:
        return None
    try:
        size = (path / DATA).stat().st_size
    except OSError as e:
        _damaged(why, path, f"its {DATA} cannot be read ({e.strerror or e})")
        return None
    if size != entry.nbytes:
        _damaged(why, path, f"its {DATA} holds {size} bytes, its {INDEX} says {entry.nbytes}")
        return None
    return entry


def _damaged(why: list[str] | None, path: Path, what: str) -> None:
    if why is not None:
        why.append(f"{path}: committed, but {what}; the node counts as lost there")


def list_nodes(root: Path) -> list[int]:
    """Node folders under a namespace root (named `str(node)`: other entries are not nodes).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     for n in ("1", "0", "\u00b2", "07", "x"):
    ...         (Path(d) / n).mkdir()
    ...     list_nodes(Path(d))
    [0, 1]
    """
    try:
        return sorted(
            int(n) for n in os.listdir(root) if n.isascii() and n.isdecimal() and n == str(int(n))
        )
    except OSError:
        return []


def committed(node_dir: Path, why: list[str] | None = None) -> list[Entry]:
    """Committed snapshots of one node folder, newest first (damage found goes to `why`)."""
    out = []
    try:
        names = os.listdir(node_dir)
    except OSError:
        return []
    for n in names:
        if _STEP_RE.fullmatch(n):
            e = read_entry(node_dir / n, why)
            if e is not None:
                out.append(e)
    return sorted(out, key=lambda e: e.key, reverse=True)


_CRC_CHUNK = 1 << 28


def blob_crc(data: np.ndarray) -> int:
    """The CRC-32 of a uint8 array's bytes (a snapshot's blob, rs2's lanes): zlib's CRC-32,
    computed by zlib-ng (carry-less multiplication: ~35 GB/s on one core, the same values), in
    chunks (no length limit); a strided view is copied first.

    >>> import zlib
    >>> blob_crc(np.frombuffer(b"snapshot", np.uint8)) == zlib.crc32(b"snapshot")
    True
    """
    data = np.ascontiguousarray(data).reshape(-1)
    crc = 0
    for at in range(0, data.size, _CRC_CHUNK):
        crc = zlib_ng.crc32(data[at : at + _CRC_CHUNK].data, crc)
    return int(crc)


class Blob:
    """A data file mapped into memory, seen as a flat uint8 array."""

    def __init__(self, path: Path, nbytes: int, mm: mmap.mmap | None) -> None:
        self.path = path
        self.nbytes = nbytes
        self._mm = mm
        self.array = np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.zeros(0, np.uint8)

    @classmethod
    def create(cls, path: Path, nbytes: int) -> Blob:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = _map_new(fd, nbytes, path) if nbytes else None
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)  # give back the pages it got
            raise
        finally:
            os.close(fd)
        return cls(path, nbytes, mm)

    @classmethod
    def open(cls, path: Path, *, write: bool = False) -> Blob:
        fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
        try:
            nbytes = os.fstat(fd).st_size
            mm = None
            if nbytes:
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # map pages in bulk
                mm = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
        finally:
            os.close(fd)
        return cls(path, nbytes, mm)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) (no copy)."""
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap (a no-op while numpy views of it are alive: they keep the mapping)."""
        self.array = np.zeros(0, np.uint8)
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not in Python's mmap module


def _map_new(fd: int, nbytes: int, path: Path) -> mmap.mmap:
    """Map a new file writable with its pages allocated, as 2 MiB pages where the tmpfs allows.

    The huge-page hint comes before any page exists (a tmpfs mounted with huge=advise needs it;
    always/within_size mounts need nothing, never mounts ignore it). A snapshot restored from
    2 MiB pages maps in ~1 ms per GiB instead of ~0.1 s with 4 KiB pages. Every page is allocated
    here, so a full tmpfs is an error now rather than a SIGBUS in the middle of a copy.

    Raises:
        OSError: ENOSPC when the tmpfs has no room for `nbytes`.
    """
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    try:
        try:
            mm.madvise(_MADV_POPULATE_WRITE)  # allocate every page now (EFAULT: no room)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise _no_room(fd, path, nbytes) from e
            try:  # kernels before 5.14: allocate, then map each page
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e2:
                raise _no_room(fd, path, nbytes) from e2
            np.frombuffer(mm, np.uint8)[:: mmap.PAGESIZE] = 0
    except BaseException:
        mm.close()
        raise
    return mm


_ROOM_FIX = (
    "keep fewer snapshots (keep=; keep=K needs room for K + 1), free old namespaces "
    "(SnapshotManager.free), or give the tmpfs more room (mount -o remount,size=...)"
)


def _no_room(fd: int, path: Path, nbytes: int) -> OSError:
    st = os.statvfs(path.parent)
    got = os.fstat(fd).st_blocks * 512  # given back when the file is removed
    free, total = st.f_bavail * st.f_frsize + got, st.f_blocks * st.f_frsize
    return OSError(
        errno.ENOSPC,
        f"ucp.memory: no room for a {nbytes / 2**20:.1f} MiB snapshot in {path.parent.parent} "
        f"({free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB); {_ROOM_FIX}",
    )


def huge_pages(folder: str | os.PathLike[str]) -> bool:
    """Whether files created in `folder` get 2 MiB pages (a tmpfs mounted with huge=...).

    >>> huge_pages("/dev/shm")  # doctest: +SKIP
    False
    """
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    try:
        enabled = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        enabled = ""
    return tmpfs_huge(mountinfo, os.path.realpath(folder), enabled)


def tmpfs_huge(mountinfo: str, path: str, shmem_enabled: str = "") -> bool:
    """Whether `path` lies on a tmpfs whose files get huge pages, from /proc/self/mountinfo text.

    The mount is the last one whose mount point is the longest prefix of `path`; a tmpfs with
    huge=always, within_size or advise (snapshot blobs ask for them) qualifies; the sysfs
    shmem_enabled setting "[force]" turns huge pages on for every tmpfs, "[deny]" off.
    """
    if "[deny]" in shmem_enabled:
        return False
    best: tuple[int, str, str] | None = None
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), rest[0], rest[2])
    if best is None or best[1] != "tmpfs":
        return False
    if "[force]" in shmem_enabled:
        return True
    opts = dict(o.partition("=")[::2] for o in best[2].split(","))
    return opts.get("huge", "never") in ("always", "within_size", "advise")


class Writer:
    """A snapshot being written into `<node>/step_<n>/`; `commit()` publishes it."""

    def __init__(self, store: NodeStore, path: Path, blob: Blob, index: dict[str, Any]) -> None:
        self.store, self.path, self.blob, self.index = store, path, blob, index
        # what is still to be written into its redundancy area: (offset in it, source bytes,
        # XOR?); see `redundancy.copy_out` and `xor_fill`; None once it is written
        self.xors: list[tuple[int, Any, bool]] | None = []

    def commit(self) -> Entry:
        """Write index.json (with the CRC-32 of the blob as it is now, which a restore checks
        before it reads the blob), then COMMIT (the crc32 of index.json): from here on the
        snapshot counts."""
        self.index["crc32"] = f"{blob_crc(self.blob.array):08x}"
        raw = json.dumps(self.index, sort_keys=True).encode()
        try:
            _atomic_write(self.path / INDEX, raw)
            _atomic_write(self.path / COMMIT, f"{FORMAT} {zlib.crc32(raw):08x}\n".encode())
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.blob.close()  # the torn snapshot gives its room back now (no spare kept)
            shutil.rmtree(self.path, ignore_errors=True)
            st = os.statvfs(self.path.parent)
            raise OSError(
                e.errno,
                f"ucp.memory: no room to commit the snapshot {self.path} (its index: "
                f"{st.f_bavail * st.f_frsize / 2**20:.1f} MiB free of "
                f"{st.f_blocks * st.f_frsize / 2**20:.1f} MiB once it was removed); {_ROOM_FIX}",
            ) from e
        self.store.live[self.path] = self.blob
        entry = read_entry(self.path)
        assert entry is not None, self.path
        return entry


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class NodeStore:
    """This node's snapshot folder: begin/commit snapshots, retire old ones, recycle blobs."""

    def __init__(self, root: Path, node: int) -> None:
        self.root = root
        self.node = node
        self.dir = root / str(node)
        self.live: dict[Path, Blob] = {}  # committed snapshots this process mapped
        self._pool: list[Blob] = []  # retired blobs, mapped, for reuse
        self.intact: set[Path] = set()  # data files never to be rewritten in place (restored from)
        self._cleaned = False

    def ensure(self) -> None:
        """Create the node folder; drop spare blobs a killed process left behind."""
        (self.dir / "plans").mkdir(parents=True, exist_ok=True)
        if not self._cleaned:
            self._cleaned = True
            shutil.rmtree(self.dir / ".free", ignore_errors=True)

    def write_plan(self, digest: str, text: str) -> None:
        """Store a layout once (every node keeps every layout it wrote snapshots with)."""
        self.ensure()
        path = self.dir / "plans" / f"{digest}.json"
        if not path.exists():
            _atomic_write(path, text.encode())

    def begin(self, step: int, index: dict[str, Any], nbytes: int) -> Writer:
        """Start writing step `step` (a previous folder of that step is replaced)."""
        self.ensure()
        path = self.dir / f"step_{step}"
        if path.exists():
            self._drop(path)
        path.mkdir()
        blob = next((b for b in self._pool if b.nbytes == nbytes), None)
        try:
            if blob is not None:
                self._pool.remove(blob)  # reused, or gone: not offered again either way
                try:
                    os.rename(blob.path, path / DATA)
                    blob.path = path / DATA
                except OSError:  # the spare's file was removed under us (another manager of
                    blob.close()  # this namespace starting, a /dev/shm cleaner): a new one
                    blob = None
            if blob is None:
                blob = Blob.create(path / DATA, nbytes)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return Writer(self, path, blob, index)

    def retire(self, keep: int, pinned: set[Path] = frozenset()) -> list[Path]:  # type: ignore[assignment]
        """Free committed snapshots beyond the newest `keep` (not `pinned` ones) and torn ones.

        Torn folders (no COMMIT) are removed too, except `pinned` (a snapshot being written).
        Returns the folders removed.
        """
        entries = committed(self.dir)
        gone = [e.path for e in entries[keep:] if e.path not in pinned]
        good = {e.path for e in entries}
        try:
            names = os.listdir(self.dir)
        except OSError:
            names = []
        for n in names:
            p = self.dir / n
            if _STEP_RE.fullmatch(n) and p not in good and p not in pinned:
                gone.append(p)
        for p in gone:
            self._drop(p)
        return gone

    def drop_newer(self, entry: Entry, pinned: set[Path] = frozenset()) -> list[Entry]:  # type: ignore[assignment]
        """Free the committed snapshots newer than `entry` (a later step of its run): a snapshot
        of an earlier step than the newest means the run rolled back, and those belong to the
        trajectory it left. Returns them."""
        gone = [e for e in committed(self.dir) if e.key > entry.key and e.path not in pinned]
        for e in gone:
            self._drop(e.path)
        return gone

    def _drop(self, path: Path) -> None:
        """Remove a step folder; keep its blob mapped for reuse (one spare at most)."""
        blob = self.live.pop(path, None)
        if blob is not None and blob.path in self.intact:
            blob.close()  # unlinked below; mappings of it stay valid
        elif blob is not None and not self._pool and blob.nbytes:
            spare = self.dir / ".free" / f"{uuid.uuid4().hex}.bin"
            spare.parent.mkdir(exist_ok=True)
            try:
                os.rename(blob.path, spare)
                blob.path = spare
                self._pool.append(blob)
            except OSError:
                blob.close()
        elif blob is not None:
            blob.close()
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Unmap everything and delete the spare blobs (committed snapshots stay)."""
        for b in self._pool:
            b.close()
            with contextlib.suppress(OSError):
                os.unlink(b.path)
        self._pool.clear()
        for b in self.live.values():
            b.close()
        self.live.clear()

    def free(self) -> None:
        """Delete this node's whole folder (all its snapshots)."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.root.rmdir()  # only when no other node folder is left
