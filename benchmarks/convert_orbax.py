"""Orbax checkpoint -> universal: `ucp convert orbax` vs Orbax restore of the whole tree + `ucp.save`.

Builds (once, cached in --workdir) an Orbax `StandardCheckpointer` checkpoint of params + Adam
state sharded on a (2, 4) mesh of CPU devices (OCDBT, Orbax's defaults): an embedding of
--embed-mib, a head of half that, a scanned [8, 1024, 1024] block stack and biases, with `mu` and
`nu`: 1.2 GiB with the defaults. Then, each in a fresh process, one after the other:

- `ucp convert orbax SRC DST` (streams array by array);
- the route a user has without it: `StandardCheckpointer().restore` of the whole tree onto one
  device, then `ucp.save` of it;
- an idle process that only imports what the converter imports (the interpreter's own RSS).

It measures wall time, CPU seconds and the peak resident memory of each process tree (sampled
every 20 ms), checks both outputs hold identical atoms, and prints a table (and --json).
`--repeat N` runs the processes N times, their order reversed every other round, and reports
medians with their range (peak RSS: the largest); `--baseline DIR` adds `ucp convert orbax` of
another ucp_jax checkout (e.g. the commit before a change) to every round.

    python benchmarks/convert_orbax.py [--embed-mib 256] [--workdir /tmp/ucp_bench_orbax]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, REPO)  # this checkout's ucp_jax, before any installed one

from harness import (  # noqa: E402
    MiB,
    Spread,
    child_cpu_seconds,
    child_env,
    interleaved,
    markdown_table,
    run_measured,
    sibling_executable,
    sync,
    write_json,
)


def build(path: str, embed_mib: int) -> None:
    """Write the Orbax checkpoint (runs in a worker process with 8 CPU devices)."""
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    dim = 4096
    rows = embed_mib * 2**20 // (dim * 4)

    def arr(shape: tuple[int, ...], spec: P) -> jax.Array:
        x = rng.standard_normal(shape, np.float32)
        return jax.device_put(x, NamedSharding(mesh, spec))

    params = {
        "embed": {"embedding": arr((rows, dim), P("model", "data"))},
        "blocks": {"mlp": {"kernel": arr((8, 1024, 1024), P(None, "data", "model")),
                           "bias": arr((8, 1024), P(None, "model"))}},
        "head": {"kernel": arr((dim, rows // 2), P("data", "model"))},
    }  # fmt: skip
    mu = jax.tree.map(lambda x: x * 0.1, params)
    nu = jax.tree.map(lambda x: x * x, params)
    opt = (optax.ScaleByAdamState(jax.numpy.asarray(1000, jax.numpy.int32), mu, nu),
           optax.EmptyState())  # fmt: skip
    with ocp.StandardCheckpointer() as ck:
        ck.save(path, {"params": params, "opt_state": opt, "step": 1000})


def today(src: str, dst: str) -> None:
    """Orbax restore of the whole tree onto one device, then ucp.save: the route without ucp."""
    import jax
    import orbax.checkpoint as ocp

    import ucp_jax as ucp

    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ck:
        meta = ck.metadata(src).item_metadata.tree
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), meta)
        state = ck.restore(src, target)
    ucp.save(dst, state["params"], state["opt_state"], step=int(state["step"]))


def idle() -> None:
    """Import what `ucp convert orbax` imports, and nothing else."""
    import orbax.checkpoint  # noqa: F401

    import ucp_jax._src.frameworks.orbax.read  # noqa: F401


def compare(a: str, b: str) -> int:
    """Both checkpoints hold the same atoms, slots and bytes; returns the arrays compared."""
    import numpy as np

    import ucp_jax as ucp

    ca, cb = ucp.open(a), ucp.open(b)
    assert sorted(ca.atoms) == sorted(cb.atoms), (sorted(ca.atoms), sorted(cb.atoms))
    n = 0
    for name, info in ca.atoms.items():
        assert set(info.slots) == set(cb.atoms[name].slots), name
        for slot in info.slots:
            x, y = np.asarray(ca.read(name, slot)), np.asarray(cb.read(name, slot))
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), (name, slot)
            n += 1
    return n


def main() -> None:
    """Parse arguments; build the checkpoint once, run the three processes, compare."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--embed-mib", type=int, default=256, help="size of the largest array")
    ap.add_argument("--workdir", default="/tmp/ucp_bench_orbax")
    ap.add_argument("--json", default="bench_out/convert_orbax.json", help="results as JSON")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every process (medians)")
    ap.add_argument("--baseline", default=None, help="another ucp_jax checkout to time as well")
    ap.add_argument("--worker", nargs="+", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, *rest = args.worker
        {"build": lambda: build(rest[0], args.embed_mib), "today": lambda: today(*rest),
         "idle": idle}[kind]()  # fmt: skip
        return
    src = os.path.join(args.workdir, f"orbax_{args.embed_mib}")
    env = child_env(pythonpath=[REPO])
    if not os.path.isdir(src):
        print(f"building the Orbax checkpoint in {src} ...", flush=True)
        build_env = child_env(8, base=env)
        subprocess.run([sys.executable, HERE, "--embed-mib", str(args.embed_mib), "--worker",
                        "build", src], check=True, env=build_env)  # fmt: skip
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(src) for f in fs)
    largest = args.embed_mib * 2**20
    out_convert = os.path.join(args.workdir, "ucp_convert")
    out_today = os.path.join(args.workdir, "ucp_today")
    cmds = {
        # the console script: `python -m` would put the working directory first on sys.path,
        # before a --baseline checkout's PYTHONPATH
        "ucp convert orbax": [sibling_executable("ucp"), "convert", "orbax", src, out_convert],
        "Orbax restore + ucp.save": [sys.executable, HERE, "--worker", "today", src, out_today],
        "idle (imports only)": [sys.executable, HERE, "--worker", "idle"],
    }  # fmt: skip
    envs = {name: env for name in cmds}
    if args.baseline:
        out_base = os.path.join(args.workdir, "ucp_convert_baseline")
        cmds["ucp convert orbax (baseline)"] = [*cmds["ucp convert orbax"][:-1], out_base]
        envs["ucp convert orbax (baseline)"] = dict(env, PYTHONPATH=os.path.abspath(args.baseline))
    runs: dict[str, list[tuple[float, int, float]]] = {name: [] for name in cmds}
    for i, order in interleaved(list(cmds), args.repeat):
        for name in order:
            if cmds[name][-1].startswith(args.workdir):
                shutil.rmtree(cmds[name][-1], ignore_errors=True)
            sync()  # no dirty pages of the run before
            c0 = child_cpu_seconds()
            wall, peak, _ = run_measured(cmds[name], envs[name])
            cpu = child_cpu_seconds() - c0
            runs[name].append((wall, peak, cpu))
            print(f"round {i + 1}: {name}: {wall:.1f} s, {cpu:.1f} CPU s, peak RSS "
                  f"{peak / MiB:.0f} MiB", flush=True)  # fmt: skip
    results = {}
    for name, r in runs.items():
        wall = Spread.of(x[0] for x in r)
        results[name] = {"wall_s": round(wall.median, 2), "wall_min_s": round(wall.min, 2),
                         "wall_max_s": round(wall.max, 2),
                         "cpu_s": round(Spread.of(x[2] for x in r).median, 2),
                         "peak_rss_bytes": max(x[1] for x in r), "runs": r}  # fmt: skip
    t0 = time.perf_counter()
    checked = compare(out_convert, out_today)
    a, b = results["ucp convert orbax"], results["Orbax restore + ucp.save"]
    base = results["idle (imports only)"]["peak_rss_bytes"]

    def line(r: dict) -> str:
        return (f"{r['wall_s']:.1f} s ({r['wall_min_s']:.1f}-{r['wall_max_s']:.1f}), "
                f"{r['cpu_s']:.1f} CPU s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")  # fmt: skip

    rows = [
        ("checkpoint", f"Orbax StandardCheckpointer, OCDBT, params + Adam mu/nu on a (2, 4) "
                       f"mesh, {size / 2**30:.2f} GiB on disk, largest array "
                       f"{largest / 2**20:.0f} MiB"),
        ("ucp convert orbax", line(a)),
        ("Orbax restore + ucp.save", line(b)),
        ("speed-up", f"{b['wall_s'] / a['wall_s']:.2f}x (CPU {b['cpu_s'] / a['cpu_s']:.2f}x)"),
        ("idle interpreter (same imports)", f"peak RSS {base / 2**20:.0f} MiB"),
        ("ucp peak RSS / largest array", f"{a['peak_rss_bytes'] / largest:.2f} (above the idle "
                                         f"interpreter: {(a['peak_rss_bytes'] - base) / largest:.2f})"),
    ]  # fmt: skip
    if args.baseline:
        c = results["ucp convert orbax (baseline)"]
        rows += [
            ("baseline ucp convert orbax", line(c)),
            ("baseline peak RSS / largest array", f"{c['peak_rss_bytes'] / largest:.2f}"),
        ]
    rows.append(("identical atoms", f"{checked} arrays compared in "
                                    f"{time.perf_counter() - t0:.1f} s"))  # fmt: skip
    print()
    print(markdown_table(["", ""], rows))
    if args.json:
        write_json(args.json, {"results": results, "largest_array_bytes": largest,
                               "checkpoint_bytes": size, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
