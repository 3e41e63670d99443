"""The Hugging Face names of a Llama-family model's tensors and how they make its atoms.

Shared by the Hugging Face importer and exporter and by the importers of checkpoints of
Hugging Face models trained elsewhere (DeepSpeed ZeRO, with ``config.json`` beside it): which
safetensors tensors (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``, Mixtral's
``block_sparse_moe.experts.<e>.w1/w2/w3``) each canonical atom of ``ucp_jax.models.llama`` is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ...llama_config import HFConfigError, LlamaConfig

_LAYER = "model.layers.{i}."


@dataclasses.dataclass(frozen=True)
class AtomFrom:
    """A target atom built from source tensors: `concat(maybe_T(src_k) for k, axis)`.

    Attributes:
        sources: source tensor names; `{i}` is the layer index.
        transpose: transpose each (2-d) source first (torch Linear `[out, in]` -> `[in, out]`).
        axis: the concatenation axis (after transposing).
        fallback: sources to use when `sources` are absent (e.g. a tied `lm_head`).
    """

    sources: tuple[str, ...]
    transpose: bool = False
    axis: int = 0
    fallback: tuple[str, ...] = ()


def hf_mapping(config: LlamaConfig) -> dict[str, AtomFrom]:
    """Canonical atom (template, ``{i}`` = layer) -> the HF tensors it is built from.

    Args:
        config: the model configuration (q/k/v bias and tied embeddings change the mapping).

    Returns:
        An ordered mapping, usable as ``import_safetensors(preset=...)`` and ``export_hf(mapping=...)``.

    >>> hf_mapping(LlamaConfig())["blocks.{i}.attn.out.kernel"].sources
    ('model.layers.{i}.self_attn.o_proj.weight',)
    """
    if config.model_type == "gpt":
        raise HFConfigError(
            "model_type 'gpt' (a Megatron GPTModel: LayerNorm, GELU, biases, learned positions) "
            "has no transformers class here; write it with export_megatron"
        )
    lay = _LAYER
    qkv = tuple(lay + f"self_attn.{p}_proj.weight" for p in "qkv")
    out = {
        "embed.embedding": AtomFrom(("model.embed_tokens.weight",)),
        "blocks.{i}.ln1.scale": AtomFrom((lay + "input_layernorm.weight",)),
        "blocks.{i}.attn.qkv.kernel": AtomFrom(qkv, transpose=True, axis=1),
    }
    if config.qkv_bias:
        biases = tuple(lay + f"self_attn.{p}_proj.bias" for p in "qkv")
        out["blocks.{i}.attn.qkv.bias"] = AtomFrom(biases, axis=0)
    out |= {
        "blocks.{i}.attn.out.kernel": AtomFrom((lay + "self_attn.o_proj.weight",), transpose=True),
        "blocks.{i}.ln2.scale": AtomFrom((lay + "post_attention_layernorm.weight",)),
    }
    if config.n_experts:  # Mixtral: a router and per-expert w1 (gate), w3 (up), w2 (down)
        moe = lay + "block_sparse_moe."
        out["blocks.{i}.router.kernel"] = AtomFrom((moe + "gate.weight",), transpose=True)
        for e in range(config.n_experts):
            w = moe + f"experts.{e}.w"
            out[f"blocks.{{i}}.experts.{e}.gate_up.kernel"] = AtomFrom(
                (w + "1.weight", w + "3.weight"), transpose=True, axis=1
            )
            out[f"blocks.{{i}}.experts.{e}.down.kernel"] = AtomFrom((w + "2.weight",), True)
    else:
        out["blocks.{i}.mlp.gate_up.kernel"] = AtomFrom(
            (lay + "mlp.gate_proj.weight", lay + "mlp.up_proj.weight"), transpose=True, axis=1
        )
        out["blocks.{i}.mlp.down.kernel"] = AtomFrom((lay + "mlp.down_proj.weight",), True)
    out["ln_f.scale"] = AtomFrom(("model.norm.weight",))
    if not config.tie_embeddings:
        out["unembed.kernel"] = AtomFrom(("lm_head.weight",), transpose=True)
    return out


def hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the model -> its shape (torch layout), in ``state_dict`` order.

    Args:
        config: the model configuration.

    Returns:
        The names and shapes ``LlamaForCausalLM`` (or Mistral / Qwen2) holds.

    >>> hf_shapes(LlamaConfig(n_layers=1))["model.layers.0.self_attn.k_proj.weight"]
    (64, 64)
    """
    c = config
    d, q, kv = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.n_layers):
        pre = f"model.layers.{i}."
        for p, rows in (("q", q), ("k", kv), ("v", kv)):
            out[pre + f"self_attn.{p}_proj.weight"] = (rows, d)
            if c.qkv_bias:
                out[pre + f"self_attn.{p}_proj.bias"] = (rows,)
        out[pre + "self_attn.o_proj.weight"] = (d, q)
        if c.n_experts:
            out[pre + "block_sparse_moe.gate.weight"] = (c.n_experts, d)
            for e in range(c.n_experts):
                w = pre + f"block_sparse_moe.experts.{e}.w"
                out |= {w + "1.weight": (c.d_ff, d), w + "2.weight": (d, c.d_ff)}
                out[w + "3.weight"] = (c.d_ff, d)
        else:
            out[pre + "mlp.gate_proj.weight"] = (c.d_ff, d)
            out[pre + "mlp.up_proj.weight"] = (c.d_ff, d)
            out[pre + "mlp.down_proj.weight"] = (d, c.d_ff)
        out[pre + "input_layernorm.weight"] = (d,)
        out[pre + "post_attention_layernorm.weight"] = (d,)
    out["model.norm.weight"] = (d,)
    if not c.tie_embeddings:
        out["lm_head.weight"] = (c.vocab_size, d)
    return out


def expand(mapping: Mapping[str, AtomFrom], n_layers: int) -> dict[str, tuple[AtomFrom, list[str]]]:
    """Concrete atom name -> (spec, concrete source names), ``{i}`` expanded for every layer.

    Args:
        mapping: atom template -> AtomFrom.
        n_layers: the number of layers.

    Returns:
        The expanded mapping, in the template order, layer by layer.
    """
    out: dict[str, tuple[AtomFrom, list[str]]] = {}
    for tmpl, spec in mapping.items():
        for i in range(n_layers) if "{i}" in tmpl else [None]:
            fill = str if i is None else (lambda s, i=i: s.replace("{i}", str(i)))
            out[fill(tmpl)] = (spec, [fill(s) for s in spec.sources])
    return out


__all__ = ["AtomFrom", "expand", "hf_mapping", "hf_shapes"]
