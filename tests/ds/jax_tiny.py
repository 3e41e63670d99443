"""A JAX re-implementation of tests/ds/tiny_model.py, on a layout unlike torch's.

Params are stacked over layers and Linear weights are [in, out] (flax style), so restoring the
torch atoms takes rules: `ucp.Stacked` over `blocks.{i}` and `ucp.Transposed((1, 0))`.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp

LINEARS = ("qkv", "proj", "fc1", "fc2")
NORMS = ("ln1", "ln2")

# leaf 'layers.qkv.weight' [L, in, out] <- atoms 'blocks.{i}.qkv.weight' [out, in]
RULES = [
    (r"layers\.(qkv|proj|fc1|fc2)\.weight",
     (ucp.Transposed((1, 0)), ucp.Stacked(r"blocks.{i}.\1.weight"))),
    (r"layers\.(\w+)\.(weight|bias)", ucp.Stacked(r"blocks.{i}.\1.\2")),
    (r"head\.weight", ucp.Transposed((1, 0))),
]  # fmt: skip


def shapes(vocab: int, dim: int, hidden: int, layers: int, seq: int) -> dict:
    """The JAX param tree (shapes only)."""
    lin = {"qkv": (dim, 3 * dim), "proj": (dim, dim), "fc1": (dim, hidden), "fc2": (hidden, dim)}
    tree: dict = {"emb": {"weight": (vocab, dim)}, "pos": (seq, dim), "layers": {}}
    for k, (i, o) in lin.items():
        tree["layers"][k] = {"weight": (layers, i, o), "bias": (layers, o)}
    for k in NORMS:
        tree["layers"][k] = {"weight": (layers, dim), "bias": (layers, dim)}
    tree["ln_f"] = {"weight": (dim,), "bias": (dim,)}
    tree["head"] = {"weight": (dim, vocab)}
    return tree


def spec_for(name: str, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    """Shard the last axis over 'model' and the first over 'data' where they divide."""
    axes: list = [None] * len(shape)
    if shape and shape[-1] % mesh.shape["model"] == 0:
        axes[-1] = "model"
    if len(shape) > 1 and shape[0] % mesh.shape["data"] == 0:
        axes[0] = "data"
    return P(*axes)


def targets(mesh: jax.sharding.Mesh, dims: dict, dtype=jnp.float32) -> dict:
    """ShapeDtypeStructs with shardings on `mesh` for every param."""
    tree = shapes(**dims)

    def build(node, prefix):
        if isinstance(node, dict):
            return {k: build(v, f"{prefix}.{k}" if prefix else k) for k, v in node.items()}
        sh = NamedSharding(mesh, spec_for(prefix, node, mesh))
        return jax.ShapeDtypeStruct(node, dtype, sharding=sh)

    return build(tree, "")


def _ln(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * w + b


def loss_fn(params: dict, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, exactly the torch model's forward."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    x = params["emb"]["weight"][inp] + params["pos"]
    dim = x.shape[-1]
    t = x.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    lay = params["layers"]
    for i in range(lay["qkv"]["weight"].shape[0]):
        p = jax.tree.map(lambda a, i=i: a[i], lay)
        h = _ln(x, p["ln1"]["weight"], p["ln1"]["bias"])
        qkv = h @ p["qkv"]["weight"] + p["qkv"]["bias"]
        q, k, v = jnp.split(qkv, 3, axis=-1)
        att = (q @ jnp.swapaxes(k, -1, -2)) / math.sqrt(dim)
        att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
        x = x + (att @ v) @ p["proj"]["weight"] + p["proj"]["bias"]
        h = _ln(x, p["ln2"]["weight"], p["ln2"]["bias"])
        h = jax.nn.gelu(h @ p["fc1"]["weight"] + p["fc1"]["bias"], approximate=False)
        x = x + h @ p["fc2"]["weight"] + p["fc2"]["bias"]
    logits = _ln(x, params["ln_f"]["weight"], params["ln_f"]["bias"]) @ params["head"]["weight"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, tgt[..., None], axis=-1).mean()


def from_torch_state(sd: dict) -> dict:
    """The JAX tree from a torch state dict (numpy), by hand: the reference for the rules."""
    layers = sorted({int(m[1]) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    out: dict = {
        "emb": {"weight": sd["emb.weight"]},
        "pos": sd["pos"],
        "ln_f": {"weight": sd["ln_f.weight"], "bias": sd["ln_f.bias"]},
        "head": {"weight": sd["head.weight"].T},
        "layers": {},
    }
    for k in LINEARS + NORMS:
        w = [sd[f"blocks.{i}.{k}.weight"] for i in layers]
        out["layers"][k] = {
            "weight": np.stack([x.T for x in w] if k in LINEARS else w),
            "bias": np.stack([sd[f"blocks.{i}.{k}.bias"] for i in layers]),
        }
    return out
