"""torchtitan 0.3.0 on CPU, with a tiny Llama 3 and exact loss records: the torchtitan fixtures'
training script (runs under `torchrun` in torchtitan's own virtualenv, never in ucp_jax's).

- The CPU shim of `shared/referees/tt_cpu_train.py` (why each patch exists:
  `torchtitan-cpu-blockers.err` there): device "cpu", eager flex attention with autograd, no
  `torch.distributed.set_timeout`, gloo reduce-scatter with SUM.
- `--module llama3 --config llama3_ucp_tiny`: torchtitan's `llama3_debugmodel` recipe (AdamW, warmup,
  c4_test data, fused wqkv) with a smaller model: dim 32, 4 heads in 2 KV groups (GQA), 2 layers,
  vocabulary 2048, Llama-3 RoPE (theta 500000, "llama" scaling), so a full checkpoint is ~2 MB.
- `UCP_TT_RECORD=<file>`: rank 0 appends one JSON line per step: exact loss, grad norm, lr.
- `UCP_TT_FIXED=<dir>`: the data loader is replaced by fixed batches (random tokens, positions
  0..s-1 in every row, so torchtitan's block-causal mask is the plain causal one); the logits of
  the first step's forward (the loaded state) and each step's tokens are saved in <dir>;
  `UCP_TT_TOKENS=<file.npy>` makes that batch the one of every step (the crossing's).
"""

from __future__ import annotations

import json
import os
import sys
import types

import numpy as np
import torch
import torchtitan.tools.utils as _u

_cpu = types.ModuleType("torchtitan_cpu_device_module")
_cpu.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
_cpu.set_device = lambda *a, **k: None
_cpu.current_device = lambda: 0
_cpu.device_count = lambda: 1
_cpu.get_device_name = lambda *a, **k: "cpu"
_cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=24 * 1024**3)
_cpu.memory_stats = lambda *a, **k: {}
_cpu.reset_peak_memory_stats = lambda *a, **k: None
_cpu.empty_cache = lambda *a, **k: None
_cpu.synchronize = lambda *a, **k: None
_u.device_type = "cpu"
_u.device_module = _cpu

import torch.distributed as _dist  # noqa: E402
import torch.distributed.fsdp._fully_shard._fsdp_collectives as _fc  # noqa: E402
import torch.nn.attention.flex_attention as _fa  # noqa: E402
from torchtitan.models.common.attention import FlexAttention as _FA  # noqa: E402

_fa._validate_device = lambda *a, **k: None
_FA._compiled_flex_attn = staticmethod(_fa.flex_attention)
if not hasattr(_dist, "set_timeout"):
    _dist.set_timeout = lambda *a, **k: None
_orig_gdf = _fc._get_gradient_divide_factors


def _gdf(rs, ar, dt, device_type="", factor=None, force_sum_reduction_for_comms=False):
    return _orig_gdf(rs, ar, dt, device_type, factor, True)


_fc._get_gradient_divide_factors = _gdf

# ------------------------------------------------------------------------- the tiny model
import torchtitan.models.llama3 as _l3  # noqa: E402
import torchtitan.models.llama3.config_registry as _registry  # noqa: E402
from torchtitan.models.common import (  # noqa: E402
    ComplexRoPE,
    Embedding,
    Linear,
    RMSNorm,
    compute_ffn_hidden_dim,
)

DIM, HEADS, KV_HEADS, LAYERS, VOCAB = 32, 4, 2, 2, 2048


def _tiny(attn_backend: str = "flex", tp_gemm_backend: str = "default") -> object:
    return _l3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=_l3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_l3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=_l3._output_linear_init(DIM)
        ),
        layers=_l3._build_llama3_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4096, theta=500000,
                                    scaling="llama"),
            attn_backend=attn_backend, tp_gemm_backend=tp_gemm_backend,
        ),
    )  # fmt: skip


_l3.llama3_configs["ucp_tiny"] = _tiny


def llama3_ucp_tiny() -> object:
    cfg = _registry.llama3_debugmodel()
    cfg.model_spec = _l3.model_registry("ucp_tiny")
    return cfg


_registry.llama3_ucp_tiny = llama3_ucp_tiny

# ------------------------------------------------------------------ records, fixed batches
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

RECORD = os.environ.get("UCP_TT_RECORD")
FIXED = os.environ.get("UCP_TT_FIXED")
_orig_log = MetricsProcessor.log


def _log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
    if RECORD and (not _dist.is_initialized() or _dist.get_rank() == 0):
        lr = {k: float(v) for k, v in (extra_metrics or {}).items() if "lr" in k}
        with open(RECORD, "a") as f:
            f.write(json.dumps({"step": int(step), "loss": float(global_avg_loss),
                                "grad_norm": float(grad_norm), "lr": lr}) + "\n")  # fmt: skip
    return _orig_log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


MetricsProcessor.log = _log

FIXED_BATCH, FIXED_SEQ = 2, 32
TOKENS = os.environ.get("UCP_TT_TOKENS")  # one batch [b, s + 1] (.npy) for every step
if TOKENS:
    FIXED_BATCH, FIXED_SEQ = np.load(TOKENS).shape[0], np.load(TOKENS).shape[1] - 1


def fixed_tokens(step: int) -> torch.Tensor:
    """The tokens [FIXED_BATCH, FIXED_SEQ + 1] of a step in the fixed-batch mode."""
    if TOKENS:
        return torch.from_numpy(np.load(TOKENS)).long()
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, VOCAB, (FIXED_BATCH, FIXED_SEQ + 1), generator=g)


def _fixed_batches(self, data_iterable):
    while True:  # train() has counted the step before it asks for the batch
        t = fixed_tokens(self.step)
        np.save(os.path.join(FIXED, f"tokens_step{self.step}.npy"), t.numpy())
        pos = torch.arange(FIXED_SEQ).repeat(FIXED_BATCH, 1)
        self.metrics_processor.ntokens_since_last_log += FIXED_BATCH * FIXED_SEQ
        self.metrics_processor.data_loading_times.append(0.0)
        yield {"input": t[:, :-1], "positions": pos}, t[:, 1:]


_orig_train_step = Trainer.train_step


def _train_step(self, data_iterator):
    if not getattr(self, "_ucp_hooked", False):
        self._ucp_hooked = True
        model = self.model_parts[0]

        def keep(_m, _args, out):  # the final-normed hidden states (the loss applies lm_head)
            w = model.lm_head.weight
            w = w.full_tensor() if hasattr(w, "full_tensor") else w
            logits = out.detach().float() @ w.detach().float().T
            np.save(os.path.join(FIXED, "logits.npy"), logits.numpy())
            handle.remove()

        handle = model.register_forward_hook(keep)
    return _orig_train_step(self, data_iterator)


if FIXED:
    os.makedirs(FIXED, exist_ok=True)
    Trainer.batch_generator = _fixed_batches
    Trainer.train_step = _train_step

from torchtitan.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
