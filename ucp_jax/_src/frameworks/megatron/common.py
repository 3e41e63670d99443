"""Megatron-Core `torch_dist` names shared by its reader and writer: the tensors of a GPTModel.

Every tensor is stored in its global shape. Layer tensors are stacked ``[L, ...]`` over the
decoder's layers (``decoder.layers.``); SequentialMLP experts ``[L, E, ...]`` over the layers and
the global experts (``decoder.layers.mlp.experts.experts.``). The local layer spec stores its norms
under the names of Transformer Engine's fused ones (``input_layernorm.weight`` is saved as
``self_attention.linear_qkv.layer_norm_weight``); both spellings are read.
"""

from __future__ import annotations

import re
from typing import Any

from ...errors import UcpError
from ...llama_config import LlamaConfig

MAX_METADATA_BYTES = (
    1 << 20
)  # metadata.json: {"sharded_backend": ..., "sharded_backend_version": ...}


BACKEND_FILE = "metadata.json"  # a dist_checkpointing folder's mark: {"sharded_backend": ...}


class MegatronFormatError(UcpError, ValueError):
    """The folder is not a Megatron-Core torch_dist checkpoint this importer understands."""


LAYERS = "decoder.layers."
EXPERTS = LAYERS + "mlp.experts.experts."  # SequentialMLP, global expert axis after the layers
FC1 = "mlp.{fc1}"  # the dense MLP's first linear: gate_up (gated) or up

TENSORS: dict[str, tuple[str, str]] = {
    "embedding.word_embeddings.weight": ("embed.embedding", "vocab"),
    "embedding.position_embeddings.weight": ("pos_embed.embedding", "same"),
    "output_layer.weight": ("unembed.kernel", "vocab_t"),
    "decoder.final_layernorm.weight": ("ln_f.scale", "same"),
    "decoder.final_layernorm.bias": ("ln_f.bias", "same"),
    LAYERS + "self_attention.linear_qkv.layer_norm_weight": ("ln1.scale", "same"),
    LAYERS + "self_attention.linear_qkv.layer_norm_bias": ("ln1.bias", "same"),
    LAYERS + "input_layernorm.weight": ("ln1.scale", "same"),
    LAYERS + "input_layernorm.bias": ("ln1.bias", "same"),
    LAYERS + "self_attention.linear_qkv.weight": ("attn.qkv.kernel", "qkv"),
    LAYERS + "self_attention.linear_qkv.bias": ("attn.qkv.bias", "qkv"),
    LAYERS + "self_attention.linear_proj.weight": ("attn.out.kernel", "t"),
    LAYERS + "self_attention.linear_proj.bias": ("attn.out.bias", "same"),
    LAYERS + "mlp.linear_fc1.layer_norm_weight": ("ln2.scale", "same"),
    LAYERS + "mlp.linear_fc1.layer_norm_bias": ("ln2.bias", "same"),
    LAYERS + "pre_mlp_layernorm.weight": ("ln2.scale", "same"),
    LAYERS + "pre_mlp_layernorm.bias": ("ln2.bias", "same"),
    LAYERS + "mlp.linear_fc1.weight": (FC1 + ".kernel", "t"),
    LAYERS + "mlp.linear_fc1.bias": (FC1 + ".bias", "same"),
    LAYERS + "mlp.linear_fc2.weight": ("mlp.down.kernel", "t"),
    LAYERS + "mlp.linear_fc2.bias": ("mlp.down.bias", "same"),
    LAYERS + "mlp.router.weight": ("router.kernel", "t"),
    EXPERTS + "linear_fc1.weight": ("experts.{e}.gate_up.kernel", "t"),
    EXPERTS + "linear_fc2.weight": ("experts.{e}.down.kernel", "t"),
}
"""Megatron tensor -> (atom, after ``blocks.{i}.`` for layer tensors; how it maps):
``same``; ``t`` (torch's ``[out, in]`` -> ``[in, out]``); ``qkv`` (per-group rows -> ``[q | k | v]``);
``vocab`` / ``vocab_t`` (the padding rows dropped). SwiGLU's ``linear_fc1`` rows are
``[all gate; all up]``, so its transpose is the ``[gate | up]`` fused atom."""

# the names export_megatron writes (the local spec's, as dist_checkpointing saves them)
WRITTEN = [k for k in TENSORS if ".input_layernorm." not in k and ".pre_mlp_layernorm." not in k]

# optimizer tensors: [chained_<n>.]optimizer.state.<field>.<model tensor>
OPT_RE = re.compile(
    r"^(?P<chain>chained_\d+\.)?optimizer\.state\.(?P<field>fp32_param|param|exp_avg|exp_avg_sq)\."
    r"(?P<key>.+)$"
)
MASTER_FIELDS = ("fp32_param", "param")  # the fp32 master of the plain / distributed optimizer
MOMENTS = ("exp_avg", "exp_avg_sq")


def param_groups(common: Any, objects: dict[str, Any]) -> list[Any]:
    """Every optimizer parameter group the checkpoint records (without their ``params``): in the
    common state (plain or distributed optimizer, each optimizer of a ChainedOptimizer), or in the
    dp_reshardable layout's per-group ``optimizer.distributed.dp_group_idx_<g>.optimizer``."""
    opt = common.get("optimizer") if isinstance(common, dict) else None
    subs = list(opt.values()) if isinstance(opt, dict) and 0 in opt else [opt]
    subs += [v for k, v in sorted(objects.items()) if re.fullmatch(
        r"optimizer\.distributed\.dp_group_idx_0\.optimizer", k)]  # fmt: skip
    out: list[Any] = []
    for sub in subs:
        if isinstance(sub, dict) and isinstance(sub.get("optimizer"), dict):  # mixed precision
            sub = sub["optimizer"]  # or distributed
        groups = sub.get("param_groups") if isinstance(sub, dict) else None
        if isinstance(groups, list):
            out += [{k: v for k, v in g.items() if k != "params"} for g in groups
                    if isinstance(g, dict)]  # fmt: skip
    return out


def atom_of(key: str, cfg: LlamaConfig) -> str:
    """The atom template of Megatron tensor `key` (``{e}`` left for experts)."""
    return TENSORS[key][0].replace("{fc1}", "gate_up" if cfg.gated_mlp else "up")


def model_keys(cfg: LlamaConfig) -> list[str]:
    """The model tensors a Megatron GPTModel of this config holds (export order, local spec)."""
    ln, lb, out = cfg.norm == "layer", cfg.linear_bias, []
    for k in WRITTEN:
        dense_mlp = k.startswith(LAYERS + "mlp.linear_fc") and "layer_norm" not in k
        sparse = k.startswith((EXPERTS, LAYERS + "mlp.router"))
        if (
            (k.endswith(("layer_norm_bias", "final_layernorm.bias")) and not ln)
            or (k.endswith(("linear_proj.bias", "linear_fc1.bias", "linear_fc2.bias")) and not lb)
            or (k.endswith("linear_qkv.bias") and not cfg.qkv_bias)
            or (k == "embedding.position_embeddings.weight" and cfg.positions != "learned")
            or (k == "output_layer.weight" and cfg.tie_embeddings)
            or (dense_mlp and cfg.n_experts)
            or (sparse and not cfg.n_experts)
        ):
            continue
        out.append(k)
    return out
