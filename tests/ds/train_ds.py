"""Train the tiny GPT with real DeepSpeed on CPU (gloo): save checkpoints, or resume from one.

Run under torchrun. Several jobs share one process group (DeepSpeed's start-up cost is paid once):
    torchrun --nproc_per_node 2 tests/ds/train_ds.py --root OUT z1_fp32:1:fp32 z2_bf16:2:bf16
trains a fresh model per job for --steps steps and saves it to OUT/<name> (tag global_step<N>,
with `universal_checkpoint_info` so that ds_to_universal accepts it). Resuming:
    torchrun --nproc_per_node 2 tests/ds/train_ds.py [--tag T] [--universal] \
        --steps 2 --result losses.json z1:1:fp32:DIR other:3:bf16:DIR2
Rank 0 writes {name: {"start", "losses", "global_steps"}} to --result (global mean losses).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed
import deepspeed.comm as dist
from ds_cpu import skip_the_inference_shm_op
from tiny_model import BATCH, batch, init_model


def config(stage: int, dtype: str, world: int, universal: bool) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0)
        if world == 3:  # several optimizer sub-groups (each its own flat fp32 partition)
            zero.update(sub_group_size=2000)
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
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 1000,
    }
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def run(job: str, args: argparse.Namespace, world: int, rank: int) -> dict:
    name, stage, dtype, *load = job.split(":")
    load_dir = load[0] if load else args.load
    model = init_model(0)
    if "frozen" in name:  # a frozen layer: no optimizer state, kept in the model states
        model.blocks[0].fc1.requires_grad_(False)
    if "tied" in name:  # the head is the embedding (DeepSpeed records it as shared_params)
        model.head.weight = model.emb.weight
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(int(stage), dtype, world, args.universal),
    )
    start = 0
    if load_dir:
        path, _ = engine.load_checkpoint(load_dir, tag=args.tag)
        assert path is not None, f"nothing loaded from {load_dir}"
        start = engine.global_steps
    losses = []
    per = BATCH // world
    for step in range(start, start + args.steps):
        tokens = batch(step)[rank * per : (rank + 1) * per]
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t.item()) / world)
    if args.root:
        engine.save_checkpoint(
            os.path.join(args.root, name), client_state={"universal_checkpoint_info": {}}
        )
    dist.barrier()
    return {"start": start, "losses": losses, "global_steps": engine.global_steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", nargs="+", help="name:stage:dtype[:load_dir] (dtype fp32 or bf16)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--root", help="save each job's checkpoint to ROOT/<name>")
    ap.add_argument("--load", help="load this checkpoint folder before training")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--universal", action="store_true", help="load_universal: true")
    ap.add_argument("--result", help="rank 0 writes the losses here (JSON)")
    args = ap.parse_args()

    skip_the_inference_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = {job.split(":")[0]: run(job, args, world, rank) for job in args.jobs}
    if rank == 0 and args.result:
        with open(args.result, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
