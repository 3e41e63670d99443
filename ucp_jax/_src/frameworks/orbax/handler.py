"""Orbax integration: universal checkpoints saved and restored through `ocp.CheckpointManager`.

    import orbax.checkpoint as ocp
    import ucp_jax as ucp
    import ucp_jax.orbax  # registers the handler with Orbax

    mngr = ocp.CheckpointManager("/ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=3))
    mngr.save(step, args=ucp.orbax.UniversalSave(params, opt_state))
    params, opt_state = mngr.restore(mngr.latest_step(), args=ucp.orbax.UniversalRestore(
        params_target, opt_state_target, rules=rules))

Where the checkpoint lives. The item folder Orbax gives the handler *is* a universal checkpoint:

    <root>/<step>/<item>/manifest.json      the universal manifest (atoms, slots, patterns, ...)
    <root>/<step>/<item>/atoms/<atom>/<slot> one zarr3 array each (crc32c chunks)
    <root>/<step>/<item>/COMMIT             the universal commit marker
    <root>/<step>/<item>/commit_success.txt Orbax's own marker; <root>/<step>/_CHECKPOINT_METADATA

`<item>` is `default` when the manager saves `UniversalSave` alone, and the `Composite` key (e.g.
`state`) otherwise, so `ucp.open("<root>/<step>/default")`, `ucp.restore(...)` and
`ucp inspect <root>/<step>/default` work on a step Orbax saved, and any other tool sees atoms.

How a save runs (Orbax's async protocol; the ucp save plan is the one `ucp.save` uses):

1. `async_save`, on every process, before it returns: plan the save (identical on every process)
   and copy this process's distinct shards device -> host. The trainer may then change or donate
   its arrays.
2. The commit future Orbax waits on, in the background: process 0 creates the arrays, every
   process writes its own shards straight into Orbax's temporary item folder, process 0 writes
   `manifest.json`. An error here is raised by Orbax (`wait_until_finished`, or the next `save`).
3. `finalize`, which Orbax calls on its primary host once every process has written and before it
   renames its temporary folders: writes `COMMIT`. Orbax then publishes the step.

So an item folder holds `COMMIT` only in a step Orbax has finalized (or is finalizing); a save
killed at any point leaves an `*.orbax-checkpoint-tmp*` folder that Orbax never lists as a step
and that `ucp.open` refuses, and the previous step stays `latest_step()`.

`mngr.item_metadata(step)` is a `ucp.Checkpoint` (its `.atoms`: shape, dtype, slots, pattern;
`.step`, `.extra`), read from `manifest.json` alone. As for any Orbax handler, a manager that has
not saved or restored this item yet must name the handler to get it:
`ocp.CheckpointManager(root, item_handlers=UniversalCheckpointHandler())` (or a dict per item).
The manifest's step is `UniversalSave(step=...)`, else the step folder's number (`<step>` or
`<prefix>_<step>`) of a manager's step, else None (an item saved on its own by
`ocp.Checkpointer(handler).save(path)` has no step folder, whatever its parent is named). `restore` returns `UniversalState(params, opt_state)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import orbax.checkpoint as ocp

from ... import save as save_mod
from ...checkpoint import Checkpoint
from ...errors import NotACheckpointError
from ...format import commit, store
from ...format.folders import ORBAX_CHECKPOINT_METADATA
from ...format.manifest import MANIFEST, Manifest
from ...mapping.rules import Rule
from ...restore import restore as ucp_restore

_TMP_SUFFIX = ".orbax-checkpoint-tmp"


class UniversalState(NamedTuple):
    """What `UniversalRestore` returns: unpacks as `params, opt_state = ...`."""

    params: Any
    opt_state: Any


class _InPlace:
    """The commit protocol inside Orbax: write into Orbax's (temporary) item folder as it is.

    Orbax creates, renames and cleans that folder itself; ucp writes the arrays and the manifest
    there (the `staging` of `SaveJob`), and `UniversalCheckpointHandler.finalize` adds `COMMIT`.
    """

    def __init__(self, loc: store.Location) -> None:
        self.target = loc

    def check(self) -> None:
        """Nothing to refuse: Orbax decides whether a step may be (over)written."""

    def prepare(self) -> None:
        """Nothing to clear: Orbax made the folder fresh for this save."""

    def commit(self, manifest: Manifest) -> None:
        """Process 0, after every process wrote: the manifest only (COMMIT comes at finalize)."""
        self.target.write(MANIFEST, commit.seal(self.target, manifest))


def _step_from_directory(directory: Any) -> int | None:
    """The step of a CheckpointManager step folder (`<root>/<step>/<item>`), when it has one.

    The folder is `<step>` or `<prefix>_<step>` (`step_prefix`), as Orbax names it, with
    `.orbax-checkpoint-tmp-<n>` while a renaming save writes it; a save that commits in place
    (`CommitFileTemporaryPath`, Orbax's way on GCS and S3) writes into the final name.

    >>> _step_from_directory("/ck/step_12/default"), _step_from_directory("/ck/7/default")
    (12, 7)
    >>> _step_from_directory("/ck/step_3.orbax-checkpoint-tmp-1/default"), _step_from_directory("/ck/x/default")
    (3, None)
    """
    parent = os.path.basename(os.path.dirname(os.fspath(directory).rstrip("/")))
    name = parent.partition(_TMP_SUFFIX)[0]
    m = re.fullmatch(r"(?:.*_)?(\d+)", name)
    return int(m.group(1)) if m else None


def _saved_alone(directory: str) -> bool:
    """Whether Orbax saves this item on its own (`ocp.Checkpointer(handler).save(path)`), not as
    an item of a CheckpointManager's step: a Checkpointer writes its `_CHECKPOINT_METADATA` into
    the folder it saves before the handler runs, where a manager writes it into the step folder,
    so the parent folder's name is no step (`/runs/exp_2024/final` is not step 2024)."""
    return store.Location.parse(directory).exists(ORBAX_CHECKPOINT_METADATA)


def in_place_job(directory: Any, args: Any) -> save_mod.SaveJob:
    """The `SaveJob` of a save into Orbax's own temporary step folder (written in place: Orbax
    renames and finalizes it), from `UniversalSave`-like `args` (params, opt_state, step, rules,
    extra); the step, when not given, from the folder's name."""
    path = os.fspath(directory)
    step = args.step
    if step is None and not _saved_alone(path):
        step = _step_from_directory(path)
    return save_mod.SaveJob(
        path,
        args.params,
        args.opt_state,
        step=step,
        rules=args.rules,
        extra=args.extra,
        overwrite=True,
        staging=_InPlace(store.Location.parse(path)),
    )


async def _write(job: save_mod.SaveJob, host: list[Any]) -> None:
    job.write(host)


async def _nothing() -> None:
    return None


def settle_directory_creation() -> None:
    """Before a save error propagates: let Orbax finish creating this save's folders.

    Orbax starts creating the step's temporary folders in the background before it calls
    `async_save`; when `async_save` raises, nothing waits for them, and a `close()` right after
    makes that creation fail, leaving an Orbax thread blocked on its signal for the coordination
    timeout (minutes at interpreter exit). Waiting here for the signals of this save's contract
    leaves Orbax as a finished save would.
    """
    with contextlib.suppress(Exception):  # the save's own error is the one to report
        ocp.future.CommitFutureAwaitingContractedSignals(_nothing(), name="ucp_failed").result()


class UniversalCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
    """Orbax handler that saves a train state as a universal checkpoint (atoms + manifest).

    Use it through `UniversalSave` / `UniversalRestore` in `ocp.CheckpointManager` (alone or in
    `ocp.args.Composite`) or `ocp.AsyncCheckpointer(UniversalCheckpointHandler())`. Restores go
    onto any mesh: each process reads only the regions its devices need.
    """

    def _start(self, directory: Any, args: UniversalSave) -> list[Any]:
        """Plan, copy this process's shards to host, start the write; return the commit future."""
        if not isinstance(args, UniversalSave):
            raise TypeError(
                f"UniversalCheckpointHandler saves ucp.orbax.UniversalSave(...), got "
                f"{type(args).__name__}; pass args=ucp.orbax.UniversalSave(params, opt_state)"
            )
        try:
            job = in_place_job(directory, args)
            host = job.copy_all_to_host()
        except BaseException:
            settle_directory_creation()
            raise
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(_write(job, host), name="ucp_save")
        ]

    async def async_save(self, directory: Any, args: UniversalSave | None = None) -> list[Any]:
        """Copy to host now; return the future that writes the arrays and the manifest."""
        if args is None:
            raise ValueError("UniversalCheckpointHandler.async_save needs args=UniversalSave(...)")
        return self._start(directory, args)

    def save(self, directory: Any, args: UniversalSave | None = None) -> None:
        """Blocking save (the arrays and the manifest; `finalize` writes COMMIT)."""
        if args is None:
            raise ValueError("UniversalCheckpointHandler.save needs args=UniversalSave(...)")
        for f in self._start(directory, args):
            f.result()

    def finalize(self, directory: Any) -> None:
        """Write COMMIT (Orbax's primary host, after every process finished writing)."""
        loc = store.Location.parse(os.fspath(directory))
        data = loc.read(MANIFEST)
        if data is None:
            raise NotACheckpointError(
                f"{loc.url}: finalize called but manifest.json is missing; the universal save "
                "into this folder did not finish"
            )
        commit.write_commit(loc, data, listed=False)  # Orbax lists its own steps

    def restore(self, directory: Any, args: UniversalRestore | None = None) -> UniversalState:
        """Restore onto the targets' shardings (any mesh); `rules` when the layout changed."""
        if args is None or not isinstance(args, UniversalRestore):
            raise ValueError(
                "UniversalCheckpointHandler.restore needs args=ucp.orbax.UniversalRestore("
                "params_target, opt_state_target, rules=...): the targets give the mesh"
            )
        params, opt_state = ucp_restore(
            os.fspath(directory),
            args.params_target,
            args.opt_state_target,
            rules=args.rules,
            cast=args.cast,
        )
        return UniversalState(params, opt_state)

    def metadata(self, directory: Any) -> Checkpoint:
        """The checkpoint's manifest (atoms: shape, dtype, slots, pattern; step; extra).

        Reads `manifest.json` only; arrays are opened lazily by `Checkpoint.read`.
        """
        return Checkpoint(os.fspath(directory))

    def close(self) -> None:
        """Nothing held: the writes belong to the futures Orbax waits on."""

    @classmethod
    def typestr(cls) -> str:
        """Stable name recorded in Orbax's step metadata (independent of the private module)."""
        return "ucp_jax.orbax.UniversalCheckpointHandler"


@ocp.args.register_with_handler(UniversalCheckpointHandler, for_save=True)
@dataclasses.dataclass
class UniversalSave(ocp.args.CheckpointArgs):
    """Save params (and optax state) as a universal checkpoint.

    Attributes:
        params: pytree of jax.Array (any sharding), numpy arrays or scalars.
        opt_state: optax state for these params, or None.
        rules: (regex, pattern) pairs mapping leaves to atoms (see `ucp.save`).
        step: step recorded in the manifest; default: the CheckpointManager step.
        extra: JSON-serialisable user data stored in the manifest.
    """

    params: Any
    opt_state: Any = None
    rules: Sequence[Rule] = ()
    step: int | None = None
    extra: Any = None


@ocp.args.register_with_handler(UniversalCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class UniversalRestore(ocp.args.CheckpointArgs):
    """Restore onto the layout of the targets (ShapeDtypeStructs with shardings, or arrays).

    Attributes:
        params_target: pytree of jax.ShapeDtypeStruct with `.sharding` (or concrete arrays).
        opt_state_target: optax state of the same kind, or None.
        rules: (regex, pattern) pairs for the target layout; empty: the rules saved with it.
        cast: allow converting the stored dtype to the target's.
    """

    params_target: Any
    opt_state_target: Any = None
    rules: Sequence[Rule] = ()
    cast: bool = False


__all__ = [
    "UniversalCheckpointHandler",
    "UniversalRestore",
    "UniversalSave",
    "UniversalState",
]
