"""Canonical (layout-independent) weights of the Llama model, and the maps to and from a layout."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .llama import PyTree, block_params, check_layout, fused_sizes, param_shardings
from .llama_config import LlamaConfig
from .moe import EXPERT_PARAMS, init_experts, stack_experts, unstack_experts
from .parallel import Layout
from .placement import flatten_tree, fuse_tp, put_sharded, unflatten_tree, unfuse_tp

_TOP = ("ln_f.scale", "ln_f.bias", "pos_embed.embedding")  # top-level atoms taken as they are


def init_canonical(config: LlamaConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """Random float32 weights by canonical atom name (``blocks.{i}.attn.qkv.kernel`` ...).

    Args:
        config: the model configuration.
        seed: random seed.
        std: standard deviation of the kernels and embedding (norm scales are 1, biases small).

    Returns:
        A flat dict of numpy arrays: unpadded vocabulary, one entry per layer, fused kernels in
        the canonical ``[q | k | v]`` / ``[gate | up]`` column order.

    >>> sorted(init_canonical(LlamaConfig(n_layers=1)))[:2]
    ['blocks.0.attn.out.kernel', 'blocks.0.attn.qkv.kernel']
    """
    c = config
    rng = np.random.default_rng([seed, 12])
    d = c.d_model

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    out = {"embed.embedding": normal(c.vocab_size, d)}
    if c.positions == "learned":
        out["pos_embed.embedding"] = normal(c.max_positions, d)
    ln, lb, f = c.norm == "layer", c.linear_bias, c.d_ff
    for i in range(c.n_layers):
        pre = f"blocks.{i}."
        out[pre + "ln1.scale"] = np.ones((d,), np.float32)
        if ln:
            out[pre + "ln1.bias"] = normal(d)
        out[pre + "attn.qkv.kernel"] = normal(d, sum(c.qkv_sizes))
        if c.qkv_bias:
            out[pre + "attn.qkv.bias"] = normal(sum(c.qkv_sizes))
        out[pre + "attn.out.kernel"] = normal(c.n_heads * c.head_dim, d)
        if lb:
            out[pre + "attn.out.bias"] = normal(d)
        out[pre + "ln2.scale"] = np.ones((d,), np.float32)
        if ln:
            out[pre + "ln2.bias"] = normal(d)
        if c.n_experts:
            init_experts(c, i, normal, out)
            continue
        fc1 = "mlp.gate_up" if c.gated_mlp else "mlp.up"
        out[pre + fc1 + ".kernel"] = normal(d, (2 if c.gated_mlp else 1) * f)
        if lb:
            out[pre + fc1 + ".bias"] = normal((2 if c.gated_mlp else 1) * f)
        out[pre + "mlp.down.kernel"] = normal(f, d)
        if lb:
            out[pre + "mlp.down.bias"] = normal(d)
    out["ln_f.scale"] = np.ones((d,), np.float32)
    if ln:
        out["ln_f.bias"] = normal(d)
    if not c.tie_embeddings:
        out["unembed.kernel"] = normal(d, c.vocab_size)
    return out


def to_layout(
    canonical: dict[str, np.ndarray], config: LlamaConfig, layout: Layout, mesh: Mesh
) -> PyTree:
    """Lay canonical weights out for a layout: fuse per TP, pad the vocabulary, stack, shard.

    Args:
        canonical: flat dict from :func:`init_canonical` (or :func:`from_layout`).
        config: the model configuration.
        layout: the parallel layout.
        mesh: the layout's mesh.

    Returns:
        The params: a nested dict of sharded ``jax.Array``.
    """
    check_layout(config, layout)
    c, t = config, layout.tensor
    pad = c.padded_vocab(t) - c.vocab_size
    flat: dict[str, np.ndarray] = {
        "embed.embedding": np.pad(canonical["embed.embedding"], ((0, pad), (0, 0))),
    }
    flat |= {k: canonical[k] for k in _TOP if k in canonical}
    if not c.tie_embeddings:
        flat["unembed.kernel"] = np.pad(canonical["unembed.kernel"], ((0, 0), (0, pad)))
    lead = (layout.stages, c.n_layers // layout.stages) if layout.stages > 1 else (c.n_layers,)
    fused = fused_sizes(c)
    for name in block_params(c):
        if name in EXPERT_PARAMS:
            per_layer = [stack_experts(canonical, c, name, i, t) for i in range(c.n_layers)]
        else:
            per_layer = [canonical[f"blocks.{i}.{name}"] for i in range(c.n_layers)]
        if name in fused:
            per_layer = [fuse_tp(a, fused[name][0], t) for a in per_layer]
        stacked = np.stack(per_layer)
        flat[f"layers.{name}"] = stacked.reshape(lead + stacked.shape[1:])
    return jax.tree.map(put_sharded, unflatten_tree(flat), param_shardings(config, layout, mesh))


def from_layout(params: PyTree, config: LlamaConfig, layout: Layout) -> dict[str, np.ndarray]:
    """The exact inverse of :func:`to_layout`: params of a layout -> canonical numpy weights.

    Args:
        params: nested dict of arrays in ``layout``'s parameter layout (fully addressable).
        config: the model configuration.
        layout: the layout the params are in.

    Returns:
        A flat dict of numpy arrays with canonical names and shapes.
    """
    c, t = config, layout.tensor
    flat: dict[str, Any] = {k: np.asarray(v) for k, v in flatten_tree(params).items()}
    out = {"embed.embedding": flat["embed.embedding"][: c.vocab_size]}
    out |= {k: flat[k] for k in _TOP if k in flat}
    if not c.tie_embeddings:
        out["unembed.kernel"] = flat["unembed.kernel"][:, : c.vocab_size]
    fused = fused_sizes(c)
    for name in block_params(c):
        a = flat[f"layers.{name}"]
        a = a.reshape((c.n_layers, *a.shape[2 if layout.stages > 1 else 1 :]))
        for i in range(c.n_layers):
            if name in EXPERT_PARAMS:
                out.update(unstack_experts(a[i], c, name, i, t))
                continue
            out[f"blocks.{i}.{name}"] = (
                unfuse_tp(a[i], fused[name][0], t) if name in fused else a[i]
            )
    return out
