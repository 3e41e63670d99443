"""Fine-tune a tiny Hugging Face Mixtral under DeepSpeed ZeRO-3 on CPU (gloo), as the HF Trainer does.

    torchrun --nproc_per_node 2 tests/ds/train_hf_moe.py --root OUT hm_fused:fp32:fused ...

Each job `name:dtype:experts` builds transformers' MixtralForCausalLM (random init, seed 0) with
its sparse block a ZeRO-3 leaf (`deepspeed.utils.set_z3_leaf_modules`: each rank runs only some
experts, so ZeRO-3 must gather the block's parameters as one), trains STEPS AdamW steps, saves
`engine.save_checkpoint(OUT/<name>)` with the model's `config.json` beside `global_step<N>/` (the
HF Trainer's checkpoint folder), and dumps what the engine holds (engine_rank<R>.pt: {parameter:
{"fp32", "exp_avg", "exp_avg_sq"}}, DeepSpeed's safe_get_full_* helpers). `experts` is `fused`
(transformers 5's `mlp.experts.gate_up_proj` / `down_proj`) or `per_expert` (the layout of
transformers before 5: `block_sparse_moe.experts.<e>.w1/w2/w3`, `block_sparse_moe.gate`, emulated
here on transformers 5 by per-expert Linear modules computing the same).
"""

from __future__ import annotations

import argparse
import os

import deepspeed
import deepspeed.comm as dist
import torch
import transformers as T
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from ds_cpu import skip_the_inference_shm_op
from torch import nn

STEPS, BATCH, SEQ = 3, 4, 12


def config() -> T.MixtralConfig:
    return T.MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


class _Expert(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)  # gate
        self.w2 = nn.Linear(f, d, bias=False)  # down
        self.w3 = nn.Linear(d, f, bias=False)  # up


class PerExpert(nn.ModuleList):
    """transformers 4's experts (one module each), with transformers 5's MixtralExperts forward."""

    def forward(self, h: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:  # fmt: skip
        out = torch.zeros_like(h)
        for e, ex in enumerate(self):
            pos, k = torch.where(top_k_index == e)
            y = ex.w2(nn.functional.silu(ex.w1(h[pos])) * ex.w3(h[pos]))
            out.index_add_(0, pos, (y * top_k_weights[pos, k, None]).to(out.dtype))
        return out


def per_expert(model: nn.Module) -> None:
    """Give `model` transformers 4's parameter names: `block_sparse_moe.experts.<e>.w1/w2/w3`."""
    for layer in model.model.layers:
        moe = layer.mlp
        fused = moe.experts
        f = fused.intermediate_dim
        experts = PerExpert(_Expert(fused.hidden_dim, f) for _ in range(fused.num_experts))
        with torch.no_grad():
            for e, ex in enumerate(experts):
                ex.w1.weight.copy_(fused.gate_up_proj[e, :f])
                ex.w3.weight.copy_(fused.gate_up_proj[e, f:])
                ex.w2.weight.copy_(fused.down_proj[e])
        moe.experts = experts
        del layer._modules["mlp"]
        layer.block_sparse_moe = moe
        layer.__class__ = type("Layer", (layer.__class__,), {"mlp": property(
            lambda self: self.block_sparse_moe)})  # fmt: skip


def build(experts: str) -> nn.Module:
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config(), attn_implementation="eager").float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "gate.weight" in name else 0.15)
    if experts == "per_expert":
        per_expert(model)
    return model


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, config().vocab_size, (BATCH, SEQ), generator=g)


def ds_config(dtype: str, world: int) -> dict:
    return {
        "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": dtype == "bf16"}, "steps_per_print": 1000,
    }  # fmt: skip


def run(job: str, root: str, world: int, rank: int) -> None:
    name, dtype, experts = job.split(":")
    model = build(experts)
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    deepspeed.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(dtype, world))  # fmt: skip
    per = BATCH // world
    for step in range(STEPS):
        tokens = batch(step)[rank * per : (rank + 1) * per]
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    folder = os.path.join(root, name)
    engine.save_checkpoint(folder)
    out = {}
    for pname, p in model.named_parameters():
        full = {"fp32": safe_get_full_fp32_param(p)}
        for key in ("exp_avg", "exp_avg_sq"):
            full[key] = safe_get_full_optimizer_state(p, key)
        out[pname] = {k: v.detach().clone().float() for k, v in full.items()}
    if rank == 0:
        model.config.save_pretrained(folder)  # config.json beside global_step<N>/, as HF's
        torch.save(out, os.path.join(folder, "engine_state.pt"))
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("jobs", nargs="+", help="name:dtype:experts (fp32|bf16, fused|per_expert)")
    ap.add_argument("--root", required=True)
    args = ap.parse_args()
    skip_the_inference_shm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    for job in args.jobs:
        run(job, args.root, dist.get_world_size(), dist.get_rank())


if __name__ == "__main__":
    main()
