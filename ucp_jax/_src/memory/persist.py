"""Persist a snapshot as a universal checkpoint, from its host copy in shared memory.

The save is planned on the training thread (the same `binding.write_regions` as the snapshot, so
every region a process must write is one of its own pieces) and written later, in the
background, from the pieces' bytes in shared memory: the devices are never read again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import jax

from ..mapping.boxes import box_shape
from ..mapping.rules import Rule
from ..save import SaveJob
from .layout import SnapshotLayout
from .shm import Blob, blob_crc

log = logging.getLogger("ucp_jax")


def step_path(directory: Any, step: int) -> str:
    """Where the persisted checkpoint of `step` goes: `<directory>/step_<step>`."""
    d = os.fspath(directory)
    if "://" in d:
        return f"{d.rstrip('/')}/step_{step}"
    return os.path.join(d, f"step_{step}")


def make_job(directory: Any, step: int, params: Any, opt_state: Any, rules: tuple[Rule, ...],
             extra: Any = None, tag: str = "") -> SaveJob:  # fmt: skip
    """Plan the universal checkpoint of this step (every process plans it).

    `extra`: this process's encoded extra; every process's goes into the manifest (one
    key-value exchange, on the persisted steps only).
    """
    from .exchange import allgather_json
    from .extra import manifest_extra

    extras = allgather_json(extra, f"{tag}/extra-{step}") if tag else [extra]
    return SaveJob(step_path(directory, step), params, opt_state, step=step, rules=rules,
                   extra=manifest_extra(extras), overwrite=True)  # fmt: skip


def write(job: SaveJob, blob: Blob | None, layout: SnapshotLayout, node: int,
          crc32: int | None = None, tag: str = "", failed: str = "") -> bool:  # fmt: skip
    """Write this process's share of the checkpoint from the snapshot's bytes, then commit.

    Every process first checks its snapshot's bytes against `crc32`, the CRC-32 of its commit,
    and (with `tag`, several processes) all agree on the verdict: a snapshot damaged in shared
    memory since its commit is persisted by no process (its bytes would be sealed with fresh
    checksums and pass every later check), and every process goes on training alike (an error
    raised on some processes only would leave the others in the next collective). Logged as
    an error; the next persisted snapshot is written from fresh bytes.

    A process whose snapshot of the step failed (`failed` says why; no `blob`) takes part only
    to give that verdict: then no process persists the step, and none waits for it.

    Returns:
        Whether the checkpoint was written.
    """
    t0 = time.perf_counter()
    why = failed
    if blob is None:
        why = why or "no snapshot of this step"
    elif crc32 is not None and (got := blob_crc(blob.array)) != crc32:
        why = f"{blob.path} has CRC-32 {got:#010x}, not the {crc32:#010x} it was committed with"
    verdicts = [why]
    if tag and jax.process_count() > 1:
        from .exchange import allgather_json

        verdicts = allgather_json(why, f"{tag}/crc")
    bad = [(i, w) for i, w in enumerate(verdicts) if w]
    if bad:
        with contextlib.suppress(Exception):
            job.staging.release()
        log.error("ucp.memory: step %s not persisted (on any process): the snapshot of "
                  "process(es) %s failed or was damaged in shared memory since its commit (%s); "
                  "the next persisted snapshot is written from fresh bytes", job.manifest.step,
                  [i for i, _ in bad], bad[0][1])  # fmt: skip
        return False
    assert blob is not None
    by_key = {(layout.leaves[p.leaf].name, p.box): p for p in layout.by_node[node]}
    host = []
    for t in job.tasks:
        p = by_key.get((t.binding.name, t.box))
        if p is None:
            raise RuntimeError(
                f"persist: region {t.box} of {t.binding.name!r} is not a piece of node {node}'s "
                "snapshot; the snapshot and the save were planned differently"
            )
        dtype = layout.leaves[p.leaf].dtype
        host.append(blob.view(p.offset, p.nbytes).view(dtype).reshape(box_shape(p.box)))
    job.write(host)
    log.info(
        "ucp.memory: persisted step %s to %s in %.2f s (from shared memory)",
        job.manifest.step,
        job.loc.url,
        time.perf_counter() - t0,
    )
    return True


def remove_steps(directory: Any, steps: list[int]) -> None:
    """Delete the persisted checkpoints of `steps` (those a rollback left), where there are any."""
    from ..errors import NotACheckpointError
    from ..format.removal import delete_checkpoint

    for step in steps:
        try:
            delete_checkpoint(step_path(directory, step))
        except NotACheckpointError:
            continue
