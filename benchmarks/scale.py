"""Scale benchmark: cost per save as the device count grows, ucp_jax against Orbax.

The same tree (161 bf16 leaves: an embedding and 32 layers of 5 matrices, tiny data, 2-D
shardings over a ('data', 'model') mesh) is saved by one process holding N forced CPU devices,
N = 8, 64, 256 (each N in its own subprocess: XLA_FLAGS is fixed when jax starts). Per N, in one
run: save time (until committed), restore time onto another mesh with other specs (a reshard),
and the number of objects (files) a checkpoint is, for `ucp.save` / `ucp.restore` and Orbax's
`StandardCheckpointer` (OCDBT, its default). Each timing is the median of `--repeats`.

Planning (`SaveJob` construction: which regions this process writes, chunk grids) is timed at
each N, and simulated (`plan_sim.py`) for one process of 8 devices in meshes of up to 16k devices
(ids only, no devices or data) for a 300-leaf tree, plain and with fused / vocab-padded / stacked
leaves: `SaveJob`'s whole per-leaf plan, atom boundaries and chunk grids included. `--plan-only`
runs only that (with PYTHONPATH at an older checkout it times that checkout's planner).
`--layout` picks the layout ucp saves (`UCP_LAYOUT`; default aggregated, format version 3).

Usage::

    python benchmarks/scale.py --out bench_out/scale.json
    python benchmarks/scale.py --devices 8 64 --repeats 1
    python benchmarks/scale.py --plan-only --plan-devices 1024 4096 16384
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from functools import partial
from typing import Any

from harness import Spread, child_env, dir_bytes, load_average, markdown_table, timed, write_json
from plan_sim import plan_sim

LAYERS = 32
WIDTH = 256  # every matrix is WIDTH x WIDTH (bf16: 128 KiB)
TARGETS = {"save": 1.0, "restore": 0.5, "objects": 2.0, "plan_s": 1.0}


def mesh_shape(n: int) -> tuple[int, int]:
    """A near-square 2-D mesh of n devices: (data, model)."""
    a = 1
    while a * a * 4 <= n:
        a *= 2
    return a, n // a


def count_files(path: str) -> int:
    """The number of files (objects) under `path`."""
    return dir_bytes(path)[1]


def worker(n: int, repeats: int, work: str) -> dict[str, Any]:
    """One device count: ucp and Orbax save / reshard restore / objects (runs in a subprocess)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import ucp_jax as ucp

    assert jax.device_count() == n, (jax.device_count(), n)
    a, b = mesh_shape(n)
    mesh = Mesh(np.array(jax.devices()).reshape(a, b), ("data", "model"))
    mesh2 = Mesh(np.array(jax.devices()).reshape(b, a), ("data", "model"))
    specs = [P("data", "model"), P("model", "data"), P(None, "model"), P("model", None), P()]
    specs2 = [P("model", "data"), P("data", "model"), P("model", None), P(None, "data"), P()]

    def tree(m: Mesh, sp: list[Any], real: bool) -> dict[str, Any]:
        rng = np.random.default_rng(0)
        out: dict[str, Any] = {}

        def leaf(i: int, spec: Any) -> Any:
            sh = NamedSharding(m, spec)
            if not real:
                return jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.bfloat16, sharding=sh)
            x = rng.standard_normal((WIDTH, WIDTH), dtype=np.float32).astype(jnp.bfloat16)
            return jax.device_put(x, sh)

        out["embed"] = leaf(0, sp[0])
        names = ("wq", "wk", "wv", "wo", "mlp")
        for layer in range(LAYERS):
            out[f"layer_{layer:02d}"] = {k: leaf(j, sp[j]) for j, k in enumerate(names)}
        return out

    from ucp_jax._src import save as save_mod

    params = tree(mesh, specs, True)
    target = tree(mesh2, specs2, False)
    assert len(jax.tree_util.tree_leaves(params)) == 161
    ckptr = ocp.StandardCheckpointer()
    res: dict[str, Any] = {"devices": n, "mesh": [a, b], "leaves": 161}
    times: dict[str, list[float]] = {k: [] for k in ("ucp_save", "ucp_restore", "orbax_save",
                                                     "orbax_restore", "plan_s")}  # fmt: skip

    def orbax_save(path: str) -> None:
        ckptr.save(path, params)
        ckptr.wait_until_finished()

    for rep in range(repeats + 1):  # the first round warms up (compiles, imports)
        up, op = f"{work}/ucp_{rep}", f"{work}/orbax_{rep}"
        # back to back: no GC or sync between the timed calls (settle=False)
        t_us, _ = timed(partial(ucp.save, up, params), settle=False)
        t_ur, got = timed(partial(ucp.restore, up, target), settle=False)
        t_os, _ = timed(partial(orbax_save, op), settle=False)
        t_or, _ = timed(partial(ckptr.restore, op, target), settle=False)
        plan = partial(save_mod.SaveJob, f"{work}/plan", params, None, step=None, rules=(),
                       extra=None, overwrite=True)  # fmt: skip
        t_plan, _ = timed(plan, settle=False, ready=False)
        if rep == 0:
            for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)):
                assert np.array_equal(np.asarray(x), np.asarray(y))
            res["ucp_objects"] = count_files(up)
            res["orbax_objects"] = count_files(op)
            continue
        for k, t in (("ucp_save", t_us), ("ucp_restore", t_ur), ("orbax_save", t_os),
                     ("orbax_restore", t_or), ("plan_s", t_plan)):  # fmt: skip
            times[k].append(t.wall)
    res.update({k: Spread.of(v).median for k, v in times.items()})
    return res


def run_worker(n: int, repeats: int, layout: str) -> dict[str, Any]:
    """`worker(n, ...)` in a subprocess with `n` forced CPU devices; its result."""
    env = child_env(n, UCP_LAYOUT=layout)
    with tempfile.TemporaryDirectory(prefix=f"ucp-scale-{n}-") as work:
        cmd = [sys.executable, __file__, "--worker", str(n), "--repeats", str(repeats),
               "--work", work]  # fmt: skip
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise SystemExit(f"worker {n} failed:\n{p.stderr[-4000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])


def report(rows: list[dict[str, Any]], plans: list[dict[str, Any]]) -> str:
    """Three Markdown tables: the measured runs, planning at each N, simulated planning."""
    if not rows:
        return _simulated(plans)
    runs = markdown_table(
        ["devices", "ucp save", "ucp restore (reshard)", "ucp files", "Orbax save",
         "Orbax restore", "Orbax files", "save ×", "restore ×", "files ×"],
        [[r["devices"], f"{r['ucp_save']:.2f} s", f"{r['ucp_restore']:.2f} s",
          f"{r['ucp_objects']:,}", f"{r['orbax_save']:.2f} s", f"{r['orbax_restore']:.2f} s",
          f"{r['orbax_objects']:,}", f"{r['save_ratio']:.2f}", f"{r['restore_ratio']:.2f}",
          f"{r['objects_ratio']:.2f}"] for r in rows],
        align="r" * 10,
    )  # fmt: skip
    planning = markdown_table(
        ["devices", "leaves", "planning (measured)"],
        [[f"{r['devices']:,}", r["leaves"], f"{r['plan_s'] * 1e3:.1f} ms"] for r in rows],
        align="rrr",
    )
    return "\n\n".join([runs, planning, _simulated(plans)])


def _simulated(plans: list[dict[str, Any]]) -> str:
    """The simulated planning table."""
    return markdown_table(
        ["devices", "processes", "mesh", "leaves", "patterns", "SaveJob planning per process",
         "own tasks", "atom slots", "plan digest"],
        [[f"{p['devices']:,}", f"{p['processes']:,}", "x".join(map(str, p["mesh"])), p["leaves"],
          "fused/padded/stacked/plain" if p["patterned"] else "plain",
          f"{p['plan_s'] * 1e3:.1f} ms", f"{p['tasks']:,}", f"{p['slots']:,}", p["digest"]]
         for p in plans],
        align="rrrrlrrrl",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Parse arguments; one worker per device count, the planning simulation, the tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="*", default=[8, 64, 256])
    ap.add_argument("--plan-devices", type=int, nargs="*",
                    default=[256, 1024, 4096, 16384])  # fmt: skip
    ap.add_argument("--plan-leaves", type=int, default=300)
    ap.add_argument("--per-process", type=int, default=8, help="devices per process (planning)")
    ap.add_argument("--layout", default="aggregated", choices=["aggregated", "per-array"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--plan-only", action="store_true",
                    help="only the simulated planning (no device runs, no Orbax)")  # fmt: skip
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.repeats, args.work)))
        return
    rows = []
    for n in [] if args.plan_only else args.devices:
        r = run_worker(n, args.repeats, args.layout)
        r["save_ratio"] = r["ucp_save"] / r["orbax_save"]
        r["restore_ratio"] = r["ucp_restore"] / r["orbax_restore"]
        r["objects_ratio"] = r["ucp_objects"] / r["orbax_objects"]
        rows.append(r)
        print(f"{n} devices done", file=sys.stderr)
    plans = plan_sim(args.plan_devices, args.plan_leaves, args.per_process)
    plans += plan_sim(args.plan_devices, args.plan_leaves, args.per_process, patterned=True)
    import ucp_jax

    print(f"ucp_jax from {ucp_jax.__file__}; planner: {plans[-1]['planner']}", file=sys.stderr)
    print(report(rows, plans))
    doc = {"targets": TARGETS, "repeats": args.repeats, "layout": args.layout, "rows": rows,
           "planning": plans, "load_average": load_average()}  # fmt: skip
    if args.out:
        write_json(args.out, doc, indent=1)


if __name__ == "__main__":
    main()
