"""A trainer that gets SIGKILLed in the middle of a save (run by tests/test_kill.py).

    python tests/mp/kill_worker.py MODE ROOT

Saves a small checkpoint ROOT/step_1, prints `STEP1 DONE`, then saves a large state to
ROOT/step_2 and prints `KILL ME` at the point MODE names, for the test to SIGKILL it there:

- `writing`: once the staging folder holds chunk data, i.e. while the arrays are being written
  (the write phase is throttled so that it lasts seconds).
- `renaming`: when the manifest and COMMIT are in the staging folder and the save is about to
  rename it onto ROOT/step_2 (the worker blocks there).

If the save ever finishes, it prints `SAVE FINISHED` and exits 3.
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

BIG_LEAVES = 32
BIG_LEAF_SHAPE = (1024, 1024)  # 4 MiB of float32 each: 128 MiB in all
THROTTLE_S = 0.01  # per written region (8 per leaf): the write phase lasts ~3 s, not ~0.2 s


def _say(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def is_chunk_file(name: str) -> bool:
    """A shard file TensorStore has renamed into place (not metadata, not its `.__lock` temp file).

    A lock file is transient: it is renamed onto the shard, or removed, so only a shard file
    proves that data survives the kill.
    """
    return name != "zarr.json" and not name.endswith(".__lock")


def wrote_data(folder: Path) -> bool:
    """Whether chunk data has landed under a save's folder: a chunk file (format version 2), or
    in the aggregated layout (version 3) a data file beyond the one of process 0's metadata
    transaction in its database (`ocdbt.p0/d/`)."""
    for _, _, files in os.walk(folder / "atoms"):
        if any(is_chunk_file(f) for f in files):
            return True
    d = folder / "ocdbt.p0" / "d"
    return d.is_dir() and len([f for f in os.listdir(d) if not f.endswith(".__lock")]) >= 2


def _watch_staging(staging: Path) -> None:
    """Say `KILL ME` once chunk data exists under the staging folder."""
    while True:
        if staging.is_dir() and wrote_data(staging):
            _say("KILL ME")
            return
        time.sleep(0.002)


def _block_before_rename(staging: Path) -> None:
    """Make the save stop right before publishing: COMMIT is written, the rename never happens."""
    rename = os.rename

    def blocking_rename(src: str, dst: str) -> None:
        if Path(src) == staging:
            assert (staging / "COMMIT").exists() and (staging / "manifest.json").exists()
            _say("KILL ME")
            time.sleep(3600)
        rename(src, dst)

    os.rename = blocking_rename


def _throttle() -> None:
    """Slow the write phase down, so that the kill lands in it with seconds to spare."""
    from ucp_jax._src import save as save_mod

    stream = save_mod.SaveJob._stream

    def slow_stream(self):  # type: ignore[no-untyped-def]
        for item in stream(self):
            time.sleep(THROTTLE_S)
            yield item

    save_mod.SaveJob._stream = slow_stream


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    from helpers import float_params, mesh_of, place

    import ucp_jax as ucp

    assert jax.device_count() == 8
    ucp.save(root / "step_1", place(float_params(), mesh_of((2, 4))), step=1)
    _say("STEP1 DONE")

    mesh = mesh_of((8,))
    base = np.arange(np.prod(BIG_LEAF_SHAPE), dtype=np.float32).reshape(BIG_LEAF_SHAPE)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a"))
    big = {f"w{i:02d}": jax.device_put(base + i, sharding) for i in range(BIG_LEAVES)}
    jax.block_until_ready(big)
    staging = root / ".step_2.ucp-tmp"
    if mode == "writing":
        _throttle()
        threading.Thread(target=_watch_staging, args=(staging,), daemon=True).start()
    elif mode == "renaming":
        _block_before_rename(staging)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    ucp.save(root / "step_2", big, step=2)
    _say("SAVE FINISHED")
    sys.exit(3)


if __name__ == "__main__":
    main()
