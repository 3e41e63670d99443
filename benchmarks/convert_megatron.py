"""Megatron-Core torch_dist checkpoint -> one file / universal: torch's `dcp_to_torch_save` vs
`ucp convert megatron`, wall time and peak RSS side by side.

Builds (once, cached in --workdir) a real Megatron-Core checkpoint of a Llama-like GPT (RMSNorm,
RoPE, SwiGLU, GQA; by default vocab 32000, d=1024, 16 heads in 4 groups, d_ff=2816, 4 layers:
110M parameters, fp32 weights + Adam moments, 1.2 GiB) with TP=2 on CPU (torchrun, gloo, the
test fixture's tests/mcore/train_mcore.py), then converts the same folder with both tools in
fresh processes (--repeat runs each, alternating; median wall time, max peak RSS of the process
tree, sampled every 20 ms), after a `sync` each, and checks that a few tensors agree.

    python benchmarks/convert_megatron.py [--layers 4] [--workdir /tmp/ucp_bench_mcore]

Needs torch and megatron-core 0.19.2 (see the Makefile's install step).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import (  # noqa: E402
    MiB,
    Spread,
    child_env,
    interleaved,
    markdown_table,
    run_measured,
    sibling_executable,
    sync,
    write_json,
)

SCRIPT = os.path.join(HERE, "..", "tests", "mcore", "train_mcore.py")
HEADS = 16


def build(workdir: str, dims: str) -> str:
    """The Megatron-Core checkpoint folder (TP=2, torchrun), built once in `workdir`."""
    src = os.path.join(workdir, "ckpt")
    if os.path.isfile(os.path.join(workdir, "DONE")):
        return src
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MCORE_DIMS=dims)
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_port=29611", SCRIPT, "--root", workdir, "ckpt:2:1:fp32:plain"]  # fmt: skip
    subprocess.run(cmd, check=True, env=env)
    open(os.path.join(workdir, "DONE"), "w").close()
    return src


def compare(pt: str, ucp_out: str) -> int:
    """A few tensors of torch's file equal the atoms they became."""
    import numpy as np
    import torch

    import ucp_jax as ucp

    sd = torch.load(pt, weights_only=True, mmap=True)
    ck = ucp.Checkpoint(ucp_out)
    pairs = [("embedding.word_embeddings.weight", "embed.embedding", lambda w: w),
             ("decoder.layers.mlp.linear_fc2.weight", "blocks.1.mlp.down.kernel", lambda w: w[1].T),
             ("output_layer.weight", "unembed.kernel", lambda w: w.T)]  # fmt: skip
    n = 0
    for key, atom, f in pairs:
        for slot, pre in (("fp32", ""), ("exp_avg", "optimizer.state.exp_avg.")):
            np.testing.assert_array_equal(ck.read(atom, slot), f(sd[pre + key]).numpy())
            n += 1
    return n


def main() -> None:
    """Parse arguments; build the checkpoint once, convert it with both tools, compare."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/ucp_bench_mcore")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="bench_out/convert_megatron.json")
    args = ap.parse_args()
    src = build(args.workdir, f"32000,1024,{HEADS},4,2816,{args.layers}")
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    pt = os.path.join(args.workdir, "torch_save.pt")
    ucp_out = os.path.join(args.workdir, "ucp")
    torch_cmd = [sys.executable, "-c", "import sys; from torch.distributed.checkpoint.format_utils "
                 "import dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])", src, pt]  # fmt: skip
    ucp_exe = sibling_executable("ucp")  # the venv's, unactivated
    ucp_cmd = [ucp_exe, "convert", "megatron", src, ucp_out, "--heads", str(HEADS)]
    env = child_env(XLA_FLAGS="", PYTHONWARNINGS="ignore")
    cmds = {"dcp_to_torch_save": (torch_cmd, pt), "ucp convert megatron": (ucp_cmd, ucp_out)}
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in cmds}
    for i, order in interleaved(list(cmds), args.repeat, alternate=False):
        for name in order:
            cmd, out = cmds[name]
            shutil.rmtree(out, ignore_errors=True) if os.path.isdir(out) else None
            if os.path.isfile(out):
                os.remove(out)
            sync()
            wall, peak, _ = run_measured(cmd, env)
            runs[name].append((wall, peak))
            print(f"run {i + 1}: {name}: {wall:.1f} s, peak RSS {peak / MiB:.0f} MiB")
    results = {n: {"wall_s": Spread.of(w for w, _ in r).median,
                   "peak_rss_bytes": max(p for _, p in r), "runs": r}
               for n, r in runs.items()}  # fmt: skip
    checked = compare(pt, ucp_out)
    a, b = results["dcp_to_torch_save"], results["ucp convert megatron"]
    rows = [
        ("checkpoint", f"Megatron-Core 0.19.2 GPT ({args.layers} layers, d=1024, vocab 32000), "
                       f"TP=2, fp32 + Adam, {size / 2**30:.2f} GiB in 2 rank files"),
        ("dcp_to_torch_save (median wall, max RSS)",
         f"{a['wall_s']:.1f} s, peak RSS {a['peak_rss_bytes'] / 2**20:.0f} MiB"),
        ("ucp convert megatron (median wall, max RSS)",
         f"{b['wall_s']:.1f} s, peak RSS {b['peak_rss_bytes'] / 2**20:.0f} MiB"),
        ("wall time ratio (torch / ucp)", f"{a['wall_s'] / b['wall_s']:.2f}x"),
        ("peak RSS ratio (torch / ucp)", f"{a['peak_rss_bytes'] / b['peak_rss_bytes']:.2f}x"),
        ("identical tensors (sampled)", f"{checked}"),
    ]  # fmt: skip
    print(markdown_table(None, rows, pad=True))
    write_json(args.json, {"checkpoint_bytes": size, "layers": args.layers, "results": results,
                           "table": rows})  # fmt: skip


if __name__ == "__main__":
    main()
