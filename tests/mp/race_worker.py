"""A job that saves (or keeps overwriting) one checkpoint path, to race another job.

Usage:
  race_worker.py save JOB DEST_ROOT ROUNDS SYNC_DIR [OVERWRITE]: for each round r, waits for
    SYNC_DIR/go_<r>, saves the values of JOB (`state(JOB, r)`) to DEST_ROOT/step_<r> (a local
    folder, or with `s3://...` an object store) and writes SYNC_DIR/<JOB>_<r>.json: "ok", or the
    error's class and message. The commit is slowed (a sleep before `seal`), so that two jobs
    started together overlap.
  race_worker.py overwrite DEST STOP_FILE: overwrites DEST with state(1, 0) and state(2, 0) in
    turn until STOP_FILE exists; keeps the count in STOP_FILE.count, and prints it.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import numpy as np

import ucp_jax as ucp
from ucp_jax._src.format import commit


def state(job: int, r: int) -> dict:
    """The values of one job's save: every element says which job and round wrote it."""
    k = np.float32(1000 * job + r)
    return {"w": np.full((512, 512), k, np.float32), "v": np.full((4096,), -k, np.float32)}


def _slow_seal() -> None:
    seal = commit.seal

    def slow(*a, **k):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        return seal(*a, **k)

    commit.seal = slow  # type: ignore[assignment]


def main() -> None:
    if sys.argv[1] == "overwrite":
        dest, stop = sys.argv[2], sys.argv[3]
        n = 0
        while not os.path.exists(stop):
            ucp.save(dest, state(1 + n % 2, 0), step=n, overwrite=True)
            n += 1
            with open(stop + ".count", "w") as f:
                f.write(str(n))
        print(n)
        return
    job, root, rounds, sync = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    overwrite = len(sys.argv) > 6 and sys.argv[6] == "1"
    _slow_seal()
    for r in range(rounds):
        go = os.path.join(sync, f"go_{r}")
        while not os.path.exists(go):
            time.sleep(0.005)
        try:
            ucp.save(f"{root}/step_{r}", state(job, r), step=r, overwrite=overwrite)
            out = {"outcome": "ok"}
        except Exception as e:  # reported to the test, which decides
            out = {"outcome": type(e).__name__, "message": str(e)}
        with open(os.path.join(sync, f"{job}_{r}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
