"""Universal checkpoints in Orbax's v1 API (`orbax.checkpoint.v1`): a checkpointable handler.

Orbax v1 saves and loads *checkpointables* (`ocp.v1.save_checkpointables`,
`ocp.v1.training.Checkpointer.save_checkpointables(step, {...})`, MaxText's checkpointing since
0.2), each through the `CheckpointableHandler` that claims it. Importing `ucp_jax.orbax` registers
`UniversalCheckpointableHandler` globally, for the same arguments as the v0 handler:

    import orbax.checkpoint as ocp
    import ucp_jax.orbax as uo

    ckptr = ocp.v1.training.Checkpointer("/ckpt")
    ckptr.save_checkpointables(step, {"universal": uo.UniversalSave(params, opt_state)})
    got = ckptr.load_checkpointables(step, {"universal": uo.UniversalRestore(pt, ot, rules=...)})
    params, opt_state = got["universal"]                 # onto the targets' mesh, any mesh

    ocp.v1.save_checkpointables(path, {"universal": uo.UniversalSave(params)})
    ocp.v1.load_checkpointables(path, {"universal": uo.UniversalRestore(pt)})

Any checkpointable name will do but `state`, which Orbax v1 reserves for its PyTree handler
(and `metrics`). The checkpointable's folder (`<step>/universal`) is a universal checkpoint, exactly as the v0 handler
writes it (`manifest.json`, `atoms/`, `COMMIT`): `ucp.open`, `ucp.restore` and `ucp inspect` read
it, and a step the v0 `CheckpointManager` saved with `UniversalSave` loads through v1 as well (the
v0 handler's name is this handler's secondary name). Loading with no abstract checkpointable gives
the checkpoint's `ucp.Checkpoint` (nothing is read: a restore needs targets to give the mesh).

What Orbax v1 (0.12.8) does not allow: registering a checkpoint *layout* (its layouts are a closed
set, Orbax and safetensors), so `ocp.v1.load(path, abstract_tree)` cannot read a bare universal
checkpoint (one `ucp.save` wrote, outside any Orbax step) the way it reads safetensors: save
through the checkpointable handler, or use `ucp.restore`. `ocp.v1.load` of a pytree checkpointable
saved by this handler resolves the handler from the checkpoint's metadata, but Orbax then asks
the handler whether a plain tree of `ShapeDtypeStruct`s is its abstract type, and a universal
checkpoint needs the optimizer state's target separately: pass `UniversalRestore`, through
`load_checkpointables`.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from ...checkpoint import Checkpoint
from ...format import commit, store
from ...format.manifest import MANIFEST
from ...restore import restore as ucp_restore
from .handler import (
    UniversalCheckpointHandler,
    UniversalRestore,
    UniversalSave,
    UniversalState,
    in_place_job,
    settle_directory_creation,
)


class UniversalCheckpointableHandler:
    """Orbax v1 `CheckpointableHandler` of `UniversalSave` (save) / `UniversalRestore` (load).

    `save` plans the save and copies this process's shards to the host before it returns (the
    trainer may then change its arrays); the background part waits for Orbax to create the
    folder, writes every process's shards, the manifest (process 0, after all wrote) and
    `COMMIT`. `load` restores onto the targets' shardings, on any mesh.
    """

    def is_handleable(self, checkpointable: Any) -> bool:
        """Saves `UniversalSave` only (any other tree goes to Orbax's own handlers)."""
        return isinstance(checkpointable, UniversalSave)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """Loads onto `UniversalRestore` (None, no target: the manifest)."""
        return isinstance(abstract_checkpointable, UniversalRestore)

    async def save(self, directory: Any, checkpointable: UniversalSave) -> Any:
        """Plan and copy to host now; return the awaitable that writes."""
        path = os.fspath(directory.path)
        try:
            job = in_place_job(path, checkpointable)
            host = job.copy_all_to_host()
        except BaseException:
            settle_directory_creation()  # or the failed save holds the process at exit
            raise

        async def _write() -> None:
            await directory.await_creation()
            job.write(host)  # every process's shards; the manifest after all wrote
            import jax

            if jax.process_index() == 0:
                loc = store.Location.parse(path)
                data = loc.read(MANIFEST)
                assert data is not None
                commit.write_commit(loc, data)

        return _write()

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Any:
        """The awaitable that restores onto `UniversalRestore`'s targets (no target: metadata)."""
        path = os.fspath(directory)
        args = abstract_checkpointable

        async def _load() -> Any:
            if args is None:
                return Checkpoint(path)
            params, opt_state = ucp_restore(
                path, args.params_target, args.opt_state_target, rules=args.rules, cast=args.cast
            )
            return UniversalState(params, opt_state)

        return _load()

    async def metadata(self, directory: Any) -> Checkpoint:
        """The checkpoint's manifest (atoms, step, extra); reads `manifest.json` only."""
        return Checkpoint(os.fspath(directory))


# The name Orbax records for the handler in a checkpoint's metadata: the public one, so that a
# checkpoint does not depend on where the class lives inside the library.
UniversalCheckpointableHandler.__module__ = "ucp_jax.orbax"
PRIVATE_TYPESTR = f"{__name__}.UniversalCheckpointableHandler"


def register() -> None:
    """Register the handler with Orbax v1 (idempotent; `import ucp_jax.orbax` does it)."""
    registry = ocp.v1.handlers.global_registry()
    if any(h is UniversalCheckpointableHandler for h, _ in registry.get_all_entries()):
        return
    ocp.v1.handlers.register_handler(
        UniversalCheckpointableHandler,
        secondary_typestrs=[UniversalCheckpointHandler.typestr(), PRIVATE_TYPESTR],
    )


register()

__all__ = ["UniversalCheckpointableHandler", "register"]
