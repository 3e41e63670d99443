"""Train the tiny MoE model with real DeepSpeed on CPU (gloo), save, and dump the engine's state.

Run under torchrun; several jobs share one process group:
    torchrun --nproc_per_node 4 tests/ds/train_moe.py --root OUT m_z1_fp32:1:fp32:2 m_z2_bf16:2:bf16:2
Each job (name:stage:dtype:ep_size) trains --steps steps and saves OUT/<name> (tag global_step<N>),
then writes OUT/<name>/engine_rank<R>.pt from every rank: {global parameter name: {"fp32",
"exp_avg", "exp_avg_sq"}} read from the engine with DeepSpeed's safe_get_full_* helpers (expert
names use the global expert index, as DeepSpeed's expert files do), and trains --more steps after
the save (the losses a resumed job must reproduce). Resuming instead:
    torchrun ... train_moe.py --load DIR [--universal] --steps 2 --result r.json name:1:fp32:2
Rank 0 writes {name: {"start", "losses", "more", "global_steps"}} to --result.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state
from ds_cpu import skip_the_inference_shm_op
from moe_model import BATCH, TinyMoE, batch

LOCAL = re.compile(r"(deepspeed_experts\.)(\d+)(\.)")


def config(stage: int, dtype: str, world: int, universal: bool) -> dict:
    cfg = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 1e-2,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.1,
                "torch_adam": True,
            },
        },
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 1000,
    }
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def train(engine, start: int, steps: int, world: int, rank: int) -> list[float]:
    losses = []
    per = BATCH // world
    for step in range(start, start + steps):
        loss = engine(batch(step)[rank * per : (rank + 1) * per])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t.item()) / world)
    return losses


def dump(engine, model: TinyMoE, ep_size: int, path: str) -> None:
    """Every parameter's fp32 master and Adam moments as the engine holds them (global names)."""
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep_size}")
    out = {"ep_rank": ep_rank, "ep_size": ep_size, "params": {}}
    layers = {attr: (groups._get_expert_parallel_rank(f"ep_size_{ep}"),
                     len(getattr(model, attr).deepspeed_moe.experts.deepspeed_experts))
              for attr, ep in model.ep_sizes.items()}  # fmt: skip
    # DeepSpeed links the optimizer states to the parameters after the first group's first step,
    # before the later (MoE) groups have states: link again now that every group has them.
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen: its weights, no optimizer state
            full = {"fp32": p.data.float()}
        else:
            full = {"fp32": safe_get_full_fp32_param(p)}
            for key in ("exp_avg", "exp_avg_sq"):
                full[key] = safe_get_full_optimizer_state(p, key)
        r, local = layers.get(name.split(".")[0], (0, 0))
        name = LOCAL.sub(lambda m, r=r, local=local: f"{m[1]}{r * local + int(m[2])}{m[3]}", name)
        out["params"][name] = {k: v.detach().clone().float() for k, v in full.items()}
    torch.save(out, path)


def run(job: str, args: argparse.Namespace, world: int, rank: int) -> dict:
    name, stage, dtype, ep, *load = job.split(":")
    ep_size, _, second = ep.partition("+")  # "2+4": a second MoE block at expert-parallel 4
    ep_size = int(ep_size)
    load_dir = load[0] if load else args.load
    model = TinyMoE(ep_size, rank, int(second) if second else None)
    if "frozen" in name:  # every expert's fc2 frozen: kept out of the optimizer
        for n, p in model.named_parameters():
            if re.search(r"deepspeed_experts\.\d+\.fc2\.", n):
                p.requires_grad_(False)
    params = split_params_into_different_moe_groups_for_optimizer(
        {"params": [p for p in model.parameters() if p.requires_grad], "name": "main"}
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=params,
        config=config(int(stage), dtype, world, args.universal),
    )
    assert groups._get_expert_parallel_rank(f"ep_size_{ep_size}") == rank % ep_size
    start = 0
    if load_dir:
        path, _ = engine.load_checkpoint(load_dir, tag=args.tag)
        assert path is not None, f"nothing loaded from {load_dir}"
        start = engine.global_steps
    losses = train(engine, start, args.steps, world, rank)
    more: list[float] = []
    if args.root:
        folder = os.path.join(args.root, name)
        engine.save_checkpoint(folder)
        dump(engine, model, ep_size, os.path.join(folder, f"engine_rank{rank}.pt"))
        more = train(engine, start + args.steps, args.more, world, rank)
    dist.barrier()
    return {"start": start, "losses": losses, "more": more, "global_steps": engine.global_steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", nargs="+", help="name:stage:dtype:ep_size[:load_dir]")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--more", type=int, default=2, help="steps trained after the save")
    ap.add_argument("--root", help="save each job's checkpoint to ROOT/<name>")
    ap.add_argument("--load", help="load this checkpoint folder before training")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--universal", action="store_true", help="load_universal: true")
    ap.add_argument("--result", help="rank 0 writes the losses here (JSON)")
    args = ap.parse_args()
    rank = os.environ.get("RANK", "0")
    if os.environ.get("PYTHONHASHSEED") != rank:
        # Each rank hashes strings with its own seed, as separate interpreters do by default:
        # DeepSpeed orders its MoE param groups from a set of names, so with several
        # expert-parallel sizes the order differs between ranks (fixed here, not left to chance).
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": rank}
        )

    skip_the_inference_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {job.split(":")[0]: run(job, args, world, rank) for job in args.jobs}
    if rank == 0 and args.result:
        with open(args.result, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
