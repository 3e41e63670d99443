"""One process of a 2-process x 4-CPU-device jax job: save on (2, 4), restore on (4, 2) and (8, 1).

Run by tests/test_multiprocess.py:
    python tests/mp/worker.py PROCESS_ID COORDINATOR_ADDRESS ROOT

Writes ROOT/report_<PROCESS_ID>.json: for each checkpoint, every region this process wrote into
each stored array, and the regions its devices hold; the test checks that no process wrote
anything it does not hold, that no region was written twice, and that the writes cover every
array. Exits non-zero (with a traceback on stderr) on any failed check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import jax

WRITES: list[tuple[str, list[list[int]]]] = []


class _RecordingArray:
    """Wraps a TensorStore array: records the region of every `arr[index].write(...)`."""

    def __init__(self, arr: Any, path: str) -> None:
        self._arr, self._path = arr, path

    def __getitem__(self, index: Any) -> Any:
        sub, path = self._arr[index], self._path
        box = [[s.start, s.stop] for s in (index if isinstance(index, tuple) else (index,))]

        class _Region:
            def write(self, data: Any) -> Any:
                WRITES.append((path, box))
                return sub.write(data)

        return _Region()

    def with_transaction(self, txn: Any) -> Any:  # the aggregated layout writes in transactions
        return _RecordingArray(self._arr.with_transaction(txn), self._path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._arr, name)


def _instrument() -> None:
    """Record every region the save writes, wherever the array was opened or created, and every
    region written as raw shard values."""
    from ucp_jax._src.format import encode as encode_mod
    from ucp_jax._src.format import store as store_mod

    open_array, create = store_mod.open_array, store_mod.create_array
    raw_write = encode_mod.RawWriter.write

    def recording_raw(self: Any, info: Any, box: Any, data: Any) -> Any:
        """Whole shards the save encodes itself and writes as raw values (format/encode.py)."""
        WRITES.append((info.path, [[int(a), int(b)] for a, b in box]))
        return raw_write(self, info, box, data)

    encode_mod.RawWriter.write = recording_raw  # type: ignore[method-assign]

    def recording_open(loc: Any, shape: Any, info: Any, *, write: bool = False) -> Any:
        arr = open_array(loc, shape, info, write=write)
        return _RecordingArray(arr, info.path) if write else arr

    class _Future:
        def __init__(self, fut: Any, path: str) -> None:
            self._fut, self._path = fut, path

        def result(self) -> Any:
            return _RecordingArray(self._fut.result(), self._path)

    def recording_create(loc: Any, shape: Any, info: Any, txn: Any = None) -> Any:
        return _Future(create(loc, shape, info, txn), info.path)

    store_mod.open_array = recording_open
    store_mod.create_array = recording_create


def _owned(path: Any, mesh: jax.sharding.Mesh) -> dict[str, list[list[list[int]]]]:
    """Per stored array: the boxes this process's devices hold in the save layout."""
    from helpers import auto_spec
    from jax.sharding import NamedSharding

    import ucp_jax as ucp

    out = {}
    for atom in ucp.open(path).atoms.values():
        shape = tuple(atom.shape)
        idx_map = NamedSharding(mesh, auto_spec(shape, mesh)).addressable_devices_indices_map(shape)
        boxes = sorted(
            {
                tuple((i.indices(d)[0], i.indices(d)[1]) for i, d in zip(idx, shape))
                for idx in idx_map.values()
            }
        )
        for slot in atom.slots.values():
            out[slot.path] = [[list(ab) for ab in b] for b in boxes]
    return out


def main() -> None:
    pid, coordinator, root = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator, num_processes=2, process_id=pid, initialization_timeout=120
    )
    assert jax.process_count() == 2 and jax.process_index() == pid
    assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()

    import state
    from helpers import mesh_of

    import ucp_jax as ucp

    _instrument()
    ref_params, ref_opt, params, opt_state = state.global_state(pid)
    save_mesh = params["dense"]["kernel"].sharding.mesh

    report: dict[str, Any] = {"process": pid, "checkpoints": {}}
    WRITES.clear()
    ucp.save(root / "sync", params, opt_state, step=7, extra={"job": "2x4"})
    sync_writes = list(WRITES)
    WRITES.clear()
    handle = ucp.async_save(root / "async", params, opt_state, step=8)
    handle.wait()
    assert handle.done()
    async_writes = list(WRITES)
    for name, writes in (("sync", sync_writes), ("async", async_writes)):
        per_array: dict[str, list[list[list[int]]]] = {}
        for p, box in writes:
            per_array.setdefault(p, []).append(box)
        report["checkpoints"][name] = {
            "written": per_array,
            "owned": _owned(root / name, save_mesh),
        }

    # Restore in the same job onto other meshes; each process checks the shards it holds.
    shards = 0
    for name, step in (("sync", 7), ("async", 8)):
        ck = ucp.open(root / name)
        assert ck.step == step, ck.step
        assert ck.manifest.source["process_count"] == 2, ck.manifest.source
        for shape in ((4, 2), (8, 1)):
            mesh = mesh_of(shape)
            pt, ot = state.targets_on(ref_params, mesh), state.targets_on(ref_opt, mesh)
            p2, o2 = ucp.restore(root / name, pt, ot)
            shards += state.check_shards(p2, ref_params, pt, f"{name}->{shape} params")
            shards += state.check_shards(o2, ref_opt, ot, f"{name}->{shape} opt_state")
    # a pipeline stage's leaf: on one process's devices only (the other holds no shard of it,
    # and restores it as an array without addressable shards: it raised there)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    want = ref_params["dense"]["kernel"]
    for owner in (0, 1):
        devs = [d for d in jax.devices() if d.process_index == owner]
        sh = NamedSharding(Mesh(np.array(devs), ("stage",)), P("stage"))
        target = {"dense": {"kernel": jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=sh)}}
        got, _ = ucp.restore(root / "sync", target)
        arr = got["dense"]["kernel"]
        assert arr.sharding == sh and len(arr.addressable_shards) == (4 if owner == pid else 0)
        for s in arr.addressable_shards:
            assert np.array_equal(np.asarray(s.data), want[s.index]), f"stage {owner}"
            shards += 1
    report["shards_checked"] = shards
    (root / f"report_{pid}.json").write_text(json.dumps(report))
    print(f"process {pid}: OK, {shards} shards checked", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
