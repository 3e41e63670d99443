"""Recovery: find the newest step complete or decodable on every node, and place it on any mesh.

A step is usable when, for every node of the job that wrote it, the node's committed snapshot of
that step (same run, same layout) is visible, or its bytes can be rebuilt from its group
(`replica`: the next node keeps a copy; `xor`: every other member is there; `rs2`: at most two
members of its group are missing). A rebuilt node is checked against the digests its peers kept
of it (rs2); a mismatch (a stale or damaged parity) moves every process on to the next
recoverable step, never to wrong values. Before a step is read, every node's blob is checked
against the CRC-32 it was committed with (`integrity`): a damaged node counts as lost. A restarted job's
processes agree on the step (a collective); if there is none, they restore the newest persisted
universal checkpoint instead, and say so in the log.

Each process reads only the pieces its target devices need: pieces carry their global box, so
the target layout may be any mesh, including a smaller one after a node is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from ..errors import ChecksumError, NotACheckpointError, UcpError
from ..mapping.rules import Rule
from ..util.gcpause import gc_paused
from . import exchange, integrity, share
from . import extra as extra_mod
from .assemble import read_candidate
from .candidate import Candidate
from .layout import SnapshotLayout
from .scheme_base import ParityMismatch
from .shm import Blob, Entry, committed, list_nodes

log = logging.getLogger("ucp_jax")


@dataclasses.dataclass
class RestoreInfo:
    """What the last `SnapshotManager.restore` did.

    Attributes:
        step: the step restored.
        source: 'memory', 'redundancy' (some node decoded from its group) or 'persisted'.
        path: the persisted checkpoint, or the namespace folder.
        lost: nodes decoded from redundancy.
        seconds: wall time of the restore.
        reason: why memory was not used (for 'persisted').
        files: the snapshot files read (restored arrays may map them).
        fetched_bytes: bytes this process received from other processes (snapshots on
            machines it cannot see).
        copied_bytes: bytes this process copied to assemble regions; the rest of what it
            restored maps the snapshot's pages (on CPU devices: no copy at all).
        extra: this process's `extra` of the step restored (`snapshot(..., extra=...)`; rebuilt
            from its peers' when its node was lost), None when it gave none.
        rebuild: how lost nodes were rebuilt when the processes of this machine that read them
            shared the work (`share`): with which processes, or why this one rebuilt them alone
            after all; empty when nothing was shared.
    """

    step: int | None
    source: str
    path: str
    lost: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    reason: str = ""
    files: list[str] = dataclasses.field(default_factory=list)
    fetched_bytes: int = 0
    copied_bytes: int = 0
    extra: Any = None
    rebuild: str = ""


_layouts: dict[tuple[str, str], SnapshotLayout] = {}


def _layout(root: Path, digest: str) -> SnapshotLayout | None:
    for n in list_nodes(root):
        path = root / str(n) / "plans" / f"{digest}.json"
        key = (str(path), digest)
        if key in _layouts:
            return _layouts[key]
        try:
            text = path.read_text()
        except OSError:
            continue
        try:
            lay = SnapshotLayout.from_json(text)
        except (ValueError, KeyError, TypeError):
            continue
        if lay.digest == digest:
            _layouts[key] = lay
            return lay
    return None


def _local_entries(root: Path) -> dict[tuple[int, int, str], dict[int, Entry]]:
    """(run, step, layout digest) -> node -> committed snapshot, for the nodes seen here."""
    by_key: dict[tuple[int, int, str], dict[int, Entry]] = {}
    damaged: list[str] = []
    for n in list_nodes(root):
        for e in committed(root / str(n), damaged):
            if e.node == n:
                by_key.setdefault((e.run, e.step, e.plan), {})[n] = e
    for what in damaged:
        log.warning("in-memory snapshot %s", what)
    return by_key


def _select(
    present: dict[tuple[int, int, str], dict[int, list[int]]],
    layout_of: Any,
    local: dict[tuple[int, int, str], dict[int, Entry]],
) -> tuple[list[Candidate], list[str]]:
    """The recoverable steps, newest first, from who sees which node's snapshot; and why not."""
    out, why = [], []
    for (run, step, digest), nodes in sorted(present.items(), reverse=True):
        lay = layout_of((run, step, digest))
        if lay is None:
            why.append(f"step {step}: its layout {digest} is on no node")
            continue
        lost = [n for n in range(lay.nodes) if n not in nodes]
        bad = [n for n in lost if not _decodable(lay, n, nodes)]
        if bad:
            why.append(f"step {step}: {_undecodable(lay, bad, lost)}")
            continue
        entries = local.get((run, step, digest), {})
        out.append(
            Candidate(run, step, lay, entries, lost, {n: sorted(ps) for n, ps in nodes.items()})
        )
    return out, why


def scan(root: Path) -> tuple[list[Candidate], list[str]]:
    """Every step recoverable from what this process sees, newest first; and why others are not."""
    local = _local_entries(root)
    me = jax.process_index()
    present = {k: {n: [me] for n in ents} for k, ents in local.items()}
    return _select(present, lambda k: _layout(root, k[2]), local)


def agree(root: Path, tag: str) -> tuple[list[Candidate], list[str]]:
    """The recoverable steps from what *all* processes see (a collective), newest first.

    Every process sends its inventory (and publishes the layouts it holds); every process then
    computes the same candidates from their union, so a process on a machine that lost its
    shared memory still restores from memory, with bytes served by the others.
    """
    local = _local_entries(root)
    me = jax.process_index()
    mine: list[tuple[int, int, str, int]] = sorted(
        (run, step, digest, n) for (run, step, digest), ents in local.items() for n in ents
    )
    published = []
    if jax.process_count() > 1:
        for digest in sorted({d for _, _, d, _ in mine}):
            lay = _layout(root, digest)
            if lay is not None:
                exchange.publish_text(f"{tag}/layout/{me}/{digest}", lay.to_json())
                published.append(digest)
    everyone = exchange.allgather_json({"entries": mine, "layouts": published}, f"{tag}/inventory")
    present: dict[tuple[int, int, str], dict[int, list[int]]] = {}
    for proc, inv in enumerate(everyone):
        for run, step, digest, n in inv["entries"]:
            present.setdefault((run, step, digest), {}).setdefault(n, []).append(proc)

    def layout_of(key: tuple[int, int, str]) -> SnapshotLayout | None:
        lay = _layout(root, key[2])
        if lay is None:  # this process sees no node of that step: take the layout another holds
            src = [p for p, inv in enumerate(everyone) if key[2] in inv["layouts"]]
            if src:
                lay = SnapshotLayout.from_json(exchange.get_text(f"{tag}/layout/{src[0]}/{key[2]}"))
        return lay

    return _select(present, layout_of, local)


def _decodable(lay: SnapshotLayout, n: int, nodes: Any) -> bool:
    return lay.scheme is not None and lay.scheme.decodable(lay, n, nodes)


def _undecodable(lay: SnapshotLayout, bad: list[int], lost: list[int]) -> str:
    """Why: which nodes are lost in which group, and what the scheme rebuilds.

    >>> from types import SimpleNamespace as NS
    >>> from ucp_jax._src.memory.schemes import scheme_for
    >>> lay = NS(scheme=scheme_for("xor"), group_of={n: [0, 1, 2, 3] for n in range(4)})
    >>> _undecodable(lay, [1, 3], [1, 3])
    'node(s) [1, 3] lost in group [0, 1, 2, 3] (xor rebuilds any 1 lost node(s) of a group)'
    """
    out = []
    for g in sorted({tuple(lay.group_of[n]) for n in bad}):
        gone = [n for n in g if n in lost]
        if lay.scheme is None:
            out.append(f"node(s) {gone} lost (no redundancy)")
        else:
            t = lay.scheme.tolerance(len(g))
            out.append(f"node(s) {gone} lost in group {list(g)} ({lay.scheme.name} rebuilds "
                       f"any {t} lost node(s) of a group)")  # fmt: skip
    return "; ".join(out)


def candidates(root: Path) -> list[Candidate]:
    return scan(root)[0]


def newest_persisted(directory: Any) -> tuple[str, int] | None:
    """(path, step) of the newest committed universal checkpoint under `directory`."""
    return next(persisted(directory), None)


def persisted(directory: Any) -> Iterator[tuple[str, int]]:
    """(path, step) of the committed universal checkpoints under `directory`, newest first.

    An object store's listing comes from its index (format/index.py): a checkpoint deleted
    there by another tool keeps its entry until `ucp index` runs. Such a checkpoint is skipped
    with a warning, and the next newest is taken, rather than failing the recovery.
    """
    if directory is None:
        return
    from ..checkpoint import list_checkpoints, open_checkpoint

    found = []
    for path in list_checkpoints(directory):
        m = re.fullmatch(r"step_(\d+)", os.path.basename(str(path).rstrip("/")))
        if m is not None:
            found.append((int(m.group(1)), path))
    for step, path in sorted(found, key=lambda f: f[0], reverse=True):
        try:
            saved = open_checkpoint(path).step
        except NotACheckpointError as e:
            log.warning("skipping %s, listed but not a committed checkpoint (deleted by another "
                        "tool? `ucp index %s` rebuilds the listing): %s", path, directory, e)  # fmt: skip
            continue
        yield path, step if saved is None else int(saved)


@gc_paused()
def recover(
    root: Path,
    directory: Any,
    params_target: Any,
    opt_state_target: Any,
    rules: tuple[Rule, ...],
    tag: str,
) -> tuple[Any, Any, RestoreInfo]:
    """Restore from the newest step every process can recover from memory, else from disk.

    `tag` names this restore in the coordination service (the same on every process, unique).
    """
    t0 = time.perf_counter()
    cands, why = agree(root, tag)
    for i, chosen in enumerate(cands):
        sub = tag if i == 0 else f"{tag}/try{i}"
        opened: dict[int, Blob] = {}  # blobs mapped to check them, read from below
        damaged = integrity.agree_damaged(chosen, opened, sub)
        if damaged:
            chosen = integrity.without(chosen, damaged)
            log.warning("ucp.memory: step %d: node(s) %s fail their CRC-32 check (%s); counted "
                        "as lost", chosen.step, sorted(damaged),
                        "; ".join(f"node {n}: {w}" for n, w in sorted(damaged.items())))  # fmt: skip
            bad = [n for n in chosen.lost if not _decodable(chosen.layout, n, chosen.present)]
            if bad:
                for b in opened.values():
                    b.close()
                why.append(f"step {chosen.step}: node(s) {sorted(damaged)} damaged in shared "
                           f"memory; {_undecodable(chosen.layout, bad, chosen.lost)}")  # fmt: skip
                continue
        scratch: list[Path] = []  # a rebuild shared with the processes of this machine (`share`)
        try:
            try:
                params, opt, blobs = read_candidate(chosen, params_target, opt_state_target, sub,
                                                    root, scratch, opened)  # fmt: skip
                failed = None
            except ParityMismatch as e:  # a stale or damaged parity: never restore wrong values
                failed = str(e)
            # Every process restores the same step: one that failed a check makes all try the
            # next (here only a rebuilt node is checked, against its group's digests, and every
            # process knows whether one is; the blobs read as they are were checked above).
            # The same round carries the extras records a lost node's process rebuilds its from.
            said = {"failed": failed, "extras": extra_mod.seen(chosen) if chosen.lost else {}}
            checked = exchange.allgather_json(said, f"{sub}/checked") if chosen.lost else [said]
        finally:
            share.cleanup(scratch)  # (after the gather: every process has mapped what it reads)
        fails = [c["failed"] for c in checked if c["failed"]]
        if fails:
            log.warning("ucp.memory: step %d is not restorable from shared memory: %s",
                        chosen.step, fails[0])  # fmt: skip
            why.append(f"step {chosen.step}: {fails[0]}")
            continue
        fetched = sum(f.nbytes for f in blobs.fetched.values())
        source = "redundancy" if chosen.lost else "memory"
        info = RestoreInfo(chosen.step, source, str(root), chosen.lost, time.perf_counter() - t0)
        info.files = [str(f) for f in blobs.files]
        info.fetched_bytes, info.copied_bytes = fetched, blobs.copied
        info.extra = extra_mod.restored(
            chosen, tag, [c["extras"] for c in checked] if chosen.lost else None
        )
        info.rebuild = "; ".join(blobs.notes)
        detail = f", node(s) {chosen.lost} decoded from {chosen.layout.redundancy}" * bool(
            chosen.lost
        )
        if fetched:
            detail += f", {fetched / 2**20:.1f} MiB of it from other processes"
        log.info("ucp.memory: restored step %d from shared memory%s", chosen.step, detail)
        return params, opt, info
    reason = "; ".join(why) or f"no snapshot under {root} is committed on every process"
    from ..checkpoint import open_checkpoint
    from ..restore import restore as ucp_restore

    broken: list[str] = []
    for k, (path, step) in enumerate(persisted(directory)):
        if not k:
            log.warning("ucp.memory: no snapshot in shared memory is recoverable on every node "
                        "(%s); falling back to the persisted universal checkpoint %s (step %d)",
                        reason, path, step)  # fmt: skip
        error: Exception | None = None
        try:
            params, opt = ucp_restore(path, params_target, opt_state_target, rules=rules)
            told: dict[str, str] = {}
        except ChecksumError as e:  # damaged on disk: every process takes the one before it
            told = {"damaged": str(e)}
        except Exception as e:  # any other error ends the restore on every process (none
            told, error = {"error": f"{type(e).__name__}: {e}"}, e  # waits for it)
        gathered = exchange.allgather_json(told, f"{tag}/persisted{k}")
        if error is not None:
            raise error
        if others := [(i, g["error"]) for i, g in enumerate(gathered) if "error" in g]:
            raise UcpError(f"ucp.memory: process {others[0][0]} failed to restore the persisted "
                           f"checkpoint {path}: {others[0][1]}")  # fmt: skip
        fails = [g["damaged"] for g in gathered if "damaged" in g]
        if fails:
            log.warning("ucp.memory: the persisted checkpoint %s (step %d) is damaged (%s); "
                        "trying the one before it", path, step, fails[0])  # fmt: skip
            broken.append(f"{path}: {fails[0]}")
            continue
        info = RestoreInfo(step, "persisted", path, [], time.perf_counter() - t0, reason)
        info.extra = extra_mod.from_manifest(open_checkpoint(path).extra, jax.process_index())
        return params, opt, info
    raise NotACheckpointError(
        f"ucp.memory: nothing to restore: no recoverable snapshot in shared memory ({reason}) "
        + (f"and every persisted checkpoint under {directory} is damaged ({'; '.join(broken)})"
           if broken else f"and no persisted checkpoint under {directory}")
    )  # fmt: skip
