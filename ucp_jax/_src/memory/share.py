"""Lost nodes rebuilt once per machine: the processes of a machine that need the same lost nodes
split the rebuild between them, each writes its share into the machine's shared memory, and every
one of them maps the result and checks it.

With weights replicated over processes (data parallel) every process of a restore reads all of a
lost node, so without this each one rebuilds it: p processes on a machine decode the same bytes
p times on the same cores. Instead:

1. `offer`: with its fetch requests (the same gather: no extra round), each process says which
   units of which lost group it needs (`RedundancyScheme.share_units`; rs2: the stripes it
   solves) and which machine it is on (the identity of its namespace folder: processes that see
   the same folder see each other's files);
2. `rebuild`: the processes of one machine that need a unit split it in process order (rs2: its
   columns), each solves its shares (`decode_share`) into `<root>/.rebuild-<nonce>/<node>`, one
   file per lost node that all of them write (each only its own columns), and says it is done
   through the coordination service;
3. each waits for the peers it shares a unit with (`UCP_REBUILD_SHARE_TIMEOUT_S`), maps the files
   read-only (restored arrays may map them, as they map snapshots: nothing is copied) and checks
   every lane it reads against the digests the group kept (`check_parts`), as a rebuild of its
   own would.

A peer that fails, does not say it is done in time, or wrote bytes that do not match the digests:
the process rebuilds the group alone (the usual `BlobReader` path, checked as always) and logs
why; it never restores wrong values. The files are unlinked once every process has checked its
restore (`cleanup`); their pages live on while restored arrays map them. What a process does is
proportional to what it reads: it solves a share of the units it needs and checks those.

Only schemes that keep digests share (rs2): `xor` keeps none, so a peer's wrong bytes would go
unnoticed. Nothing is shared across machines: each machine rebuilds on its own cores (in threads).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ..util import config
from . import exchange
from .blobs import Decoded
from .scheme_base import ParityMismatch
from .shm import Blob

if TYPE_CHECKING:
    from .blobs import BlobReader
    from .candidate import Candidate

log = logging.getLogger("ucp_jax")


def machine(root: Path) -> str:
    """Who sees the same files as this process: its machine's boot and its namespace folder (the
    same tmpfs and folder: device and inode).

    Raises:
        OSError: the folder is not there.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    st = os.stat(root)
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def offer(cand: Candidate, blobs: BlobReader, root: Path | None) -> dict[str, Any] | None:
    """What this process would share (JSON for the restore's gather): its machine, a nonce, and
    per lost group it reads (by its first lost node) the units it needs; None: nothing."""
    lay = cand.layout
    if root is None or jax.process_count() < 2 or lay.scheme is None or not blobs.want:
        return None
    groups: dict[str, list[Any]] = {}
    for n in sorted(blobs.want):
        lost = blobs.lost_with(n)
        if str(lost[0]) in groups:
            continue
        want = {m: blobs.want.get(m, []) for m in lost}
        units = lay.scheme.share_units(lay, lost, cand.present, want)
        if units:
            groups[str(lost[0])] = units
    if not groups:
        return None
    try:
        where = machine(root)
    except OSError:
        return None
    return {"machine": where, "nonce": uuid.uuid4().hex, "groups": groups}


def rebuild(
    cand: Candidate,
    blobs: BlobReader,
    offers: Sequence[dict[str, Any] | None],
    root: Path | None,
    tag: str,
    scratch: list[Path],
) -> list[str]:
    """Rebuild, with the peers on this machine that need them, the lost groups this process
    offered to share; the nodes rebuilt are put into `blobs`, the others are left to rebuild
    alone. A collective of the processes that offered (each calls it with everyone's offers).

    Returns:
        What happened, per group shared (for `RestoreInfo.rebuild`).
    """
    me = jax.process_index()
    mine = offers[me]
    if not mine or root is None:
        return []
    mates = {p: o for p, o in enumerate(offers) if o and o["machine"] == mine["machine"]}
    folder = root / f".rebuild-{mates[min(mates)]['nonce']}"  # (the same on every mate)
    notes = []
    for key, units in mine["groups"].items():
        parts, peers = [], set()
        for u in units:
            who = [p for p, o in mates.items() if u in o["groups"].get(key, [])]
            parts.append((u, who.index(me), len(who)))
            peers.update(who)
        peers.discard(me)
        if peers:  # (alone on its machine: the usual rebuild, when it reads them)
            notes.append(_group(cand, blobs, blobs.lost_with(int(key)), parts, sorted(peers),
                                folder, f"{tag}/{key}", scratch))  # fmt: skip
    return notes


def _group(
    cand: Candidate,
    blobs: BlobReader,
    lost: list[int],
    parts: list[tuple[Any, int, int]],
    peers: list[int],
    folder: Path,
    tag: str,
    scratch: list[Path],
) -> str:
    """One lost group's rebuild, shared with `peers`; what happened."""
    lay, me = cand.layout, jax.process_index()
    scheme = lay.scheme
    assert scheme is not None  # (offer: only with a scheme)
    paths = {n: folder / str(n) for n in lost}
    scratch.extend([*paths.values(), folder])
    status, others = "ok", {}
    try:
        others = {m: blobs[m] for m in lay.group_of[lost[0]] if m not in lost}
        folder.mkdir(exist_ok=True)
        maps = {n: _writable(paths[n], lay.primary[n]) for n in lost}
        try:
            out = {n: _array(m) for n, m in maps.items()}
            scheme.decode_share(lay, lost, others, parts, out)
            del out
        finally:
            for m in maps.values():
                if m is not None:
                    with contextlib.suppress(BufferError):
                        m.close()
    except Exception as e:  # said to the peers, who then rebuild alone at once
        status = f"process {me} failed to rebuild its share: {type(e).__name__}: {e}"
    exchange.publish_text(f"{tag}/{me}", status)
    if status != "ok":
        return _alone(lost, status)
    timeout = config.rebuild_share_timeout_s()
    deadline = time.monotonic() + timeout
    for p in peers:
        try:
            said = exchange.get_text(f"{tag}/{p}", max(deadline - time.monotonic(), 0.001))
        except Exception:  # the coordination client's deadline (its error type varies)
            return _alone(lost, f"process {p} did not say its share was done within {timeout:g} s"
                                " (UCP_REBUILD_SHARE_TIMEOUT_S)")  # fmt: skip
        if said != "ok":
            return _alone(lost, said)
    try:
        arrays = {n: _mapped(paths[n], lay.primary[n]) for n in lost}
    except (OSError, ValueError) as e:
        return _alone(lost, f"the shared rebuild cannot be read: {e}")
    want = {m: (blobs.want or {}).get(m, []) for m in lost}
    try:
        scheme.check_parts(lay, lost, others, want, arrays)
    except ParityMismatch as e:
        return _alone(lost, f"the shared rebuild does not match the digests: {e}")
    for n in lost:
        blobs.rebuilt(n, Decoded(arrays[n], want[n]))
    return f"node(s) {lost} rebuilt with process(es) {peers}"


def _alone(lost: list[int], why: str) -> str:
    log.warning("ucp.memory: rebuilding node(s) %s alone: %s", lost, why)
    return f"node(s) {lost} rebuilt alone: {why}"


def _writable(path: Path, nbytes: int) -> mmap.mmap | None:
    """The shared file of a lost node (created by the first mate to get there), mapped writable.

    No mate truncates what another wrote: the size is set only while it is smaller.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        if size > nbytes:
            raise ValueError(f"{path} holds {size} bytes, more than the node's {nbytes}")
        if size < nbytes:
            os.ftruncate(fd, nbytes)
        if not nbytes:
            return None
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _array(m: mmap.mmap | None) -> np.ndarray:
    return np.zeros(0, np.uint8) if m is None else np.frombuffer(m, np.uint8)


def _mapped(path: Path, nbytes: int) -> np.ndarray:
    """The shared rebuild of a node, mapped read-only."""
    blob = Blob.open(path)
    if blob.nbytes != nbytes:
        raise ValueError(f"{path} holds {blob.nbytes} bytes, not the node's {nbytes}")
    return blob.array


def cleanup(scratch: list[Path]) -> None:
    """Unlink a restore's shared rebuild files (every process that shared does, once all have
    checked their restore; mapped pages stay while mapped)."""
    for path in scratch:
        with contextlib.suppress(OSError):
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()
    scratch.clear()
