"""Canonical (layout-independent) weights of the demo GPT, and the maps to and from a layout."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

from ..models.parallel import Layout
from ..models.placement import flatten_tree, fuse_tp, put_sharded, unflatten_tree, unfuse_tp
from .model import GPTConfig, PyTree, fused_sizes, param_shardings

_BLOCK_PARAMS = (
    "ln1.scale",
    "attn.qkv.kernel",
    "attn.out.kernel",
    "ln2.scale",
    "mlp.gate_up.kernel",
    "mlp.down.kernel",
)


def init_canonical(config: GPTConfig, seed: int | None = None) -> dict[str, np.ndarray]:
    """Layout-independent initial weights, by canonical atom name (``blocks.{i}.attn.qkv.kernel``...).

    Args:
        config: the model configuration.
        seed: random seed (default ``config.seed``).

    Returns:
        A flat dict of float32 numpy arrays: unpadded vocabulary, one entry per layer,
        fused kernels in the canonical ``[q | k | v]`` / ``[gate | up]`` column order.
    """
    c = config
    rng = np.random.default_rng([c.seed if seed is None else seed, 0])
    d, hd = c.d_model, c.head_dim

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    out: dict[str, np.ndarray] = {"embed.embedding": normal((c.vocab_size, d), 1.0)}
    resid = 1.0 / math.sqrt(2 * c.n_layers)
    for i in range(c.n_layers):
        pre = f"blocks.{i}."
        out[pre + "ln1.scale"] = np.ones((d,), np.float32)
        qkv_cols = (c.n_heads + 2 * c.n_kv_heads) * hd
        out[pre + "attn.qkv.kernel"] = normal((d, qkv_cols), d**-0.5)
        out[pre + "attn.out.kernel"] = normal((c.n_heads * hd, d), (c.n_heads * hd) ** -0.5 * resid)
        out[pre + "ln2.scale"] = np.ones((d,), np.float32)
        out[pre + "mlp.gate_up.kernel"] = normal((d, 2 * c.d_ff), d**-0.5)
        out[pre + "mlp.down.kernel"] = normal((c.d_ff, d), c.d_ff**-0.5 * resid)
    out["ln_f.scale"] = np.ones((d,), np.float32)
    out["unembed.kernel"] = normal((d, c.vocab_size), d**-0.5)
    return out


def to_layout(
    canonical: dict[str, np.ndarray], config: GPTConfig, layout: Layout, mesh: Mesh
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
    layout.check(config)
    c, t = config, layout.tensor
    vp, fused = c.padded_vocab(t), fused_sizes(config)
    flat: dict[str, np.ndarray] = {}
    emb = canonical["embed.embedding"]
    flat["embed.embedding"] = np.pad(emb, ((0, vp - c.vocab_size), (0, 0)))
    unemb = canonical["unembed.kernel"]
    flat["unembed.kernel"] = np.pad(unemb, ((0, 0), (0, vp - c.vocab_size)))
    flat["ln_f.scale"] = canonical["ln_f.scale"]
    lead = (layout.stages, c.n_layers // layout.stages) if layout.stages > 1 else (c.n_layers,)
    for name in _BLOCK_PARAMS:
        per_layer = [canonical[f"blocks.{i}.{name}"] for i in range(c.n_layers)]
        if name in fused:
            per_layer = [fuse_tp(a, fused[name], t) for a in per_layer]
        stacked = np.stack(per_layer)
        flat[f"layers.{name}"] = stacked.reshape(lead + stacked.shape[1:])
    shardings = param_shardings(config, layout, mesh)
    return jax.tree.map(put_sharded, unflatten_tree(flat), shardings)


def from_layout(params: PyTree, config: GPTConfig, layout: Layout) -> dict[str, np.ndarray]:
    """The exact inverse of :func:`to_layout`: params of a layout -> canonical numpy weights.

    Args:
        params: nested dict of arrays in ``layout``'s parameter layout (fully addressable).
        config: the model configuration.
        layout: the layout the params are in.

    Returns:
        A flat dict of numpy arrays with canonical names and shapes.
    """
    c, t = config, layout.tensor
    flat = {k: np.asarray(v) for k, v in flatten_tree(params).items()}
    fused = fused_sizes(config)
    out = {
        "embed.embedding": flat["embed.embedding"][: c.vocab_size],
        "unembed.kernel": flat["unembed.kernel"][:, : c.vocab_size],
        "ln_f.scale": flat["ln_f.scale"],
    }
    for name in _BLOCK_PARAMS:
        a = flat[f"layers.{name}"]
        a = a.reshape((c.n_layers, *a.shape[2 if layout.stages > 1 else 1 :]))
        for i in range(c.n_layers):
            out[f"blocks.{i}.{name}"] = unfuse_tp(a[i], fused[name], t) if name in fused else a[i]
    return out
