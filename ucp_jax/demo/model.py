"""A small Flax (nnx) GPT whose parameter layout depends on the parallel layout.

The layout-dependent parts are exactly what a universal checkpoint has to undo:

* the fused QKV (and SwiGLU ``[gate | up]``) kernels hold, along their last axis, one ``[q_r | k_r | v_r]``
  group per tensor-parallel shard ``r``;
* the embedding / unembedding are zero-padded to a multiple of ``64 * tensor`` rows / columns;
* per-layer parameters are stacked as ``[n_layers, ...]`` or ``[stages, n_layers // stages, ...]``.

Weights are initialised once in the canonical (unsharded, per-layer) layout by :func:`init_canonical`,
so the same seed gives the same model, and the same losses, in every layout.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from ..models.parallel import (
    NEG_INF,
    Group,
    Kernel,
    Layout,
    Norm,
    constrain_batch,
    make_param,
    module_abstract_params,
    module_graph,
    module_shardings,
    rms_norm,
)

PyTree = Any


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of the demo GPT (pre-LN, causal attention with GQA, SwiGLU MLP)."""

    vocab_size: int = 250
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 4
    n_layers: int = 4
    d_ff: int = 128
    seq_len: int = 32
    vocab_multiple: int = 64
    norm_eps: float = 1e-5
    seed: int = 0

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    def padded_vocab(self, tensor: int) -> int:
        """Vocabulary size rounded up to a multiple of ``vocab_multiple * tensor``."""
        m = self.vocab_multiple * tensor
        return -(-self.vocab_size // m) * m


# ----------------------------------------------------------------------------- module definition


class GPT(nnx.Module):
    """The demo GPT with layout-dependent parameter shapes (zeros; use :func:`to_layout` for weights).

    Args:
        config: the model configuration.
        layout: the parallel layout whose parameter layout the module holds.
    """

    def __init__(self, config: GPTConfig, layout: Layout) -> None:
        layout.check(config)
        c, t = config, layout.tensor
        self.config, self.layout = config, layout
        d, hd, vp = c.d_model, c.head_dim, c.padded_vocab(t)
        fs = "fsdp" if layout.fsdp > 1 and d % layout.fsdp == 0 else None
        tp = "tensor" if t > 1 else None
        lead: tuple[int, ...]
        lspec: tuple[str | None, ...]
        if layout.stages > 1:
            lead, lspec = (layout.stages, c.n_layers // layout.stages), ("stage", None)
        else:
            lead, lspec = (c.n_layers,), (None,)

        def stacked(cls: type, shape: tuple[int, ...], spec: tuple[str | None, ...]) -> nnx.Module:
            return cls(lead + shape, lspec + spec)

        self.embed: Any = Group(embedding=make_param((vp, d), (tp, fs)))
        self.layers = Group(
            ln1=stacked(Norm, (d,), (None,)),
            attn=Group(
                qkv=stacked(Kernel, (d, (c.n_heads + 2 * c.n_kv_heads) * hd), (fs, tp)),
                out=stacked(Kernel, (c.n_heads * hd, d), (tp, fs)),
            ),
            ln2=stacked(Norm, (d,), (None,)),
            mlp=Group(
                gate_up=stacked(Kernel, (d, 2 * c.d_ff), (fs, tp)),
                down=stacked(Kernel, (c.d_ff, d), (tp, fs)),
            ),
        )
        self.ln_f = Norm((d,), (None,))
        self.unembed = Kernel((d, vp), (fs, tp))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits ``[batch, seq, padded_vocab]`` of int tokens ``[batch, seq]``; padding is masked.

        Args:
            tokens: int32 token ids.

        Returns:
            float32 logits; the padded vocabulary columns hold a large negative number.
        """
        c = self.config
        emb = self.embed.embedding[...]  # one-hot matmul: exact, and vocab-parallel friendly
        x = constrain_batch(jax.nn.one_hot(tokens, emb.shape[0], dtype=emb.dtype) @ emb)
        stacked = nnx.to_pure_dict(nnx.state(self.layers))
        if self.layout.stages > 1:  # the leading [stages, per_stage] axes merge into [n_layers]
            stacked = jax.tree.map(lambda a: a.reshape((c.n_layers, *a.shape[2:])), stacked)

        def body(h: jax.Array, p: dict) -> tuple[jax.Array, None]:
            return constrain_batch(_block(h, p, c, self.layout.tensor)), None

        x, _ = jax.lax.scan(body, x, stacked)
        logits = rms_norm(x, self.ln_f.scale[...], c.norm_eps) @ self.unembed.kernel[...]
        valid = jnp.arange(logits.shape[-1]) < c.vocab_size
        return jnp.where(valid, logits, NEG_INF)


def _block(x: jax.Array, p: dict, c: GPTConfig, t: int) -> jax.Array:
    """One pre-LN transformer block on ``x [b, s, d]`` with per-layer params ``p`` (TP-fused)."""
    b, s, _ = x.shape
    hq, hk, hd = c.n_heads, c.n_kv_heads, c.head_dim
    h = rms_norm(x, p["ln1"]["scale"], c.norm_eps)
    qkv = (h @ p["attn"]["qkv"]["kernel"]).reshape(b, s, t, (hq + 2 * hk) // t, hd)
    q, k, v = jnp.split(qkv, [hq // t, (hq + hk) // t], axis=3)  # one [q_r|k_r|v_r] per shard r
    q = q.reshape(b, s, hk, hq // hk, hd)
    k, v = k.reshape(b, s, hk, hd), v.reshape(b, s, hk, hd)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, NEG_INF), axis=-1)
    att = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, hq * hd)
    x = x + att @ p["attn"]["out"]["kernel"]
    h = rms_norm(x, p["ln2"]["scale"], c.norm_eps)
    gu = (h @ p["mlp"]["gate_up"]["kernel"]).reshape(b, s, t, 2, c.d_ff // t)
    gate, up = gu[:, :, :, 0].reshape(b, s, c.d_ff), gu[:, :, :, 1].reshape(b, s, c.d_ff)
    return x + (jax.nn.silu(gate) * up) @ p["mlp"]["down"]["kernel"]


# ----------------------------------------------------------------------------- layouts


def fused_sizes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The sub-param sizes of each fused leaf (qkv, gate_up) of a config."""
    c = config
    qkv = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim)
    return {"attn.qkv.kernel": qkv, "mlp.gate_up.kernel": (c.d_ff, c.d_ff)}


def model_from_params(params: PyTree, config: GPTConfig, layout: Layout) -> GPT:
    """The nnx module holding ``params`` (works inside ``jax.jit``).

    Args:
        params: nested dict of arrays in ``layout``'s parameter layout.
        config: the model configuration.
        layout: the parallel layout of ``params``.

    Returns:
        A :class:`GPT` whose Params are the given arrays.
    """
    return nnx.merge(module_graph(GPT, config, layout)[0], params)


def param_shardings(config: GPTConfig, layout: Layout, mesh: Mesh) -> PyTree:
    """The NamedSharding of every parameter, as a nested dict mirroring the params.

    Args:
        config: the model configuration.
        layout: the parallel layout.
        mesh: a mesh with the axes ('stage', 'data', 'fsdp', 'tensor') of this layout.

    Returns:
        A nested dict of ``NamedSharding``.
    """
    return module_shardings(GPT, config, layout, mesh)


def abstract_params(config: GPTConfig, layout: Layout, mesh: Mesh) -> PyTree:
    """The params as ``jax.ShapeDtypeStruct`` with shardings (a restore target).

    Args:
        config: the model configuration.
        layout: the parallel layout.
        mesh: the layout's mesh.

    Returns:
        A nested dict of ``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding)``.
    """
    return module_abstract_params(GPT, config, layout, mesh)


def ucp_rules(config: GPTConfig, layout: Layout) -> list[tuple[str, Any]]:
    """The ``ucp`` rules mapping this model's leaves to canonical atoms (``blocks.{i}...``).

    Args:
        config: the model configuration.
        layout: the parallel layout the leaves are in (sets the stacking axes).

    Returns:
        A list of ``(regex, pattern)`` / ``(regex, (pattern, ...))`` for ``ucp.save``/``ucp.restore``.
    """
    import ucp_jax as ucp  # lazy: the model imports without the core library

    stacked = ucp.Stacked(r"blocks.{i}.\1", axes=(0, 1) if layout.stages > 1 else 0)
    rules: list[tuple[str, Any]] = [
        (r"embed\.embedding", ucp.VocabPadded(config.vocab_size, axis=0)),
        (r"unembed\.kernel", ucp.VocabPadded(config.vocab_size, axis=1)),
    ]
    for name, sizes in fused_sizes(config).items():
        fused = ucp.Fused(sizes, axis=1, shard_axis="tensor")  # axis of the per-layer atom
        rules.append((r"layers\.(" + re.escape(name) + ")", (fused, stacked)))
    rules.append((r"layers\.(.*)", stacked))
    return rules


_LAZY = dict.fromkeys(("init_canonical", "to_layout", "from_layout"), "layouts") | dict.fromkeys(
    (
        "make_optimizer",
        "abstract_opt_state",
        "init_opt_state",
        "batch",
        "loss_fn",
        "make_train_step",
    ),
    "train",
)


def __getattr__(name: str) -> Any:
    """Lazily re-export :mod:`.layouts` and :mod:`.train` names, so ``model`` offers them all."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
