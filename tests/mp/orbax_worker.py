"""Subprocess trainers for tests/test_orbax.py: an Orbax CheckpointManager saving universal items.

    python tests/mp/orbax_worker.py job PROCESS_ID COORDINATOR_ADDRESS ROOT
    python tests/mp/orbax_worker.py kill MODE ROOT

`job`: one process of a 2-process x 4-CPU-device jax job (gloo). Saves params + adamw state
(tests/mp/state.py) on a (2, 4) mesh through an async CheckpointManager at steps 1 and 2, restores
the latest onto (4, 2) and checks its own shards bit for bit; writes ROOT/report_<PID>.json.

`kill`: one process, 8 devices. Saves step 1 and prints `STEP1 DONE`, then starts an async save
of a ~96 MiB state as step 2 and prints `KILL ME` for the test to SIGKILL it:
- `writing`: once a chunk file exists in Orbax's temporary step folder (the arrays are being
  written);
- `finalize`: when the handler's finalize is called (everything written, COMMIT not yet).
In both modes finalize blocks, so step 2 can never be published before the kill arrives.
If the save ever finishes it prints `SAVE FINISHED` and exits 3.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/mp/, for state

import jax
import numpy as np

BIG_LEAVES = 16
BIG_LEAF_SHAPE = (1024, 1536)  # 6 MiB of float32 each


def _say(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def job(pid: int, coordinator: str, root: Path) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator, num_processes=2, process_id=pid, initialization_timeout=120
    )
    assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()

    import orbax.checkpoint as ocp
    import state
    from helpers import mesh_of

    import ucp_jax.orbax as uo

    ref_params, ref_opt, params, opt_state = state.global_state(pid)

    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    mngr = ocp.CheckpointManager(root / "ckpt", options=options)
    # step 1 holds other values (params + 1), so restoring the wrong step would show
    mngr.save(1, args=uo.UniversalSave(jax.tree.map(lambda x: x + 1, params), opt_state))
    mngr.save(2, args=uo.UniversalSave(params, opt_state, extra={"job": "2x4"}))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2], mngr.all_steps()
    assert mngr.latest_step() == 2

    mesh = mesh_of((4, 2))
    pt, ot = state.targets_on(ref_params, mesh), state.targets_on(ref_opt, mesh)
    p2, o2 = mngr.restore(2, args=uo.UniversalRestore(pt, ot))
    shards = state.check_shards(p2, ref_params, pt, "params")
    shards += state.check_shards(o2, ref_opt, ot, "opt_state")
    md = mngr.item_metadata(2)
    report = {
        "process": pid,
        "shards_checked": shards,
        "steps": list(mngr.all_steps()),
        "atoms": sorted(md.atoms),
    }
    mngr.close()
    (root / f"report_{pid}.json").write_text(json.dumps(report))
    _say(f"process {pid}: OK, {shards} shards checked")
    jax.distributed.shutdown()


def _watch_for_chunks(root: Path) -> None:
    """Say `KILL ME` once a chunk data file exists under Orbax's temporary folder of step 2."""
    while True:
        for tmp in root.glob("2.orbax-checkpoint-tmp*"):
            for where, _, files in os.walk(tmp):
                chunk_dir = f"{os.sep}c{os.sep}" in where + os.sep  # atoms/<atom>/<slot>/c/...
                data_dir = where.endswith(f"ocdbt.p0{os.sep}d")  # the aggregated layout
                done = [f for f in files if not f.endswith("__lock")]
                if (chunk_dir and done) or (data_dir and len(done) >= 2):
                    _say("KILL ME")
                    return
        time.sleep(0.002)


def kill(mode: str, root: Path) -> None:
    import orbax.checkpoint as ocp
    from helpers import float_params, mesh_of, place

    import ucp_jax.orbax as uo

    assert jax.device_count() == 8
    options = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True)
    mngr = ocp.CheckpointManager(root, options=options)
    mngr.save(1, args=uo.UniversalSave(place(float_params(), mesh_of((2, 4)))))
    mngr.wait_until_finished()
    assert mngr.latest_step() == 1
    _say("STEP1 DONE")

    def blocking_finalize(self, directory):  # never publish step 2 before the kill
        if mode == "finalize":
            assert (Path(os.fspath(directory)) / "manifest.json").exists()
            assert not (Path(os.fspath(directory)) / "COMMIT").exists()
            _say("KILL ME")
        time.sleep(3600)

    uo.UniversalCheckpointHandler.finalize = blocking_finalize
    mesh = mesh_of((8,))
    base = np.arange(np.prod(BIG_LEAF_SHAPE), dtype=np.float32).reshape(BIG_LEAF_SHAPE)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a"))
    big = {f"w{i:02d}": jax.device_put(base + i, sharding) for i in range(BIG_LEAVES)}
    jax.block_until_ready(big)
    if mode == "writing":
        threading.Thread(target=_watch_for_chunks, args=(root,), daemon=True).start()
    elif mode != "finalize":
        raise SystemExit(f"unknown mode {mode!r}")
    mngr.save(2, args=uo.UniversalSave(big))
    mngr.wait_until_finished()
    _say("SAVE FINISHED")
    sys.exit(3)


if __name__ == "__main__":
    if sys.argv[1] == "job":
        job(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    elif sys.argv[1] == "kill":
        kill(sys.argv[2], Path(sys.argv[3]))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} job PID ADDR ROOT | kill MODE ROOT")
