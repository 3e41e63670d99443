"""The model config of a Megatron-Core GPTModel checkpoint, from what the checkpoint records.

The tensors give the widths, the layers, the norm (a LayerNorm has a bias), the MLP (gated when
``linear_fc1`` has twice the rows ``linear_fc2`` takes), the biases, learned positions (their
embedding), tied embeddings (no ``output_layer``) and the experts. What no shape says, the head
count above all (``linear_qkv`` has ``(heads + 2 * groups) * head_dim`` rows), comes from
Megatron-LM's ``args`` (an ``argparse.Namespace`` in the common state) when the checkpoint has
them; otherwise from the caller (``heads=``, ``top_k=``), and the error says which is missing.
``args`` also refuse what the JAX model does not compute (partial rotary, interleaved RoPE,
squared ReLU, a pre-softmax or sigmoid router...), naming the argument.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ...llama_config import LlamaConfig
from .common import EXPERTS, LAYERS, TENSORS, MegatronFormatError

_QKV = LAYERS + "self_attention.linear_qkv.weight"
_PROJ = LAYERS + "self_attention.linear_proj.weight"
_EMB = "embedding.word_embeddings.weight"
_POS = "embedding.position_embeddings.weight"
_LN_BIASES = ("decoder.final_layernorm.bias", LAYERS + "input_layernorm.bias",
              LAYERS + "self_attention.linear_qkv.layer_norm_bias")  # fmt: skip
# Megatron-LM arguments whose non-default value changes what the model computes
_REFUSED = {
    "rotary_interleaved": True, "squared_relu": True, "apply_residual_connection_post_layernorm":
    True, "layernorm_zero_centered_gamma": True, "use_rope_scaling": True, "qk_layernorm": True,
    "moe_router_pre_softmax": True, "moe_router_enable_expert_bias": True,
}  # fmt: skip
log = logging.getLogger("ucp_jax")


def megatron_args(objects: dict[str, Any]) -> Any:
    """Megatron-LM's ``args`` in the common state (an ``argparse.Namespace``), or None."""
    common = objects.get("common_state")
    args = common.get("args") if isinstance(common, dict) else None
    return args if hasattr(args, "__dict__") else None


def _arg(args: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    v = getattr(args, name, None) if args is not None else None
    return v if isinstance(v, kind) and not (kind is int and isinstance(v, bool)) else None


def _check_args(args: Any, where: str) -> None:
    if args is None:
        return
    for name, bad in _REFUSED.items():
        if getattr(args, name, None) == bad:
            raise MegatronFormatError(
                f"{where}: Megatron-LM's args set {name}={bad!r}, which the JAX model does not "
                "compute; this importer reads GPT models without it"
            )
    checks = {"rotary_percent": 1.0, "moe_router_score_function": "softmax",
              "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
              # attention and MLP variants of Megatron-LM the JAX model does not compute
              "window_size": None, "softmax_type": "vanilla", "attention_output_gate": False,
              "qk_l2_norm": False, "experimental_attention_variant": None,
              "linear_attention_freq": None, "quick_geglu": False, "glu_linear_offset": 0.0,
              "activation_func_clamp_value": None, "no_rope_freq": None,
              "rotary_seq_len_interpolation_factor": None, "moe_shared_expert_gate": False,
              }  # fmt: skip
    for name, ok in checks.items():
        v = getattr(args, name, ok)
        if v is not None and v != ok and not (name == "moe_router_topk_scaling_factor" and v == 1):
            raise MegatronFormatError(
                f"{where}: Megatron-LM's args set {name}={v!r}; only {ok!r} is read"
            )
    pos = getattr(args, "position_embedding_type", "rope")
    if pos not in ("rope", "learned_absolute", None):
        raise MegatronFormatError(
            f"{where}: position_embedding_type={pos!r}; only 'rope' and 'learned_absolute' are read"
        )


def _heads(heads: int | None, args: Any, where: str) -> int:
    n = heads or _arg(args, "num_attention_heads", int)
    if not n:
        raise MegatronFormatError(
            f"{where}: the number of attention heads is not recorded in the checkpoint (its common "
            "state has no Megatron-LM args, and no tensor's shape says it); pass heads= (--heads)"
        )
    if n <= 0:
        raise MegatronFormatError(f"{where}: heads={n}; expected a positive head count")
    return int(n)


def _positive(v: Any, what: str, where: str) -> float:
    if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
        raise MegatronFormatError(f"{where}: {what}={v!r:.40}; expected a positive finite number")
    return float(v)


def infer_config(
    shapes: dict[str, tuple[int, ...]],
    args: Any,
    where: str,
    *,
    heads: int | None = None,
    vocab_size: int | None = None,
    norm_eps: float | None = None,
    rope_theta: float | None = None,
    top_k: int | None = None,
    activation: str | None = None,
) -> LlamaConfig:
    """The config of a Megatron GPTModel from its tensor shapes, ``args`` and the caller's values.

    Raises:
        MegatronFormatError: a tensor it needs is missing, the shapes disagree with the head count,
            or ``args`` ask for something the model does not compute.
    """
    _check_args(args, where)
    sparse = EXPERTS + "linear_fc1.weight" in shapes
    dense = LAYERS + "mlp.linear_fc1.weight" in shapes
    missing = [k for k in (_EMB, _QKV, _PROJ) if k not in shapes]
    if missing or not (sparse or dense):
        raise MegatronFormatError(
            f"{where}: no tensor {(missing or [LAYERS + 'mlp.linear_fc1.weight'])[0]!r}; expected "
            "a Megatron GPTModel (local or Transformer Engine layer spec; a dense MLP or "
            "SequentialMLP experts)"
        )
    if sparse and dense:
        raise MegatronFormatError(
            f"{where}: both dense MLP and expert tensors; models that mix dense and MoE layers "
            "(moe_layer_freq) are not read"
        )
    n = _heads(heads, args, where)
    vp, d = shapes[_EMB]
    layers, rows, _ = shapes[_QKV]
    proj_in = shapes[_PROJ][2]
    if proj_in % n:
        raise MegatronFormatError(f"{where}: heads={n} does not divide {proj_in}")
    hd = proj_in // n
    groups, rem = divmod(rows - proj_in, 2 * hd)
    if rem or groups <= 0 or n % groups:
        raise MegatronFormatError(
            f"{where}: linear_qkv has {rows} rows, which no number of query groups gives with "
            f"heads={n} of width {hd}; pass the model's number of attention heads"
        )
    want_groups = _arg(args, "num_query_groups", int) if getattr(
        args, "group_query_attention", False) else None  # fmt: skip
    kv = _arg(args, "kv_channels", int)
    if (want_groups and want_groups != groups) or (kv and kv != hd):
        raise MegatronFormatError(
            f"{where}: the tensors give {groups} query groups of width {hd}, but Megatron-LM's "
            f"args record num_query_groups={want_groups}, kv_channels={kv}"
        )
    if sparse:
        _, experts, fc1, _ = shapes[EXPERTS + "linear_fc1.weight"]
        ff = shapes[EXPERTS + "linear_fc2.weight"][3]
    else:
        experts, fc1 = 0, shapes[LAYERS + "mlp.linear_fc1.weight"][1]
        ff = shapes[LAYERS + "mlp.linear_fc2.weight"][2]
    if fc1 not in (ff, 2 * ff):
        raise MegatronFormatError(f"{where}: linear_fc1 has {fc1} rows for {ff} of linear_fc2")
    gated = fc1 == 2 * ff
    guessed = []  # values no tensor, no args and no caller gave: the defaults, named in the log
    if activation is None:
        activation = "silu" if gated else "gelu"
        if not gated and getattr(args, "openai_gelu", False):
            activation = "gelu_pytorch_tanh"
        if args is None:
            guessed.append(f"activation={activation} (--activation)")
    k = top_k or _arg(args, "moe_router_topk", int) or 0
    if sparse and not k:
        raise MegatronFormatError(
            f"{where}: the router's top-k is not recorded in the checkpoint (no Megatron-LM args); "
            "pass top_k= (--top-k)"
        )
    if sparse and not 1 <= k <= experts:
        raise MegatronFormatError(f"{where}: top_k={k} is not in 1..{experts} (the experts)")
    layer_norm = any(k in shapes for k in _LN_BIASES)
    has = {name: name in shapes for name in TENSORS}
    v = vp if vocab_size is None else int(vocab_size)
    if not 0 < v <= vp:
        raise MegatronFormatError(f"{where}: vocab_size={v} exceeds the stored (padded) {vp}")
    eps = norm_eps or _arg(args, "norm_epsilon", float) or _arg(args, "layernorm_epsilon", float)
    if not eps:
        guessed.append("norm_eps=1e-05 (--norm-eps)")
    eps = _positive(eps or 1e-5, "the norm epsilon", where)
    theta = rope_theta or _arg(args, "rotary_base", (int, float))
    if not theta and not has[_POS]:
        guessed.append("rope_theta=10000 (--rope-theta)")
    theta = _positive(theta or 10000.0, "the RoPE base (rotary_base)", where)
    if guessed:
        log.warning(
            "%s: not recorded in the checkpoint (%s), so Megatron's defaults are taken: %s; pass "
            "the model's own values if it was trained with others (the logits depend on them)",
            where, "no Megatron-LM args" if args is None else "not in its args", ", ".join(guessed),
        )  # fmt: skip
    cfg: dict[str, Any] = dict(
        vocab_size=v, d_model=d, n_heads=n, n_kv_heads=groups, head_dim=hd, n_layers=layers,
        d_ff=ff, norm_eps=eps, rope_theta=theta,
        qkv_bias=has[LAYERS + "self_attention.linear_qkv.bias"],
        tie_embeddings=not has["output_layer.weight"], vocab_multiple=1, n_experts=experts,
        top_k=k or 2, norm="layer" if layer_norm else "rms", activation=activation,
        gated_mlp=gated, linear_bias=has[LAYERS + "self_attention.linear_proj.bias"],
        positions="learned" if has[_POS] else "rope", max_positions=shapes[_POS][0] if has[
            _POS] else 0,
    )  # fmt: skip
    aux = _arg(args, "moe_aux_loss_coeff", float)
    if aux is not None:
        cfg["router_aux_loss_coef"] = aux
    llama_like = (cfg["norm"], activation, gated, cfg["linear_bias"], cfg["positions"]) == (
        "rms", "silu", True, False, "rope")  # fmt: skip
    if llama_like and experts:
        kind = "gpt" if cfg["qkv_bias"] else "mixtral"
    elif llama_like:
        kind = "qwen2" if cfg["qkv_bias"] else "llama"
    else:
        kind = "gpt"
    return LlamaConfig(model_type=kind, **cfg)


__all__ = ["infer_config", "megatron_args"]
