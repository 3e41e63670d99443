"""One process of a 2-process x 4-CPU-device jax job saving to an object store and restoring.

Run by tests/test_object_stores.py:
    python tests/mp/remote_worker.py PROCESS_ID COORDINATOR_ADDRESS ROOT_URL

Saves (sync and async) to ROOT_URL/sync and ROOT_URL/async on a (2, 4) mesh, restores onto
(4, 2) and checks every shard it holds; the store's endpoint comes from the environment. Exits
non-zero (with a traceback on stderr) on any failed check.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import jax


def main() -> None:
    pid, coordinator, root = int(sys.argv[1]), sys.argv[2], sys.argv[3].rstrip("/")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator, num_processes=2, process_id=pid, initialization_timeout=120
    )
    assert jax.process_count() == 2 and jax.device_count() == 8
    import state
    from helpers import mesh_of

    import ucp_jax as ucp

    ref_params, ref_opt, params, opt_state = state.global_state(pid)
    ucp.save(f"{root}/sync", params, opt_state, step=7)
    ucp.async_save(f"{root}/async", params, opt_state, step=8).wait()
    assert ucp.list_checkpoints(root) == [f"{root}/async", f"{root}/sync"]
    shards = 0
    for name, step in (("sync", 7), ("async", 8)):
        ck = ucp.open(f"{root}/{name}")
        assert ck.step == step and ck.manifest.source["process_count"] == 2, ck.manifest.source
        mesh = mesh_of((4, 2))
        pt, ot = state.targets_on(ref_params, mesh), state.targets_on(ref_opt, mesh)
        p2, o2 = ucp.restore(f"{root}/{name}", pt, ot)
        shards += state.check_shards(p2, ref_params, pt, f"{name} params")
        shards += state.check_shards(o2, ref_opt, ot, f"{name} opt_state")
    print(f"process {pid}: OK, {shards} shards checked", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
