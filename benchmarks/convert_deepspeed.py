"""DeepSpeed ZeRO checkpoint -> universal: DeepSpeed's ds_to_universal vs `ucp convert deepspeed`.

Builds (once, cached in --workdir) a real DeepSpeed ZeRO checkpoint of a GPT-2-sized model (12
layers, d=768, vocab 32000: 110M params, 150 tensors, 1.2 GiB of fp32 master weights + Adam
moments) on DP=2 ranks (CPU, gloo, torchrun), then converts the same
checkpoint with both tools in fresh processes, measuring wall time and the peak resident memory
of the whole process tree (sampled every 20 ms; --repeat runs each, alternating, median wall
time), and checks that both give the same tensors. Every run starts after a `sync` (no dirty
pages of the run before), and a timed `sync` after it says when its output is on disk:
`ucp convert` fsyncs what it wrote before it commits, torch.save (in ds_to_universal) does not.
Each run's CPU seconds (user + system, the whole process tree) are reported beside its wall time:
they depend less on what else the machine is doing. `--baseline DIR` adds a third tool, `ucp
convert` of another ucp_jax checkout (e.g. the commit before a change), in the same rounds.

    python benchmarks/convert_deepspeed.py [--layers 12] [--dp 2] [--workdir /tmp/ucp_bench_ds]

Needs torch and deepspeed (pip install torch==2.13.0 deepspeed==0.19.8).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from harness import (
    MiB,
    Spread,
    child_cpu_seconds,
    child_env,
    dir_bytes,
    interleaved,
    markdown_table,
    run_measured,
    sibling_executable,
    sync,
    write_json,
)

HERE = os.path.abspath(__file__)


# ------------------------------------------------------------------------ the training worker


def gpt(vocab: int, dim: int, layers: int, seq: int) -> torch.nn.Module:  # noqa: F821
    """A GPT-2-like torch model (embeddings, pre-LN blocks with biases, untied head)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.ln1(x)).split(dim, -1)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a)
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
            for b in self.blocks:
                x = b(x)
            logits = self.head(self.ln_f(x[:, :-1])).float()
            return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return GPT()


def worker(out: str, layers: int, stage: int) -> None:
    """Under torchrun: one AdamW step of a GPT-2-sized model with DeepSpeed ZeRO, then save."""
    import deepspeed
    import deepspeed.comm as dist
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = gpt(vocab=32000, dim=768, layers=layers, seq=1024)
    cfg = {
        "train_batch_size": dist.get_world_size(),
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    loss = engine(torch.randint(0, 32000, (1, 16)))
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, client_state={"universal_checkpoint_info": {}})
    dist.barrier()


# ------------------------------------------------------------------------------- benchmark


def build(workdir: str, layers: int, dp: int, stage: int) -> str:
    """The checkpoint's tag folder, built once."""
    ck = os.path.join(workdir, f"ds_gpt{layers}_z{stage}_dp{dp}")
    tag = os.path.join(ck, "global_step1")
    if os.path.isdir(tag) and os.path.isfile(os.path.join(ck, "latest")):
        return tag
    shutil.rmtree(ck, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={dp}", HERE,
           "--worker", ck, "--layers", str(layers), "--stage", str(stage)]  # fmt: skip
    print(f"building the DeepSpeed checkpoint (GPT, {layers} layers, ZeRO-{stage}, DP={dp}) ...")
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return tag


def compile_bytecode(checkout: str) -> None:
    """Compile a checkout's modules, as installing a wheel does: without it (an editable install
    under PYTHONDONTWRITEBYTECODE) every `ucp` process compiles them from source first."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(checkout, "ucp_jax")],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip


def write_limit(nbytes: int, folder: str, repeats: int = 3) -> list[float]:
    """Seconds to pwrite `nbytes` in 64 MiB files and fsync them, on every core: the import's
    output bytes made durable with plain system calls, in this process (the roofline's write
    limit; the import can beat it: it drops its written pages as they land, and new page-cache
    pages cost more than reused ones on a VM)."""
    import numpy as np
    from roofline_limits import write_fsync

    block = np.random.default_rng(0).integers(0, 255, 64 * MiB, dtype=np.uint8)
    shards = [block] * (nbytes // block.size) + [block[: nbytes % block.size]]
    out = []
    for _ in range(repeats):
        shutil.rmtree(folder, ignore_errors=True)
        sync()
        out.append(write_fsync(shards, folder, os.cpu_count() or 1)[0])
    shutil.rmtree(folder, ignore_errors=True)
    return out


def compare(ds_out: str, ucp_out: str, sample: int = 6) -> int:
    """Check a few params, all slots, are bit-identical between the two conversions."""
    import numpy as np

    import ucp_jax as ucp
    from ucp_jax._src.frameworks.common.writer import to_numpy
    from ucp_jax._src.untrusted.unpickle import load

    ck = ucp.open(ucp_out)
    zero = os.path.join(ds_out, "zero")
    names = sorted(d for d in os.listdir(zero) if os.path.isdir(os.path.join(zero, d)))
    assert sorted(names) == sorted(ck.atoms), "different parameter sets"
    n = 0
    for name in names[:: max(1, len(names) // sample)]:
        for f in os.listdir(os.path.join(zero, name)):
            obj = load(os.path.join(zero, name, f))
            want = to_numpy(obj["param"] if isinstance(obj, dict) else obj).reshape(-1)
            got = np.asarray(ck.read(name, f[:-3])).reshape(-1)
            assert got.tobytes() == want.tobytes(), (name, f)
            n += 1
    return n


def main() -> None:
    """Parse arguments; build the checkpoint once, convert it with both tools, compare."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=12, help="transformer blocks (d=768)")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--workdir", default="/tmp/ucp_bench_ds")
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool (median wall time)")
    ap.add_argument("--json", default="bench_out/convert_deepspeed.json", help="results as JSON")
    ap.add_argument("--baseline", default=None, help="another ucp_jax checkout to time as well")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.layers, args.stage)
        return
    os.makedirs(args.workdir, exist_ok=True)
    tag = build(args.workdir, args.layers, args.dp, args.stage)
    files = sorted(os.listdir(tag))
    sizes = {f: os.path.getsize(os.path.join(tag, f)) for f in files}
    optim = {f: s for f, s in sizes.items() if "optim_states" in f}
    largest = max(optim.values())
    ds_out = os.path.join(args.workdir, "ds_universal", "global_step1")
    ucp_out = os.path.join(args.workdir, "ucp_universal")
    for d in (os.path.dirname(ds_out), ucp_out):
        shutil.rmtree(d, ignore_errors=True)
    compile_bytecode(os.path.dirname(os.path.dirname(HERE)))
    if args.baseline:
        compile_bytecode(os.path.abspath(args.baseline))
    sync()
    ds_cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
              "--input_folder", tag, "--output_folder", ds_out]  # fmt: skip
    ucp_cmd = [sibling_executable("ucp"), "convert", "deepspeed", tag, ucp_out, "--no-progress"]
    env = child_env(XLA_FLAGS="")
    cmds = {"ds_to_universal": ds_cmd, "ucp convert deepspeed": ucp_cmd}
    envs = {name: env for name in cmds}
    outs = {"ds_to_universal": os.path.dirname(ds_out), "ucp convert deepspeed": ucp_out}
    if args.baseline:
        base = "ucp convert deepspeed (baseline)"
        outs[base] = ucp_out + "_baseline"
        cmds[base] = [*ucp_cmd[:-2], outs[base], "--no-progress"]
        envs[base] = dict(env, PYTHONPATH=os.path.abspath(args.baseline))
    runs: dict[str, list[tuple[float, int, float, float]]] = {name: [] for name in cmds}
    # every tool in every round (a busy moment hits all), the ucp ones in alternating order
    for i, order in interleaved(list(cmds)[1:], args.repeat):
        for name in ["ds_to_universal", *order]:
            shutil.rmtree(outs[name], ignore_errors=True)
            sync()  # no dirty pages of the previous run left
            c0 = child_cpu_seconds()
            wall, peak, _ = run_measured(cmds[name], envs[name])
            cpu = child_cpu_seconds() - c0
            durable = wall + sync()  # what the tool left unwritten reaches the disk
            runs[name].append((wall, peak, durable, cpu))
            print(f"run {i + 1}: {name}: {wall:.1f} s ({durable:.1f} s until its output is on "
                  f"disk), {cpu:.1f} CPU s, peak RSS {peak / MiB:.0f} MiB")  # fmt: skip
    results = {
        name: {"wall_s": Spread.of(x[0] for x in r).median,
               "wall_min_s": Spread.of(x[0] for x in r).min,
               "wall_max_s": Spread.of(x[0] for x in r).max,
               "durable_s": Spread.of(x[2] for x in r).median,
               "cpu_s": Spread.of(x[3] for x in r).median,
               "peak_rss_bytes": max(x[1] for x in r), "runs": r}
        for name, r in runs.items()
    }  # fmt: skip
    checked = compare(ds_out, ucp_out)
    written, _ = dir_bytes(ucp_out)
    limit_runs = write_limit(written, os.path.join(args.workdir, "write_limit"))
    limit = Spread.of(limit_runs)
    n_atoms = len(os.listdir(os.path.join(ds_out, "zero"))) - 1
    total_state = sum(optim.values())
    a, b = results["ds_to_universal"], results["ucp convert deepspeed"]

    def line(r: dict) -> str:
        return (f"{r['wall_s']:.1f} s ({r['wall_min_s']:.1f}-{r['wall_max_s']:.1f}), "
                f"{r['cpu_s']:.1f} CPU s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")  # fmt: skip

    rows = [
        ("checkpoint", f"GPT ({args.layers} layers), ZeRO-{args.stage}, DP={args.dp}, "
                       f"{n_atoms} tensors, {total_state / 2**30:.2f} GiB of fp32+moments in "
                       f"{len(optim)} rank files"),
        ("largest rank file", f"{largest / 2**20:.0f} MiB"),
        ("ds_to_universal (median wall (range), CPU, max RSS)", line(a)),
        ("ucp convert deepspeed (median wall (range), CPU, max RSS)", line(b)),
        ("speed-up (wall time of the command)", f"{a['wall_s'] / b['wall_s']:.1f}x"),
        ("speed-up (CPU seconds)", f"{a['cpu_s'] / b['cpu_s']:.1f}x"),
        ("until the output is on disk (command + sync)",
         f"{a['durable_s']:.1f} s vs {b['durable_s']:.1f} s: {a['durable_s'] / b['durable_s']:.1f}x"),
        ("ucp peak RSS / largest rank file", f"{b['peak_rss_bytes'] / largest:.2f}"),
        ("its output's bytes written with plain pwrite + fsync (median (range))",
         f"{written / 2**30:.2f} GiB in {limit.median:.2f} s ({limit.min:.2f}-{limit.max:.2f}); "
         f"ucp convert takes {b['wall_s'] / limit.median:.2f}x that, process start included"),
    ]  # fmt: skip
    if args.baseline:
        c = results["ucp convert deepspeed (baseline)"]
        rows += [
            ("baseline ucp convert deepspeed (median wall (range), CPU, max RSS)", line(c)),
            ("this checkout vs baseline (wall, CPU)",
             f"{b['wall_s'] / c['wall_s']:.2f}x, {b['cpu_s'] / c['cpu_s']:.2f}x"),
        ]  # fmt: skip
    rows.append(("identical tensors (sampled)", f"{checked} files"))
    print()
    print(markdown_table(["", ""], rows))
    if args.json:
        write_json(args.json, {"results": results, "largest_rank_file": largest, "rows": rows,
                               "write_limit_s": limit_runs, "written_bytes": written})  # fmt: skip


if __name__ == "__main__":
    main()
