"""Subprocess writer for tests/test_orbax_import.py: a 2-process job saving a plain Orbax checkpoint.

    python tests/mp/orbax_native_worker.py PROCESS_ID COORDINATOR_ADDRESS ROOT

One process of a 2-process x 4-CPU-device jax job (gloo): saves params + adamw state
(tests/mp/state.py) sharded on a (2, 4) mesh, each process holding one mesh row, with Orbax's own
`StandardCheckpointer` (OCDBT, one database per process merged at finalize) into ROOT/orbax.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/mp/, for state

import jax


def main(pid: int, coordinator: str, root: Path) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator, num_processes=2, process_id=pid, initialization_timeout=120
    )
    assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()
    import orbax.checkpoint as ocp
    import state

    _, _, params, opt_state = state.global_state(pid)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(root / "orbax", {"params": params, "opt_state": opt_state, "step": 7})
    ckptr.wait_until_finished()
    ckptr.close()
    print(f"process {pid}: saved", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
