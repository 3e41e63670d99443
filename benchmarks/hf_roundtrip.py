"""Hugging Face <-> JAX mesh, both ways: ucp (streaming) vs the torch route a JAX user takes today.

Builds (once, in --workdir) a ~1 GB fp32 Llama from a config with transformers (random init,
``save_pretrained`` in shards), then, each in a fresh process with its own peak-RSS counter
(VmHWM, reset after the imports so the numbers are what the work itself adds):

* in, ucp:    ``import_hf`` (safetensors -> universal atoms) + ``ucp.restore`` onto a 2x4 mesh
* in, torch:  ``AutoModelForCausalLM.from_pretrained`` -> numpy -> fuse per TP -> ``device_put``
* ``import_hf`` alone (the CLI case: ``ucp convert hf``)
* out, ucp:   params on the 2x4 mesh -> ``ucp.save`` + ``export_hf`` (and ``export_hf`` alone)
* out, torch: params on the 2x4 mesh -> ``jax.device_get`` -> unfuse -> torch -> ``save_pretrained``

and prints one table (wall seconds, CPU seconds of the process, peak RSS added by the work,
largest shard). `--repeat N` runs every phase N times, the phases' order reversed every other
round (a busy moment of a shared machine hits all of them), and reports medians with their range;
`--baseline DIR` adds `import_hf` of another ucp_jax checkout (e.g. the commit before a change)
to each round; `--phases` picks phases.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/hf_roundtrip.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

from harness import (
    MiB,
    Spread,
    child_env,
    interleaved,
    markdown_table,
    peak_rss,
    reset_peak_rss,
    sync,
    write_json,
)

HERE = os.path.abspath(__file__)
SHARD = "400MB"
LAYOUT = dict(data=2, tensor=4)


def _hf_config(layers: int) -> dict:
    return dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                rope_theta=500000.0, tie_word_embeddings=False)  # fmt: skip


def _mesh_params(ck: str):
    import ucp_jax as ucp
    from ucp_jax.demo import Layout
    from ucp_jax.models import llama as L

    cfg = L.config_from_checkpoint(ck)
    layout = Layout(**LAYOUT)
    mesh = L.make_mesh(layout)
    params, _ = ucp.restore(
        ck, L.abstract_params(cfg, layout, mesh), rules=L.ucp_rules(cfg, layout)
    )
    return cfg, layout, mesh, params


def _sd_to_canonical(sd: dict, cfg) -> dict:
    """HF state dict (numpy) -> canonical atoms, via the same mapping as import_hf."""
    import numpy as np

    from ucp_jax._src.frameworks.hf.read import expand, hf_mapping

    out = {}
    for atom, (spec, srcs) in expand(hf_mapping(cfg), cfg.n_layers).items():
        arrays = [sd[s].T if spec.transpose else sd[s] for s in srcs]
        out[atom] = np.concatenate(arrays, axis=spec.axis) if len(arrays) > 1 else arrays[0]
    return out


def worker(phase: str, work: str) -> dict:
    """One measured phase; returns its numbers (peak RSS: what the phase adds after the imports)."""
    import jax
    import numpy as np
    import torch
    import transformers as T

    import ucp_jax as ucp
    from ucp_jax.models import llama as L
    from ucp_jax.torch import export_hf, import_hf

    src, ck = os.path.join(work, "hf_src"), os.path.join(work, "ucp")
    out: dict = {"phase": phase}
    if phase in ("out-ucp", "out-torch"):
        cfg, layout, mesh, params = _mesh_params(ck)  # the JAX job's params: not timed
        jax.block_until_ready(params)
    reset_peak_rss()
    base = peak_rss()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if phase == "in-ucp":
        shutil.rmtree(ck, ignore_errors=True)
        import_hf(src, ck)
        out["import_s"] = time.perf_counter() - t0
        cfg, layout, mesh, params = _mesh_params(ck)
        jax.block_until_ready(params)
    elif phase in ("import-only", "import-baseline"):
        import_hf(src, ck + ("2" if phase == "import-only" else "3"), overwrite=True)
    elif phase == "in-torch":
        model = T.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        cfg = L.config_from_hf(L.read_config_json(os.path.join(src, "config.json")))
        layout = L.Layout(**LAYOUT)
        mesh = L.make_mesh(layout)
        params = L.to_layout(_sd_to_canonical(sd, cfg), cfg, layout, mesh)
        jax.block_until_ready(params)
    elif phase == "out-ucp":
        saved = os.path.join(work, "saved")
        shutil.rmtree(saved, ignore_errors=True)
        ucp.save(saved, params, step=1, rules=L.ucp_rules(cfg, layout), extra=L.ucp_extra(cfg))
        out["save_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        export_hf(saved, os.path.join(work, "out_ucp"), max_shard_size=SHARD, overwrite=True)
        out["export_s"] = time.perf_counter() - t1
    elif phase == "export-only":
        export_hf(ck, os.path.join(work, "out_ucp2"), max_shard_size=SHARD, overwrite=True)
    elif phase == "out-torch":
        canon = L.from_layout(jax.device_get(params), cfg, layout)
        sd = {}
        from ucp_jax._src.frameworks.hf.read import expand, hf_mapping

        for atom, (spec, srcs) in expand(hf_mapping(cfg), cfg.n_layers).items():
            a = canon.pop(atom)
            parts = np.split(a, np.cumsum([cfg.qkv_sizes, (cfg.d_ff,) * 2][0 if "qkv" in atom else 1])[:-1], axis=spec.axis) if len(srcs) > 1 else [a]  # fmt: skip
            for s, p in zip(srcs, parts):
                sd[s] = torch.from_numpy(np.ascontiguousarray(p.T if spec.transpose else p))
        with torch.device("meta"):
            model = T.AutoModelForCausalLM.from_config(T.AutoConfig.for_model(**cfg.to_hf()))
        model.save_pretrained(os.path.join(work, "out_torch"), state_dict=sd, max_shard_size=SHARD)
    out["wall_s"] = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    out["peak_rss_added"] = peak_rss() - base
    return out


def build(work: str, layers: int) -> int:
    """The source HF folder (cached); returns its largest shard's size."""
    src = os.path.join(work, "hf_src")
    if not os.path.isdir(src):
        import torch
        import transformers as T

        torch.manual_seed(0)
        cfg = T.AutoConfig.for_model(**_hf_config(layers))
        model = T.AutoModelForCausalLM.from_config(cfg).float()
        model.save_pretrained(src + ".tmp", max_shard_size=SHARD)
        os.rename(src + ".tmp", src)
    return max(
        os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors")
    )


PHASES = ("in-ucp", "import-only", "in-torch", "out-ucp", "export-only", "out-torch")
NAMES = {"in-ucp": "HF -> mesh: ucp import_hf + restore",
         "import-only": "HF -> checkpoint: import_hf alone",
         "import-baseline": "HF -> checkpoint: import_hf alone, baseline checkout",
         "in-torch": "HF -> mesh: from_pretrained + numpy + device_put",
         "out-ucp": "mesh -> HF: ucp.save + export_hf",
         "export-only": "checkpoint -> HF: export_hf alone",
         "out-torch": "mesh -> HF: device_get + torch + save_pretrained"}  # fmt: skip


def main() -> None:
    """Parse arguments; build the HF folder once, run each phase in a fresh process, print."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/ucp_bench_hf")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every phase (medians)")
    ap.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to run")
    ap.add_argument("--baseline", default=None, help="another ucp_jax checkout: its import_hf too")
    ap.add_argument("--json", default=None, help="results as JSON")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(worker(args.phase, args.workdir)))
        return
    os.makedirs(args.workdir, exist_ok=True)
    largest = build(args.workdir, args.layers)
    total = sum(os.path.getsize(os.path.join(args.workdir, "hf_src", f))
                for f in os.listdir(os.path.join(args.workdir, "hf_src")))  # fmt: skip
    env = child_env(8, platform=None)
    phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        ap.error(f"--phases: unknown {', '.join(unknown)}; pick from {', '.join(PHASES)}")
    if "in-ucp" not in phases and not os.path.isdir(os.path.join(args.workdir, "ucp")):
        phases.insert(0, "in-ucp")  # the checkpoint the other phases start from
    if args.baseline:
        phases.append("import-baseline")
    runs: dict[str, list[dict]] = {p: [] for p in phases}
    for i, order in interleaved(phases, args.repeat):
        for phase in order:
            sync()
            penv = env if phase != "import-baseline" else dict(env, PYTHONPATH=args.baseline)
            cmd = [sys.executable, HERE, "--phase", phase,
                   "--workdir", args.workdir]  # fmt: skip
            r = subprocess.run(cmd, env=penv, capture_output=True, text=True)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                sys.exit(f"{phase} failed:\n{r.stderr[-3000:]}")
            runs[phase].append(json.loads(line[0][7:]))
            got = runs[phase][-1]
            print(
                f"round {i + 1}: {phase}: {got['wall_s']:.2f} s, {got['cpu_s']:.2f} CPU s",
                flush=True,
            )
    print(f"model: {total / MiB:.0f} MiB of safetensors, largest shard {largest / MiB:.0f} MiB, "
          f"mesh {LAYOUT}")  # fmt: skip
    table, results = [], {}
    for phase, rs in runs.items():
        wall, cpu = Spread.of(r["wall_s"] for r in rs), Spread.of(r["cpu_s"] for r in rs)
        added = max(r["peak_rss_added"] for r in rs)
        keys = [k for k in ("import_s", "save_s", "export_s") if k in rs[0]]
        detail = ", ".join(f"{k} {Spread.of(r[k] for r in rs).median:.2f}" for k in keys)
        results[phase] = {"wall_s": wall.median, "wall_min_s": wall.min, "wall_max_s": wall.max,
                          "cpu_s": cpu.median, "peak_rss_added": added, "runs": rs}  # fmt: skip
        table.append([NAMES[phase], f"{wall.median:.2f} ({wall.min:.2f}-{wall.max:.2f})",
                      f"{cpu.median:.2f}", f"{added / MiB:.0f}", f"{added / largest:.2f}",
                      detail])  # fmt: skip
    print(markdown_table(["route", "wall s (range)", "CPU s", "peak RSS added (MiB)",
                          "x largest shard", "detail"], table))  # fmt: skip
    if "in-torch" in results:
        torch_s = results["in-torch"]["wall_s"]
        for p in ("import-only", "in-ucp", "import-baseline"):
            if p in results:
                print(
                    f"{NAMES[p]}: {torch_s / results[p]['wall_s']:.2f}x faster than the torch "
                    f"route (medians; CPU {results['in-torch']['cpu_s'] / results[p]['cpu_s']:.2f}x)"
                )
    if args.json:
        write_json(args.json, {"results": results, "largest_shard": largest, "model_bytes": total})


if __name__ == "__main__":
    main()
