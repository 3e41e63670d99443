"""Megatron-Core `torch_dist` names shared by its reader and writer: the tensors of a GPT model."""

from __future__ import annotations

from ...errors import UcpError

MAX_METADATA_BYTES = (
    1 << 20
)  # metadata.json: {"sharded_backend": ..., "sharded_backend_version": ...}


class MegatronFormatError(UcpError, ValueError):
    """The folder is not a Megatron-Core torch_dist checkpoint this importer understands."""


LAYERS = "decoder.layers."

TENSORS: dict[str, tuple[str, str]] = {
    "embedding.word_embeddings.weight": ("embed.embedding", "vocab"),
    "output_layer.weight": ("unembed.kernel", "vocab_t"),
    "decoder.final_layernorm.weight": ("ln_f.scale", "same"),
    LAYERS + "self_attention.linear_qkv.layer_norm_weight": ("ln1.scale", "same"),
    LAYERS + "input_layernorm.weight": ("ln1.scale", "same"),
    LAYERS + "self_attention.linear_qkv.weight": ("attn.qkv.kernel", "qkv"),
    LAYERS + "self_attention.linear_proj.weight": ("attn.out.kernel", "t"),
    LAYERS + "mlp.linear_fc1.layer_norm_weight": ("ln2.scale", "same"),
    LAYERS + "pre_mlp_layernorm.weight": ("ln2.scale", "same"),
    LAYERS + "mlp.linear_fc1.weight": ("mlp.gate_up.kernel", "glu"),
    LAYERS + "mlp.linear_fc2.weight": ("mlp.down.kernel", "t"),
}
