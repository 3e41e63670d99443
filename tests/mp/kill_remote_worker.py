"""A trainer SIGKILLed in the middle of a save to an object store (run by tests/test_object_stores.py).

    python tests/mp/kill_remote_worker.py ROOT_URL

Saves a small checkpoint ROOT_URL/step_1, prints `STEP1 DONE`, then saves a larger state to
ROOT_URL/step_2 (throttled) and prints `KILL ME` once the store holds chunk objects of it. The
store's endpoint and credentials come from the environment (AWS_ENDPOINT_URL_S3, ...). If the
save ever finishes, it prints `SAVE FINISHED` and exits 3.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import jax
import numpy as np

LEAVES = 8
LEAF_SHAPE = (256, 256)  # 256 KiB of float32 each


def _say(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def _watch(root: str) -> None:
    """Say `KILL ME` once a chunk object of step_2 exists in the store."""
    from ucp_jax._src.format.store import Location

    kv = Location.parse(root + "/step_2").kv()
    while True:
        keys = [k.decode() for k in kv.list().result()]
        if any("/c/" in k or k.endswith("/c") or k.startswith("ocdbt.p0/d/") for k in keys):
            _say("KILL ME")
            return
        time.sleep(0.01)


def main() -> None:
    root = sys.argv[1].rstrip("/")
    from helpers import float_params, mesh_of, place
    from mp import kill_worker

    import ucp_jax as ucp

    ucp.save(root + "/step_1", place(float_params(), mesh_of((2, 4))), step=1)
    _say("STEP1 DONE")
    sharding = jax.sharding.NamedSharding(mesh_of((8,)), jax.sharding.PartitionSpec("a"))
    base = np.arange(np.prod(LEAF_SHAPE), dtype=np.float32).reshape(LEAF_SHAPE)
    big = {f"w{i}": jax.device_put(base + i, sharding) for i in range(LEAVES)}
    jax.block_until_ready(big)
    # Transactions of one leaf: the aggregated layout's data files reach the store mid-save.
    os.environ["UCP_INFLIGHT_BYTES"] = str(2 * int(np.prod(LEAF_SHAPE)) * 4)
    kill_worker.THROTTLE_S = 0.05  # 64 regions: the write phase lasts ~3 s
    kill_worker._throttle()
    threading.Thread(target=_watch, args=(root,), daemon=True).start()
    ucp.save(root + "/step_2", big, step=2)
    _say("SAVE FINISHED")
    sys.exit(3)


if __name__ == "__main__":
    main()
