"""Megatron's distributed optimizer, `dp_reshardable` layout: flat per-bucket buffers -> tensors.

The distributed optimizer keeps the fp32 master and the Adam moments of each model-parallel rank
(TP rank ``t``, pipeline stage ``p``; ``dp_group_idx = t + T * p``) in flat buffers, one per
gradient buffer (one per dtype pair) and bucket, and saves each as the tensor
``optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_<dtypes>.bucket_idx_<k>.<field>``,
``field`` in ``param``/``exp_avg``/``exp_avg_sq``, with ``per_bucket_numel_unpadded`` (pickled)
giving each bucket's length. Inside a buffer the rank's parameters lie in reverse registration
order (the order backward produces gradients), each starting at a multiple of 64 elements.

This module rebuilds, from those buffers, the *global* tensors (as the model's sharded tensors name
them): the local parameter of each rank is its TP slice of the global tensor (a row block, a
column block, or for SwiGLU's ``linear_fc1`` a row block of each half) and its stage's layers.
The registration order is the local layer spec's (:func:`local_params`), for dense GPT models:
biases, LayerNorm biases and learned position embeddings included; a mixture-of-experts model's
``ChainedOptimizer`` buffers are refused by the importer.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from ...llama_config import LlamaConfig
from ..common.dcp_files import read_tensor
from .common import LAYERS, MegatronFormatError

_PAD = 64
_KEY = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(?P<g>\d+)\.gbuf_idx_(?P<b>\d+)\.dtype_(?P<dt>.+)"
    r"\.bucket_idx_(?P<k>\d+)\.(?P<field>param|exp_avg|exp_avg_sq)$"
)
_QKV = "self_attention.linear_qkv."
_FC1 = "mlp.linear_fc1."


def layer_order(cfg: LlamaConfig) -> list[tuple[str, Any]]:
    """A TransformerLayer's parameters in registration order (local spec) and how TP splits them
    (an axis, None for replicated, "glu" for a row block of each SwiGLU half)."""
    ln, lb = cfg.norm == "layer", cfg.linear_bias
    fc1 = "glu" if cfg.gated_mlp else 0
    order: list[tuple[str, Any, bool]] = [
        (_QKV + "layer_norm_weight", None, True),  # input_layernorm
        (_QKV + "layer_norm_bias", None, ln),
        ("self_attention.linear_proj.weight", 1, True),
        ("self_attention.linear_proj.bias", None, lb),
        (_QKV + "weight", 0, True),
        (_QKV + "bias", 0, cfg.qkv_bias),
        (_FC1 + "layer_norm_weight", None, True),  # pre_mlp_layernorm
        (_FC1 + "layer_norm_bias", None, ln),
        (_FC1 + "weight", fc1, True),
        (_FC1 + "bias", fc1, lb),
        ("mlp.linear_fc2.weight", 1, True),
        ("mlp.linear_fc2.bias", None, lb),
    ]
    return [(name, split) for name, split, present in order if present]


def _error(msg: str) -> Exception:
    return MegatronFormatError(msg)


def local_params(
    shapes: dict[str, tuple[int, ...]], cfg: LlamaConfig, tp: int, pp: int, t: int, p: int
) -> list[tuple[str, int | None, Any, tuple[int, ...]]]:
    """The parameters of model-parallel rank (t, p) in registration order:
    (global tensor name, layer or None, TP split, local shape)."""
    layers = shapes[LAYERS + "self_attention.linear_qkv.weight"][0]
    if layers % pp:
        raise _error(f"{layers} layers do not split over {pp} pipeline stages")
    per = layers // pp

    def local(shape: tuple[int, ...], split: Any) -> tuple[int, ...]:
        s = list(shape)
        ax = 0 if split == "glu" else split
        if ax is not None:
            s[ax] //= tp
        return tuple(s)

    emb = "embedding.word_embeddings.weight"
    out: list[tuple[str, int | None, Any, tuple[int, ...]]] = []
    if p == 0:
        out.append((emb, None, 0, local(shapes[emb], 0)))
        if cfg.positions == "learned":
            pos = "embedding.position_embeddings.weight"
            out.append((pos, None, None, shapes[pos]))
    for i in range(p * per, (p + 1) * per):
        for name, split in layer_order(cfg):
            full = LAYERS + name
            out.append((full, i, split, local(shapes[full][1:], split)))
    if p == pp - 1:
        for norm in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
            if norm in shapes:
                out.append((norm, None, None, shapes[norm]))
        if not cfg.tie_embeddings:
            out.append(("output_layer.weight", None, 0, local(shapes["output_layer.weight"], 0)))
        elif pp > 1:  # the last stage's copy of the tied embedding (the same values)
            out.append((emb, None, 0, local(shapes[emb], 0)))
    return out


def _place(dst: torch.Tensor, src: torch.Tensor, split: Any, t: int, tp: int) -> None:
    """Write rank t's local tensor `src` into its place in the global `dst`."""
    if split is None:
        dst.copy_(src)
    elif split == "glu":
        half, n = dst.shape[0] // 2, src.shape[0] // 2
        dst[t * n : (t + 1) * n] = src[:n]
        dst[half + t * n : half + (t + 1) * n] = src[n:]
    else:
        n = src.shape[split]
        dst.narrow(split, t * n, n).copy_(src)


def bucket_tensors(
    folder: str,
    md: Any,
    objects: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    cfg: LlamaConfig,
) -> dict[tuple[str, str], torch.Tensor]:
    """(global tensor name, slot) -> global tensor, from dp_reshardable buffers ({} if none).

    Slots: ``fp32`` (the master, from ``param``), ``exp_avg``, ``exp_avg_sq``.
    """
    buffers: dict[int, dict[tuple[int, int], dict[str, str]]] = {}
    for k in shapes:
        m = _KEY.match(k)
        if m:
            g, b, kk = int(m["g"]), int(m["b"]), int(m["k"])
            buffers.setdefault(g, {}).setdefault((b, kk), {})[m["field"]] = k
    if not buffers:
        return {}
    if cfg.n_experts:
        raise _error(
            f"{folder}: dp_reshardable optimizer buffers of a mixture-of-experts model; only its "
            "fully_reshardable layout is read (distrib_optim_sharding_type)"
        )
    ngroups = len(buffers)
    layers = shapes[LAYERS + "self_attention.linear_qkv.weight"][0]
    # TP from the embedding's chunks (the vocab rows split over TP), PP from the group count
    n_chunks = len(md.state_dict_metadata["embedding.word_embeddings.weight"].chunks)
    tp = max(1, n_chunks)
    pp = ngroups // tp
    if tp * pp != ngroups or layers % pp:
        raise _error(
            f"{folder}: {ngroups} distributed-optimizer groups do not match TP={tp} (the "
            f"embedding's chunks) times a pipeline size dividing {layers} layers"
        )
    out: dict[tuple[str, str], torch.Tensor] = {}
    for g in sorted(buffers):
        t, p = g % tp, g // tp
        params = local_params(shapes, cfg, tp, pp, t, p)
        numel = objects.get(f"optimizer.distributed.dp_group_idx_{g}.per_bucket_numel_unpadded")
        if not isinstance(numel, list) or len(numel) != 1 or not isinstance(numel[0], dict):
            raise _error(
                f"{folder}: dp_group_idx_{g}: per_bucket_numel_unpadded is {numel!r:.120}; "
                "expected one gradient buffer's {dtypes: [numel per bucket]} map"
            )
        sizes = next(iter(numel[0].values()))
        if len(sizes) != 1:
            # Seen with megatron-core 0.19.2 (overlap_grad_reduce, several buckets): each saved
            # bucket tensor is offset by the padding of the buckets before it and lacks its
            # last elements, so the moments cannot all be recovered from this layout.
            raise _error(
                f"{folder}: dp_group_idx_{g}: the dp_reshardable optimizer state has "
                f"{len(sizes)} buckets per buffer; only one bucket per buffer is supported. "
                "Save with the fully_reshardable layout (distrib_optim_sharding_type) instead"
            )
        # walk the parameters backwards, as the buffer lays them out
        order = list(reversed(params))
        pos, bucket, start_of_bucket = 0, 0, 0
        fields: dict[str, torch.Tensor] = {}
        for name, layer, split, lshape in order:
            n = math.prod(lshape)
            pos = -(-pos // _PAD) * _PAD
            if bucket >= len(sizes):
                raise _error(f"{folder}: dp_group_idx_{g}: more parameters than buckets hold")
            if (0, bucket) not in buffers[g]:
                raise _error(f"{folder}: dp_group_idx_{g}: no buffer for bucket {bucket}")
            for field, fqn in buffers[g][(0, bucket)].items():
                if field not in fields:
                    fields[field] = read_tensor(folder, md, fqn, MegatronFormatError)
                flat = fields[field]
                rel = pos - start_of_bucket
                if rel + n > flat.numel():
                    raise _error(
                        f"{folder}: {fqn}: parameter {name} (layer {layer}) at {rel} of {n} "
                        f"elements runs past the buffer's {flat.numel()}"
                    )
                local = flat[rel : rel + n].reshape(lshape)
                slot = "fp32" if field == "param" else field
                dst = out.get((name, slot))
                if dst is None:
                    dst = out[(name, slot)] = torch.zeros(shapes[name], dtype=flat.dtype)
                _place(dst if layer is None else dst[layer], local, split, t, tp)
            pos += n
            if pos - start_of_bucket >= sizes[bucket] and (name, layer) != order[-1][:2]:
                pos = start_of_bucket = 0  # each bucket is its own tensor
                bucket += 1
                fields = {}
    return out


__all__ = ["bucket_tensors", "local_params"]
