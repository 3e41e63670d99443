"""The configuration of a Llama-family model (Llama, Mistral, Qwen2, Mixtral).

The family also holds GPT-style decoders (``model_type`` ``"gpt"``, Megatron-Core's GPTModel:
LayerNorm, a GELU MLP, biases on every linear, learned absolute positions or RoPE, tied or untied
embeddings), which no transformers class computes: their config records those choices in
Megatron's words (``normalization``, ``position_embedding_type``, ``add_bias_linear``, ...).
A Hugging Face ``config.json`` is read into one by ``hf_config.config_from_hf``, and
:meth:`LlamaConfig.to_hf` writes one back.

>>> cfg = LlamaConfig(vocab_size=100, d_model=64, d_ff=128, n_layers=2, n_heads=4, n_kv_heads=2)
>>> cfg.qkv_sizes, cfg.to_hf()["num_key_value_heads"]
((64, 32, 32), 2)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import UcpError

FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "gpt")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "linear", "llama3")
MAX_CONFIG_BYTES = 1 << 20


class HFConfigError(UcpError, ValueError):
    """A Hugging Face ``config.json`` is malformed, or describes a model this family cannot hold."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder (pre-norm, RoPE, GQA, SiLU-gated MLP).

    Attributes:
        model_type: "llama", "mistral", "qwen2" or "mixtral" (sets the default biases and HF class).
        vocab_size: vocabulary size (unpadded).
        d_model: hidden size.
        n_heads: query heads.
        n_kv_heads: key/value heads (GQA when fewer than ``n_heads``).
        head_dim: width of one head, independent of ``d_model / n_heads``.
        n_layers: decoder layers.
        d_ff: MLP intermediate size.
        norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        rope_scaling: ``(("rope_type", ...), ...)`` for "linear" / "llama3", or ``()``.
        qkv_bias: q/k/v projections have a bias (Qwen2).
        tie_embeddings: the output projection is the input embedding transposed.
        sliding_window: attend to at most this many past positions (self included), or None.
        vocab_multiple: the padded vocabulary is a multiple of ``vocab_multiple * tensor``.
        n_experts: experts per sparse MLP (Mixtral); 0 for the dense SwiGLU MLP.
        top_k: experts each token is routed to (sparse models).
        router_aux_loss_coef: weight of the load-balancing loss in the training loss.
        norm: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm, with a bias).
        activation: the MLP's activation: ``"silu"``, ``"gelu"`` (erf) or ``"gelu_pytorch_tanh"``.
        gated_mlp: a gated ``[gate | up]`` MLP (SwiGLU); else ``down(act(up(x)))``.
        linear_bias: the attention output and MLP linears have biases (Megatron's add_bias_linear).
        positions: ``"rope"`` or ``"learned"`` (an absolute position embedding added to the input).
        max_positions: rows of the learned position embedding (``"learned"`` only).
        hf: the source ``config.json`` (as a JSON string), written back on export.
    """

    model_type: str = "llama"
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 16
    n_layers: int = 2
    d_ff: int = 128
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    qkv_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    vocab_multiple: int = 64
    n_experts: int = 0
    top_k: int = 2
    router_aux_loss_coef: float = 0.02
    norm: str = "rms"
    activation: str = "silu"
    gated_mlp: bool = True
    linear_bias: bool = False
    positions: str = "rope"
    max_positions: int = 0
    hf: str = dataclasses.field(default="{}", compare=False, repr=False)

    def padded_vocab(self, tensor: int) -> int:
        """Vocabulary size rounded up to a multiple of ``vocab_multiple * tensor``."""
        m = self.vocab_multiple * tensor
        return -(-self.vocab_size // m) * m

    @property
    def qkv_sizes(self) -> tuple[int, int, int]:
        """Columns of q, k and v in the fused QKV kernel."""
        kv = self.n_kv_heads * self.head_dim
        return (self.n_heads * self.head_dim, kv, kv)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies ``[head_dim // 2]`` (float32), as transformers computes them."""
        dim = self.head_dim
        exps = (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)).astype(
            np.float32
        )
        inv = (1.0 / (np.float32(self.rope_theta) ** exps)).astype(np.float32)
        s = dict(self.rope_scaling)
        kind = s.get("rope_type", "default")
        if kind == "linear":
            inv = (inv / np.float32(s["factor"])).astype(np.float32)
        elif kind == "llama3":
            inv = _llama3(inv, s)
        return inv

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` for transformers: the source's, with the shape fields set from here."""
        out = dict(json.loads(self.hf))
        out.update(
            model_type=self.model_type, vocab_size=self.vocab_size, hidden_size=self.d_model,
            intermediate_size=self.d_ff, num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads, num_key_value_heads=self.n_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.norm_eps, hidden_act=self.activation,
            tie_word_embeddings=self.tie_embeddings,
        )  # fmt: skip
        if self.model_type == "gpt":
            out.update(
                normalization="LayerNorm" if self.norm == "layer" else "RMSNorm",
                gated_mlp=self.gated_mlp, add_bias_linear=self.linear_bias,
                add_qkv_bias=self.qkv_bias,
                position_embedding_type="learned_absolute" if self.positions == "learned"
                else "rope", max_position_embeddings=self.max_positions or None,
            )  # fmt: skip
        else:
            out.setdefault("architectures", [_ARCH[self.model_type]])
        rope = {"rope_type": "default", **dict(self.rope_scaling), "rope_theta": self.rope_theta}
        out["rope_parameters"] = rope
        out.pop("rope_scaling", None)
        out["rope_theta"] = self.rope_theta
        out.update(self._window_fields())
        if self.n_experts:
            out.update(num_local_experts=self.n_experts, num_experts_per_tok=self.top_k,
                       router_aux_loss_coef=self.router_aux_loss_coef)  # fmt: skip
        return out

    def _window_fields(self) -> dict[str, Any]:
        """The config.json fields that give transformers this sliding window (all layers, or none)."""
        w = self.sliding_window
        if self.model_type in ("mistral", "mixtral", "gpt"):
            return {"sliding_window": w}
        if self.model_type == "qwen2":
            kind = "full_attention" if w is None else "sliding_attention"
            return {"use_sliding_window": w is not None, "sliding_window": w,
                    "max_window_layers": self.n_layers if w is None else 0,
                    "layer_types": [kind] * self.n_layers}  # fmt: skip
        if w is not None:
            raise HFConfigError(
                f"LlamaConfig(model_type={self.model_type!r}, sliding_window={w}): transformers' "
                f"{self.model_type} has no sliding window, so its config.json cannot say this "
                "model; use model_type='mistral' (the same weights) or sliding_window=None"
            )
        return {}


_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def _llama3(inv: np.ndarray, s: Mapping[str, Any]) -> np.ndarray:
    """transformers' ``_compute_llama3_parameters`` on float32 frequencies."""
    factor, lo, hi = (np.float32(s[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = np.float32(s["original_max_position_embeddings"])
    low_wl, high_wl = old / lo, old / hi
    wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
    inv_l = np.where(wavelen > low_wl, inv / factor, inv).astype(np.float32)
    smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
    smoothed = ((1 - smooth) * inv_l / factor + smooth * inv_l).astype(np.float32)
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, inv_l).astype(np.float32)


def ucp_extra(config: LlamaConfig, source: Any = None) -> dict[str, Any]:
    """What to pass as ``extra=`` to ``ucp.save`` so that ``export_hf`` finds the config.

    Args:
        config: the model configuration.
        source: the checkpoint the model came from (``import_hf``'s): what it kept of the
            Hugging Face folder beyond ``config.json`` (``generation_config.json``: end tokens,
            sampling defaults) is carried over, so the export writes it back.

    Returns:
        ``{"hf_config": <config.json dict>}``, with ``"hf_generation_config"`` from `source`.

    >>> ucp_extra(LlamaConfig())["hf_config"]["model_type"]
    'llama'
    """
    out: dict[str, Any] = {"hf_config": config.to_hf()}
    if source is not None:
        from .checkpoint import Checkpoint

        ck = source if isinstance(source, Checkpoint) else Checkpoint(source)
        kept = ck.manifest.extra if isinstance(ck.manifest.extra, dict) else {}
        if isinstance(kept.get("hf_generation_config"), dict):
            out["hf_generation_config"] = kept["hf_generation_config"]
    return out
