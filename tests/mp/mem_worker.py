"""One process of a jax.distributed job that trains with in-memory snapshots, or resumes from them.

Run by tests/test_memory_multiprocess.py:
    python tests/mp/mem_worker.py CONFIG_JSON

CONFIG: {"mode": "train"|"resume", "pid", "nprocs", "addr", "report", "ckpt", "namespace",
"redundancy", "steps", "persist_every", "machines"}; with "machines" (a folder), process i keeps
its shared memory in <machines>/m<i>/ and sees no other's, as on a cluster. Each process has 8 // nprocs CPU devices (XLA_FLAGS is set
by the caller); the training mesh is (nprocs, 8 // nprocs) with axes ('data', 'model').

- train: trains `steps` steps (params and adamw state donated each step), snapshotting every step
  with this process's data-loader state as `extra` (`loader_state`: bytes, as grain's
  `get_state()`, inside JSON data; different per process and step), then computes one more step
  without a snapshot; writes the crc32 of every leaf of the global
  state after each step to the report, prints `SNAPSHOTS DONE` and waits to be killed.
- resume: builds targets on its own mesh (any process count), restores with the manager, writes
  the restored step, its source, its extra (repr) and the state's crc32s to the report, trains one more step (only
  on the training mesh: same mesh, same bits) and records that too.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SPECS = {
    "w1": ((32, 64), np.float32, P(None, "model")),  # replicated across processes: free copies
    "w2": ((64, 32), np.float32, P("data", "model")),  # sharded across processes: exchanged
    "b": ((64,), np.float32, P()),  # fully replicated: one device copies it
    "emb": ((64, 32), jnp.bfloat16, P("data", None)),
    "big": ((1024, 1024), np.float32, P()),  # 4 MiB, replicated: split among replicas
}
OPT = optax.adamw(1e-2)


def init_params(mesh: jax.sharding.Mesh) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    out = {}
    for name, (shape, dtype, spec) in SPECS.items():
        ref = (rng.standard_normal(shape) * 0.1).astype(dtype)
        out[name] = jax.make_array_from_callback(
            shape, NamedSharding(mesh, spec), lambda idx, ref=ref: ref[idx]
        )
    return out


def loss_fn(p: dict[str, Any], x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"]
    e = p["emb"].astype(jnp.float32)
    return jnp.mean((h - e[:, :32].mean()) ** 2) + 1e-3 * jnp.mean(p["big"] ** 2)


def make_step(mesh: jax.sharding.Mesh, params: Any, opt_state: Any) -> Any:
    shard = jax.tree.map(lambda a: a.sharding, (params, opt_state))

    def step(params, opt_state, x):
        grads = jax.grad(loss_fn)(params, x)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, out_shardings=shard, donate_argnums=(0, 1))


def batch(step: int, mesh: jax.sharding.Mesh) -> jax.Array:
    ref = np.random.default_rng(1000 + step).standard_normal((16, 32)).astype(np.float32)
    return jax.make_array_from_callback(ref.shape, NamedSharding(mesh, P()), lambda i: ref[i])


def loader_state(pid: int, step: int) -> dict[str, Any]:
    """Process `pid`'s data-loader state after `step`: an opaque iterator state and its position."""
    blob = json.dumps({"shard": pid, "next_index": step * 16 + pid}).encode() + bytes([pid, 255])
    return {"epoch": step // 4, "iterator": blob, "seen": step * 16}  # keys sorted: as restored


def digest(tree: Any) -> dict[str, str]:
    """crc32 of every leaf's global bytes (a collective: every process calls it)."""
    from jax.experimental import multihost_utils

    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        full = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        out[jax.tree_util.keystr(path)] = f"{zlib.crc32(full.tobytes()):08x}"
    return out


def targets(mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    def sds(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    params = {n: sds(*v) for n, v in SPECS.items()}

    def opt_leaf(path: Any, x: Any) -> jax.ShapeDtypeStruct:
        names = [getattr(k, "key", None) for k in path]
        spec = next((SPECS[k][2] for k in names if k in SPECS), P())  # mu/nu: their param's
        return sds(x.shape, x.dtype, spec)

    opt = jax.tree_util.tree_map_with_path(opt_leaf, jax.eval_shape(OPT.init, params))
    return params, opt


def inject_share_fault(kind: str) -> None:
    """Make this process a faulty peer of a rebuild shared on its machine (`memory/share.py`):
    'silent' never says its share is done (as a peer that died or hangs); 'wrong' writes one
    wrong byte into its share of the rebuilt lanes."""
    from ucp_jax._src.memory import exchange
    from ucp_jax._src.memory.rs2 import RS2

    if kind == "silent":
        publish = exchange.publish_text

        def silent(key: str, text: str) -> None:
            if "/share/" not in key:
                publish(key, text)

        exchange.publish_text = silent
        return
    solve = RS2.decode_share

    def wrong(self: RS2, layout: Any, lost: Any, blobs: Any, parts: Any, out: Any) -> None:
        solve(self, layout, lost, blobs, parts, out)
        g = list(layout.group_of[lost[0]])
        plan = {p[0]: p for p in self._plan(layout, g, list(lost))}
        for p, u, _ in self._tasks(layout, g, [(plan[s], i, n) for s, i, n in parts]):
            a, b = self.lane(layout, p[1][0], p[0])
            if a + u < b:
                out[p[1][0]][a + u] ^= 0x5A
                return

    RS2.decode_share = wrong  # type: ignore[method-assign]


T0 = time.perf_counter()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    timing = {"imports": time.perf_counter() - T0}
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    n = cfg["nprocs"]
    if n > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            cfg["addr"], num_processes=n, process_id=cfg["pid"], initialization_timeout=120
        )
    timing["init"] = time.perf_counter() - T0
    from ucp_jax.memory import SnapshotManager

    damage = cfg.get("persist_damage")  # {"pid", "step"}: flip a byte of that snapshot's blob
    if damage and damage["pid"] == cfg["pid"]:  # after its commit, just before its persist
        from ucp_jax._src.memory import persist

        write = persist.write

        def damaged_write(job: Any, blob: Any, *a: Any, **k: Any) -> bool:
            if job.manifest.step == damage["step"]:
                blob.array[blob.nbytes // 2] ^= 0xFF
            return write(job, blob, *a, **k)

        persist.write = damaged_write

    full = cfg.get("shm_full")  # {"pid", "step"}: that process's blob of that step: ENOSPC
    if full and full["pid"] == cfg["pid"]:
        import errno

        from ucp_jax._src.memory import shm

        create = shm.Blob.create.__func__  # type: ignore[attr-defined]

        def full_create(cls: Any, path: Any, nbytes: int) -> Any:
            if f"step_{full['step']}" in str(path):
                raise OSError(errno.ENOSPC, f"no space left for {path} (injected)")
            return create(cls, path, nbytes)

        shm.Blob.create = classmethod(full_create)  # type: ignore[method-assign]

    devs = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    mesh = jax.sharding.Mesh(devs.reshape(n, -1), ("data", "model"))
    mgr = SnapshotManager(
        cfg["ckpt"],
        persist_every=cfg.get("persist_every"),
        redundancy=cfg.get("redundancy"),
        namespace=cfg["namespace"],
        keep=2,
        # "machines": each process has its own shared memory, as on a cluster (m<pid>/)
        shm_dir=f"{cfg['machines']}/m{cfg['pid']}" if cfg.get("machines") else None,
    )
    report: dict[str, Any] = {"pid": cfg["pid"], "timing": timing}
    pt, ot = targets(mesh)
    if cfg["mode"] == "train":
        params = init_params(mesh)
        opt_state = jax.jit(OPT.init, out_shardings=jax.tree.map(lambda t: t.sharding, ot))(params)
        step_fn = make_step(mesh, params, opt_state)
        report["digests"] = {}
        timing["setup"] = time.perf_counter() - T0
        dig = 0.0
        for step in range(1, cfg["steps"] + 2):
            t = time.perf_counter()
            params, opt_state = step_fn(params, opt_state, batch(step, mesh))
            jax.block_until_ready(params)
            timing[f"step{step}"] = time.perf_counter() - t
            t = time.perf_counter()
            if step <= cfg["steps"]:
                try:
                    mgr.snapshot(step, params, opt_state, extra=loader_state(cfg["pid"], step))
                except RuntimeError as e:  # "catch": a loop that takes snapshots as best effort
                    if not cfg.get("catch"):
                        raise
                    report.setdefault("snapshot_errors", {})[step] = f"{type(e).__name__}: {e}"
            timing[f"snap{step}"] = time.perf_counter() - t
            t = time.perf_counter()
            report["digests"][step] = digest((params, opt_state))
            dig += time.perf_counter() - t
        try:
            mgr.wait()
        except RuntimeError as e:
            if not cfg.get("catch"):
                raise
            report.setdefault("snapshot_errors", {})["wait"] = f"{type(e).__name__}: {e}"
        timing["digests"] = dig
        timing["done"] = time.perf_counter() - T0
        report["stats"] = vars(mgr.stats)
        Path(cfg["report"]).write_text(json.dumps(report))
        print("SNAPSHOTS DONE", flush=True)
        time.sleep(3600)
        return
    fault = cfg.get("share_fault")
    if fault and fault["pid"] == cfg["pid"]:
        inject_share_fault(fault["kind"])
    if cfg.get("share_timeout"):
        os.environ["UCP_REBUILD_SHARE_TIMEOUT_S"] = str(cfg["share_timeout"])
    t0 = time.perf_counter()
    params, opt_state = mgr.restore(pt, ot)
    report["restore_s"] = time.perf_counter() - t0
    info = mgr.restored
    report.update(step=info.step, source=info.source, lost=info.lost, path=info.path,
                  fetched_bytes=info.fetched_bytes, copied_bytes=info.copied_bytes,
                  extra=repr(info.extra), rebuild=info.rebuild)  # fmt: skip
    report["digest"] = digest((params, opt_state))
    if cfg.get("continue"):
        step_fn = make_step(mesh, params, opt_state)
        params, opt_state = step_fn(params, opt_state, batch(info.step + 1, mesh))
        report["next_digest"] = digest((params, opt_state))
    mgr.close()
    Path(cfg["report"]).write_text(json.dumps(report))
    print("RESUME DONE", flush=True)


if __name__ == "__main__":
    main()
