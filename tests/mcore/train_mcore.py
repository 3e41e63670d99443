"""Train a tiny Megatron-Core GPTModel on CPU (torchrun, gloo) and save torch_dist checkpoints.

    torchrun --nproc_per_node N tests/megatron/train_mcore.py --root OUT JOB [JOB ...]

Each JOB is `name:tp:pp:dtype:optim[:key=value...]` with optim one of `plain` (Megatron's
float16/fp32 optimizer, no distributed optimizer), `full` (distributed optimizer,
`fully_reshardable`) or `dp` (distributed optimizer, `dp_reshardable`; the same state is also
saved `fully_reshardable` to OUT/<name>_asfull). Options: `model=` `llama` (SwiGLU, RMSNorm, RoPE,
no biases, untied; the default), `gpt` (GELU MLP, biases, LayerNorm, tied embeddings, learned
positions), `gpt_rope` (the same with RoPE and untied embeddings), `moe` (the llama model with 4
SequentialMLP SwiGLU experts, top-2, in every layer); `ep=` the expert-parallel size, `etp=`
the expert tensor-parallel size (default: the tensor-parallel size); `args=1`
records Megatron-LM's `args` (an argparse.Namespace of the model's shape) in the common state.
For each job: train STEPS steps, save with `dist_checkpointing.save` to OUT/<name>, and write
OUT/<name>.json with the losses, the loss of a fixed batch (`eval`, forward only, the same batch
on every data-parallel rank), the next RESUME steps' losses (after the save, for resume
comparisons), and reference logits of a fixed batch (gathered over TP; PP=1 only). A job
`...:load=DIR` instead loads DIR at its own TP/PP/EP (the model and the optimizer), records
`eval`, trains RESUME steps and writes the losses to OUT/<name>.json.

The CPU shims below stand in for CUDA only in this script; Megatron itself is unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# imported in functions below: tests/forkrun.py imports them once, before it forks the ranks
FORK_PRELOAD = (
    "megatron.core.parallel_state", "megatron.core.tensor_parallel", "megatron.core.distributed",
    "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer", "megatron.core.transformer", "megatron.core.transformer.module",
    "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
)  # fmt: skip

# ------------------------------------------------------------------------------ CPU shims

# The one module of megatron-core that imports triton unconditionally (MoE paged stash kernels,
# unused here): a stand-in, so triton need not be installed.
_ps = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
_ps.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
_ps.paged_stash_copy_kernel = _ps.paged_stash_pop_kernel = None  # type: ignore[attr-defined]
_ps.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]  # type: ignore[attr-defined]
sys.modules[_ps.__name__] = _ps


class _Stream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, *_a: object) -> None:
        pass

    def record_event(self, *_a: object) -> None:
        pass


torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
torch.cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
torch.cuda.current_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
torch.cuda.manual_seed = lambda seed, *a, **k: torch.manual_seed(seed)  # type: ignore[assignment]
torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
torch.cuda.set_rng_state = lambda s, *a, **k: torch.set_rng_state(s)  # type: ignore[assignment]

_CUDA_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
               torch.bfloat16: "torch.cuda.BFloat16Tensor"}  # fmt: skip
_type = torch.Tensor.type


def _tensor_type(self: torch.Tensor, *args: object, **kw: object) -> object:
    if not args and not kw and self.dtype in _CUDA_NAMES:
        return _CUDA_NAMES[self.dtype]
    return _type(self, *args, **kw)  # type: ignore[arg-type]


torch.Tensor.type = _tensor_type  # type: ignore[assignment,method-assign]
torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment,method-assign]


def _cpu(dev: object) -> object:
    if dev is None:
        return dev
    if isinstance(dev, int) or (isinstance(dev, str) and dev.startswith("cuda")):
        return "cpu"
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    return dev


class _CudaToCpu(TorchFunctionMode):
    """Every `device=` argument that names CUDA names the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        to = getattr(func, "__name__", "") == "to" and len(args) > 1
        if to and isinstance(args[1], str | torch.device | int) and not isinstance(args[1], bool):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


# -------------------------------------------------------------------------------- the model

VOCAB = 64  # padded (a multiple of 2 * TP); tokens of the data are < TRUE_VOCAB
TRUE_VOCAB = 60
HIDDEN, HEADS, GROUPS, FFN, LAYERS = 32, 4, 2, 48, 4
EXPERTS = 4
SEQ, MICRO, MICROBATCHES = 16, 2, 2
STEPS, RESUME = 2, 2
EPS, ROPE_BASE = 1e-5, 10000
if os.environ.get(
    "MCORE_DIMS"
):  # the benchmark's larger model: "vocab,hidden,heads,groups,ffn,layers"
    VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS = map(int, os.environ["MCORE_DIMS"].split(","))
    TRUE_VOCAB = VOCAB


def batch(step: int, dp_rank: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + micro)
    return torch.randint(0, TRUE_VOCAB, (MICRO, SEQ + 1), generator=g)


def ref_tokens() -> torch.Tensor:
    return torch.randint(0, TRUE_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def model_kw(model: str) -> dict:
    """TransformerConfig fields of a model kind (the llama one's are build()'s defaults)."""
    if model in ("gpt", "gpt_rope"):
        return dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=F.gelu,
                    add_bias_linear=True, add_qkv_bias=True)  # fmt: skip
    if model == "moe":
        return dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_grouped_gemm=False,
                    moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.01,
                    moe_router_load_balancing_type="aux_loss", moe_ffn_hidden_size=FFN)  # fmt: skip
    return {}


def megatron_lm_args(model: str):  # type: ignore[no-untyped-def]
    """What Megatron-LM's `args` records of the model (a subset of its argparse.Namespace)."""
    gpt = model.startswith("gpt")
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS,
        normalization="LayerNorm" if gpt else "RMSNorm", norm_epsilon=EPS, swiglu=not gpt,
        add_bias_linear=gpt, add_qkv_bias=gpt, untie_embeddings_and_output_weights=model != "gpt",
        position_embedding_type="learned_absolute" if model == "gpt" else "rope",
        max_position_embeddings=SEQ, rotary_base=ROPE_BASE, rotary_percent=1.0,
        padded_vocab_size=VOCAB, num_experts=EXPERTS if model == "moe" else None,
        moe_router_topk=2, openai_gelu=False, squared_relu=False,
    )  # fmt: skip


def build(
    tp: int,
    pp: int,
    dtype: str,
    optim: str,
    model_kind: str = "llama",
    ep: int = 1,  # type: ignore[no-untyped-def]
    etp: int | None = None,
):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )  # fmt: skip
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bf16 = dtype == "bf16"
    kw = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
              add_bias_linear=False, add_qkv_bias=False) | model_kw(model_kind)  # fmt: skip
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, ffn_hidden_size=FFN, layernorm_epsilon=EPS, **kw,
        hidden_dropout=0.0, attention_dropout=0.0, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=True, perform_initialization=True, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        init_method_std=0.2,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(
        normalization=kw["normalization"], num_experts=EXPERTS if model_kind == "moe" else None,
        moe_grouped_gemm=False,
    )  # fmt: skip
    model = GPTModel(
        config=cfg, transformer_layer_spec=spec,
        vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(), parallel_output=True,
        share_embeddings_and_output_weights=model_kind == "gpt",
        position_embedding_type="learned_absolute" if model_kind == "gpt" else "rope",
        rotary_base=ROPE_BASE,
    )  # fmt: skip
    if bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)  # as Megatron-LM wraps a bf16 model
    distributed = optim in ("full", "dp")
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed
    )
    model = DDP(cfg, ddp_cfg, model)
    cfg.finalize_model_grads_func = finalize_model_grads
    ocfg = OptimizerConfig(
        optimizer="adam", lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, clip_grad=1.0, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=distributed,
    )  # fmt: skip
    opt = get_megatron_optimizer(ocfg, [model])
    return model, opt


def _losses(model, batches: list, forward_only: bool) -> float:  # type: ignore[no-untyped-def]
    """The mean loss of `batches` (one per microbatch) over the data-parallel ranks, on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = iter(batches)

    def forward_step(it, m):  # type: ignore[no-untyped-def]
        b = next(it)
        tokens, labels = b[:, :-1], b[:, 1:]
        pos = torch.arange(SEQ).unsqueeze(0).expand(b.shape[0], SEQ)
        out = m(tokens, pos, None, labels=labels)

        def loss_func(o):  # type: ignore[no-untyped-def]
            loss = o.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    res = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[model],
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=batches[0].shape[0],
        forward_only=forward_only,
    )  # fmt: skip
    loss = torch.zeros(1, dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        loss[0] = float(sum(r["loss"] for r in res) / len(res))
        torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
        loss /= ps.get_data_parallel_world_size()
    torch.distributed.all_reduce(loss)  # the last stage's tp * dp ranks each add it once
    n = ps.get_tensor_model_parallel_world_size() * ps.get_data_parallel_world_size()
    return float(loss[0]) / n


def train(model, opt, steps: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_rank()
    losses = []
    for step in steps:
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = _losses(model, [batch(step, dp, m) for m in range(MICROBATCHES)], False)
        opt.step()
        losses.append(loss)
    return losses


def eval_loss(model) -> float:  # type: ignore[no-untyped-def]
    """The loss of one fixed batch, the same on every data-parallel rank (forward only)."""
    g = torch.Generator().manual_seed(99)
    fixed = torch.randint(0, TRUE_VOCAB, (4, SEQ + 1), generator=g)
    model.eval()
    with torch.no_grad():
        loss = _losses(model, [fixed], True)
    model.train()
    return loss


def reference_logits(model) -> list | None:  # type: ignore[no-untyped-def]
    """Logits of ref_tokens() (gathered over TP) on the last stage; PP=1 only."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if ps.get_pipeline_model_parallel_world_size() > 1:
        return None
    toks = ref_tokens()
    pos = torch.arange(SEQ).unsqueeze(0).expand(toks.shape[0], SEQ)
    model.eval()
    with torch.no_grad():
        out = model(toks, pos, None)
        out = gather_from_tensor_model_parallel_region(out)
    model.train()
    return out.float().tolist()


def sharded_sd(model, opt, optim: str, loading: bool = False):  # type: ignore[no-untyped-def]
    msd = model.module.sharded_state_dict()
    meta = {"distrib_optim_sharding_type": {"full": "fully_reshardable", "dp": "dp_reshardable"}.get(
        optim, "fully_reshardable")}  # fmt: skip
    osd = opt.sharded_state_dict(msd, is_loading=loading, metadata=meta)
    return {"model": msd, "optimizer": osd, "iteration": STEPS}


def _fork_the_write_results_queue() -> None:
    """Megatron's saver keeps its write results in a multiprocessing Manager that it starts in a
    *spawned* process on every rank: a fresh interpreter importing torch again, 40% of a small
    job's CPU here. The same Manager, forked from the rank; what is saved is unchanged."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("jobs", nargs="+")
    a = ap.parse_args()
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    from megatron.core import dist_checkpointing

    # torch's Adam keeps a per-parameter `step` tensor (Apex's and Transformer Engine's fused Adam
    # do not), which the distributed optimizer's fully_reshardable load then looks for among the
    # saved tensors (it saves the step in the param groups): the saved ones, without it
    from megatron.core.optimizer import distrib_optimizer as dopt
    from megatron.core.tensor_parallel import random as mrandom

    _set_states = dopt.DistributedOptimizer._set_main_param_and_optimizer_states
    dopt.DistributedOptimizer._set_main_param_and_optimizer_states = (  # type: ignore[method-assign]
        lambda self, p, tensors: _set_states(self, p, {"step": None, **tensors})
    )
    # the CUDA RNG tracker on the CPU generator
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)

    _fork_the_write_results_queue()
    with _CudaToCpu():
        for job in a.jobs:
            name, tp, pp, dtype, optim, *rest = job.split(":")
            opts = dict(r.split("=", 1) for r in rest)
            kind = opts.get("model", "llama")
            etp = int(opts["etp"]) if "etp" in opts else None
            model, opt = build(int(tp), int(pp), dtype, optim, kind, int(opts.get("ep", 1)), etp)
            out: dict = {}
            if "load" not in opts:
                out["losses"] = train(model, opt, list(range(STEPS)))
                path = os.path.join(a.root, name)
                os.makedirs(path, exist_ok=True)
                extra = {"args": megatron_lm_args(kind)} if opts.get("args") else {}
                dist_checkpointing.save(sharded_sd(model, opt, optim) | extra, path)
                if optim == "dp":  # the same state in the fully_reshardable layout: the referee
                    os.makedirs(path + "_asfull", exist_ok=True)
                    dist_checkpointing.save(sharded_sd(model, opt, "full"), path + "_asfull")
                out["eval"] = eval_loss(model)
                out["logits"] = reference_logits(model)
                out["resumed"] = train(model, opt, list(range(STEPS, STEPS + RESUME)))
            else:
                if optim != "plain":  # torch's Adam has no state before its first step (Apex's
                    # and Transformer Engine's fused Adam do), which the distributed optimizer's
                    # state_dict needs: Megatron's own dummy-state initialisation, on CPU
                    for o in getattr(opt, "chained_optimizers", [opt]):
                        o._init_optimizer_states_with_dummy_values()
                sd = sharded_sd(model, opt, optim, loading=True)
                state = dist_checkpointing.load(sd, opts["load"])
                model.module.load_state_dict(state["model"])
                with torch.no_grad():
                    opt.load_state_dict(state["optimizer"])
                out["eval"] = eval_loss(model)
                out["resumed"] = train(model, opt, list(range(STEPS, STEPS + RESUME)))
                out["logits"] = None
            gathered: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, out.get("logits"))
            out["logits"] = next((x for x in gathered if x is not None), None)
            if rank == 0:
                with open(os.path.join(a.root, name + ".json"), "w") as f:
                    json.dump(out, f)
            torch.distributed.barrier()
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
