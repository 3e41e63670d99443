"""One process of a 2-process job whose save fails on process 1 only (its writes raise, as a
full disk's do): process 1 raises its error at once, and process 0 stops at its next barrier
with `AnotherProcessFailedError` naming it, instead of waiting out the barrier timeout.

Usage: fail_worker.py PROCESS_ID COORDINATOR OUT MODE (MODE: sync or async; or path, step,
leaves, values: process 1 makes another call than process 0, which is refused on process 1 as an
ArgumentError naming what differs, and stops process 0 at its next barrier; or absent: process
1 never saves, and process 0's barrier times out after 2 s). Prints one JSON
line: the error's class, its message and the seconds the save took to fail.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main() -> None:
    pid, addr, out, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(addr, num_processes=2, process_id=pid)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ucp_jax as ucp
    from ucp_jax._src import save

    if pid == 1 and mode in ("sync", "async"):
        regions = save.SaveJob._regions

        def failing(self, host):  # type: ignore[no-untyped-def]
            yield from []
            raise OSError(28, "No space left on device (injected on process 1)")
            yield from regions(self, host)  # (unreached: keeps it a generator of the same kind)

        save.SaveJob._regions = failing  # type: ignore[method-assign]
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("d")), lambda i: full[i])
    path, step, tree = f"{out}/ck", 1, {"x": x, "lr": np.float32(0.1)}
    if pid == 1 and mode == "path":
        path = f"{out}/ck_{pid}"  # (a per-process temporary folder, say)
    elif pid == 1 and mode == "step":
        step = 2
    elif pid == 1 and mode == "leaves":
        tree = {**tree, "extra": np.zeros(3, np.float32)}
    elif pid == 1 and mode == "values":
        tree = {**tree, "lr": np.float32(0.2)}
    t0 = time.monotonic()
    if mode == "absent":  # process 1 never calls save; process 0 waits 2 s at a barrier
        os.environ["UCP_BARRIER_TIMEOUT_S"] = "2"
        if pid == 1:
            time.sleep(8)  # alive past process 0's timeout (its death ends the job), not saving
            print(json.dumps({"error": None, "seconds": 0}), flush=True)
            return
    try:
        if mode == "async":
            ucp.async_save(path, tree, step=step).wait()
        else:
            ucp.save(path, tree, step=step)
        got = {"error": None}
    except Exception as e:
        got = {"error": type(e).__name__, "message": str(e)}
    got["seconds"] = time.monotonic() - t0
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
