"""A Llama-family decoder (Llama, Mistral, Qwen2) in Flax nnx, computing what transformers computes.

RoPE as transformers computes it (``rope_theta``; "linear" and "llama3" scaling), ``head_dim``
independent of ``d_model / n_heads``, GQA, optional q/k/v bias (Qwen2), tied or untied embeddings,
RMSNorm, SiLU-gated MLP, Mistral's sliding window. GPT-style decoders (Megatron-Core's GPTModel,
``model_type`` "gpt") take the same path with LayerNorm, a GELU MLP (gated or not), biases on every
linear and learned absolute positions instead of RoPE, as their config says. The parameter layout depends on the parallel
layout exactly as in :mod:`ucp_jax.demo` (whose :class:`~ucp_jax.demo.Layout` and mesh it uses):

* fused QKV (and its bias) / SwiGLU ``[gate | up]`` kernels hold one ``[q_r | k_r | v_r]`` group per
  tensor-parallel shard ``r``;
* the embedding / unembedding are zero-padded to a multiple of ``64 * tensor`` rows / columns;
* per-layer parameters are stacked as ``[n_layers, ...]`` or ``[stages, n_layers // stages, ...]``.

Canonical atoms are named like the demo's (``blocks.{i}.attn.qkv.kernel`` ...), so
:func:`ucp_rules` restores a checkpoint imported with :func:`ucp_jax.torch.import_hf` onto any layout.

>>> cfg = LlamaConfig(n_layers=2)
>>> mesh = make_mesh(Layout(tensor=2))  # doctest: +SKIP
>>> params = ucp.restore(ckpt, abstract_params(cfg, Layout(tensor=2), mesh), rules=ucp_rules(cfg, Layout(tensor=2)))[0]  # doctest: +SKIP
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from .._src.mapping.patterns import Fused, Stacked, VocabPadded
from .llama_config import ACTIVATIONS, LlamaConfig
from .moe import (
    EXPERT_PARAMS,
    check_experts,
    expert_rules,
    load_balancing_loss,
    sparse_mlp,
    sparse_params,
)
from .moe import MoELayout as MoELayout
from .moe import make_mesh as make_mesh
from .parallel import (
    NEG_INF,
    Group,
    Kernel,
    Layout,
    Norm,
    constrain_batch,
    layer_norm,
    make_param,
    module_abstract_params,
    module_graph,
    module_shardings,
    rms_norm,
)

PyTree = Any
BLOCK_PARAMS = (
    "ln1.scale",
    "attn.qkv.kernel",
    "attn.qkv.bias",
    "attn.out.kernel",
    "ln2.scale",
    "mlp.gate_up.kernel",
    "mlp.down.kernel",
)


def block_params(config: LlamaConfig) -> tuple[str, ...]:
    """Per-layer parameter names (``attn.qkv.bias`` only with a bias; router and experts if sparse;
    LayerNorm biases, linear biases and a non-gated ``mlp.up`` for GPT-style models)."""
    c = config
    ln, lb = c.norm == "layer", c.linear_bias
    names = ["ln1.scale", *(["ln1.bias"] if ln else []), "attn.qkv.kernel"]
    names += [*(["attn.qkv.bias"] if c.qkv_bias else []), "attn.out.kernel"]
    names += [*(["attn.out.bias"] if lb else []), "ln2.scale", *(["ln2.bias"] if ln else [])]
    if c.n_experts:
        return (*names, "router.kernel", *EXPERT_PARAMS)
    fc1 = "mlp.gate_up" if c.gated_mlp else "mlp.up"
    names += [f"{fc1}.kernel", *([f"{fc1}.bias"] if lb else []), "mlp.down.kernel"]
    return (*names, *(["mlp.down.bias"] if lb else []))


def fused_sizes(config: LlamaConfig) -> dict[str, tuple[tuple[int, ...], int]]:
    """Fused per-layer parameters: name -> (sub-parameter sizes, axis of the per-layer atom).

    The experts' fused ``gate_up`` is not here: :func:`ucp_jax.models.moe.expert_rules` maps it.
    """
    out: dict[str, tuple[tuple[int, ...], int]] = {"attn.qkv.kernel": (config.qkv_sizes, 1)}
    if not config.n_experts and config.gated_mlp:
        out["mlp.gate_up.kernel"] = ((config.d_ff,) * 2, 1)
        if config.linear_bias:
            out["mlp.gate_up.bias"] = ((config.d_ff,) * 2, 0)
    if config.qkv_bias:
        out["attn.qkv.bias"] = (config.qkv_sizes, 0)
    return out


def check_layout(config: LlamaConfig, layout: Layout) -> None:
    """Raise ValueError if ``layout`` cannot hold the model.

    Args:
        config: the model configuration.
        layout: the parallel layout.

    Raises:
        ValueError: the tensor degree does not divide the heads or ``d_ff``, the stages the layers,
            or the expert degree the experts.
    """
    t, c = layout.tensor, config
    for what, n in (("n_heads", c.n_heads), ("n_kv_heads", c.n_kv_heads), ("d_ff", c.d_ff)):
        if n % t:
            raise ValueError(f"layout {layout.name}: tensor={t} does not divide {what}={n}")
    if c.n_layers % layout.stages:
        raise ValueError(f"layout {layout.name}: stages={layout.stages} does not divide n_layers")
    if c.n_heads % c.n_kv_heads:
        raise ValueError("n_kv_heads must divide n_heads")
    if c.norm not in ("rms", "layer") or c.activation not in ACTIVATIONS:
        raise ValueError(f"norm={c.norm!r} / activation={c.activation!r}: not implemented")
    if c.positions not in ("rope", "learned") or (c.positions == "learned") != (
        c.max_positions > 0
    ):
        raise ValueError(f"positions={c.positions!r} with max_positions={c.max_positions}")
    if c.n_experts and (c.linear_bias or not c.gated_mlp or c.activation != "silu"):
        raise ValueError(
            "the experts are SwiGLU without biases (Mixtral's); a sparse model with linear biases "
            "or another MLP is not implemented"
        )
    check_experts(config, layout)


class _Dense(nnx.Module):
    def __init__(self, shape: tuple[int, ...], spec: tuple[str | None, ...], bias: bool) -> None:
        self.kernel = make_param(shape, spec)
        if bias:
            self.bias = make_param(shape[:-2] + shape[-1:], spec[:-2] + spec[-1:])


class Llama(nnx.Module):
    """The Llama-family decoder with layout-dependent parameter shapes (zeros until restored).

    Args:
        config: the model configuration.
        layout: the parallel layout whose parameter layout the module holds.
    """

    def __init__(self, config: LlamaConfig, layout: Layout) -> None:
        check_layout(config, layout)
        c, t = config, layout.tensor
        self.config, self.layout = config, layout
        d, vp, ln, lb = c.d_model, c.padded_vocab(t), c.norm == "layer", c.linear_bias
        fs = "fsdp" if layout.fsdp > 1 and d % layout.fsdp == 0 else None
        tp = "tensor" if t > 1 else None
        lead: tuple[int, ...] = (c.n_layers,)
        ls: tuple[str | None, ...] = (None,)
        if layout.stages > 1:
            lead, ls = (layout.stages, c.n_layers // layout.stages), ("stage", None)
        self.embed: Any = Group(embedding=make_param((vp, d), (tp, fs)))
        if c.positions == "learned":
            self.pos_embed: Any = Group(embedding=make_param((c.max_positions, d), (None, fs)))
        fc1 = {"gate_up" if c.gated_mlp else "up": _Dense(
            (*lead, d, (2 if c.gated_mlp else 1) * c.d_ff), (*ls, fs, tp), lb)}  # fmt: skip
        self.layers = Group(
            ln1=Norm((*lead, d), (*ls, None), ln),
            attn=Group(
                qkv=_Dense((*lead, d, sum(c.qkv_sizes)), (*ls, fs, tp), c.qkv_bias),
                out=_Dense((*lead, c.n_heads * c.head_dim, d), (*ls, tp, fs), lb),
            ),
            ln2=Norm((*lead, d), (*ls, None), ln),
            **(
                sparse_params(c, layout, lead, ls, fs, tp)
                if c.n_experts
                else {"mlp": Group(**fc1, down=_Dense((*lead, c.d_ff, d), (*ls, tp, fs), lb))}
            ),
        )
        self.ln_f = Norm((d,), (None,), ln)
        if not c.tie_embeddings:
            self.unembed = Kernel((d, vp), (fs, tp))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits ``[batch, seq, padded_vocab]`` of int tokens ``[batch, seq]`` (positions 0..seq-1).

        Args:
            tokens: int32 token ids.

        Returns:
            float32 logits; the padded vocabulary columns hold a large negative number.
        """
        return self.forward(tokens)[0]

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The logits of :meth:`__call__` and the load-balancing loss (0 for a dense model).

        Args:
            tokens: int32 token ids ``[batch, seq]``.

        Returns:
            ``(logits, aux)``: aux as transformers' Mixtral ``load_balancing_loss_func``.
        """
        c = self.config
        emb = self.embed.embedding[...]
        x = constrain_batch(jax.nn.one_hot(tokens, emb.shape[0], dtype=emb.dtype) @ emb)
        s = tokens.shape[1]
        rope: tuple[jax.Array, jax.Array] | None = None
        if c.positions == "learned":
            x = x + self.pos_embed.embedding[...][:s]
        else:
            freqs = jnp.arange(s, dtype=jnp.float32)[:, None] * jnp.asarray(c.inv_freq())[None, :]
            angles = jnp.concatenate([freqs, freqs], axis=-1)  # [s, head_dim]
            rope = (jnp.cos(angles), jnp.sin(angles))
        q_pos, k_pos = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
        mask = k_pos <= q_pos
        if c.sliding_window is not None:
            mask = mask & (k_pos > q_pos - c.sliding_window)
        stacked = nnx.to_pure_dict(nnx.state(self.layers))
        if self.layout.stages > 1:  # [stages, per_stage] -> [n_layers]
            stacked = jax.tree.map(lambda a: a.reshape((c.n_layers, *a.shape[2:])), stacked)

        def body(h: jax.Array, p: dict) -> tuple[jax.Array, Any]:
            h, stats = _block(h, p, c, self.layout.tensor, rope, mask)
            return constrain_batch(h), stats

        x, stats = jax.lax.scan(body, x, stacked)
        h = _norm(x, nnx.to_pure_dict(nnx.state(self.ln_f)), c)
        logits = h @ (emb.T if c.tie_embeddings else self.unembed.kernel[...])
        valid = jnp.arange(logits.shape[-1]) < c.vocab_size
        aux = jnp.zeros((), jnp.float32)
        if c.n_experts:
            aux = load_balancing_loss(stats, c.n_experts, tokens.shape[0] * s)
        return jnp.where(valid, logits, NEG_INF), aux


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """transformers' ``apply_rotary_pos_emb`` on ``x [b, s, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + rot * sin[None, :, None, :]


def _norm(x: jax.Array, p: dict, c: LlamaConfig) -> jax.Array:
    if c.norm == "layer":
        return layer_norm(x, p["scale"], p["bias"], c.norm_eps)
    return rms_norm(x, p["scale"], c.norm_eps)


def _linear(x: jax.Array, p: dict) -> jax.Array:
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def _act(x: jax.Array, c: LlamaConfig) -> jax.Array:
    if c.activation == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=c.activation == "gelu_pytorch_tanh")


def _block(
    x: jax.Array, p: dict, c: LlamaConfig, t: int, rope: tuple[jax.Array, jax.Array] | None,
    mask: Any,
) -> tuple[jax.Array, Any]:  # fmt: skip
    """One decoder layer on ``x [b, s, d]`` with per-layer params ``p`` (TP-fused); router stats."""
    b, s, _ = x.shape
    hq, hk, hd = c.n_heads, c.n_kv_heads, c.head_dim
    h = _norm(x, p["ln1"], c)
    qkv = _linear(h, p["attn"]["qkv"])
    qkv = qkv.reshape(b, s, t, (hq + 2 * hk) // t, hd)
    q, k, v = jnp.split(qkv, [hq // t, (hq + hk) // t], axis=3)  # one [q_r|k_r|v_r] per shard r
    q, k = q.reshape(b, s, hq, hd), k.reshape(b, s, hk, hd)
    if rope is not None:
        q, k = _rotate(q, *rope), _rotate(k, *rope)
    q = q.reshape(b, s, hk, hq // hk, hd)
    v = v.reshape(b, s, hk, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) * (hd**-0.5)
    probs = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1)
    att = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, hq * hd)
    x = x + _linear(att, p["attn"]["out"])
    h = _norm(x, p["ln2"], c)
    if c.n_experts:
        y, stats = sparse_mlp(h, p, c, t)
        return x + y, stats
    if not c.gated_mlp:
        return x + _linear(_act(_linear(h, p["mlp"]["up"]), c), p["mlp"]["down"]), None
    gu = _linear(h, p["mlp"]["gate_up"]).reshape(b, s, t, 2, c.d_ff // t)
    gate, up = gu[:, :, :, 0].reshape(b, s, c.d_ff), gu[:, :, :, 1].reshape(b, s, c.d_ff)
    return x + _linear(_act(gate, c) * up, p["mlp"]["down"]), None


def model_from_params(params: PyTree, config: LlamaConfig, layout: Layout) -> Llama:
    """The nnx module holding ``params`` (works inside ``jax.jit``).

    Args:
        params: nested dict of arrays in ``layout``'s parameter layout.
        config: the model configuration.
        layout: the parallel layout of ``params``.

    Returns:
        A :class:`Llama` whose Params are the given arrays.
    """
    return nnx.merge(module_graph(Llama, config, layout)[0], params)


def param_shardings(config: LlamaConfig, layout: Layout, mesh: Mesh) -> PyTree:
    """The NamedSharding of every parameter, as a nested dict mirroring the params.

    Args:
        config: the model configuration.
        layout: the parallel layout.
        mesh: a mesh with the axes ('stage', 'data', 'fsdp', 'tensor') of this layout.

    Returns:
        A nested dict of ``NamedSharding``.
    """
    return module_shardings(Llama, config, layout, mesh)


def abstract_params(config: LlamaConfig, layout: Layout, mesh: Mesh) -> PyTree:
    """The params as ``jax.ShapeDtypeStruct`` with shardings (a restore target).

    Args:
        config: the model configuration.
        layout: the parallel layout.
        mesh: the layout's mesh.

    Returns:
        A nested dict of ``jax.ShapeDtypeStruct(shape, float32, sharding=NamedSharding)``.

    >>> abstract_params(LlamaConfig(), Layout(), make_mesh(Layout()))["ln_f"]["scale"].shape
    (64,)
    """
    return module_abstract_params(Llama, config, layout, mesh)


def ucp_rules(config: LlamaConfig, layout: Layout) -> list[tuple[str, Any]]:
    """The ``ucp`` rules mapping this model's leaves to canonical atoms (``blocks.{i}...``).

    Args:
        config: the model configuration.
        layout: the parallel layout the leaves are in (sets the stacking axes).

    Returns:
        ``(regex, pattern)`` pairs for ``ucp.save`` / ``ucp.restore``.

    >>> [r for r, _ in ucp_rules(LlamaConfig(), Layout())][:2]
    ['embed\\\\.embedding', 'unembed\\\\.kernel']
    """
    stacked = Stacked(r"blocks.{i}.\1", axes=(0, 1) if layout.stages > 1 else 0)
    rules: list[tuple[str, Any]] = [(r"embed\.embedding", VocabPadded(config.vocab_size, axis=0))]
    if not config.tie_embeddings:
        rules.append((r"unembed\.kernel", VocabPadded(config.vocab_size, axis=1)))
    if config.n_experts:
        rules += expert_rules(config, layout)
    for name, (sizes, axis) in fused_sizes(config).items():
        fused = Fused(sizes, axis=axis, shard_axis="tensor")  # axis of the per-layer atom
        rules.append((r"layers\.(" + re.escape(name) + ")", (fused, stacked)))
    rules.append((r"layers\.(.*)", stacked))
    return rules


_LAZY = dict.fromkeys(("init_canonical", "to_layout", "from_layout"), "llama_layouts")
_LAZY |= dict.fromkeys(("batch", "loss_fn", "make_train_step", "make_logits_fn"), "llama_train")
_LAZY |= dict.fromkeys(
    ("HFConfigError", "config_from_hf", "read_config_json", "ucp_extra", "config_from_checkpoint"),
    "llama_config",
)


def __getattr__(name: str) -> Any:
    """Lazily re-export the layout, training and config helpers, so ``llama`` offers them all."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
