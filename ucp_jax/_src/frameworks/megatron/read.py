"""Megatron-Core `torch_dist` checkpoints -> atoms of ``ucp_jax.models.llama`` (any TP / PP / DP).

Megatron-Core's ``dist_checkpointing.save`` writes a torch.distributed.checkpoint folder
(`.metadata`, one ``__<rank>_0.distcp`` per rank, ``metadata.json``); the common state (iteration,
optimizer hyperparameters) is a pickled bytes entry ``common_state/...`` inside it (0.19), or
``common.pt`` next to it (older releases). Every tensor is stored in its *global* shape: TP shards
and pipeline stages are chunks of it. This importer reads those chunks with the restricted
unpickler of the DCP importer (Megatron is not needed) and turns Megatron's tensors into the
model's tensors, the atoms the Hugging Face importer writes too:

- layers are stacked on a leading axis ``[L, ...]``: one atom per layer (``blocks.{i}...``);
- ``linear_qkv.weight`` holds, per query group, the group's query heads then its key and value
  head: split into ``[q | k | v]`` columns (a fused atom, as ``q_proj``/``k_proj``/``v_proj``);
- ``linear_fc1.weight`` of a SwiGLU MLP is ``[all gate; all up]``: the ``[gate | up]`` fused atom;
- the norms that ride on the linears (``linear_qkv.layer_norm_weight``) are the block's norms;
- the vocabulary padding rows of the embedding and output layer are dropped (``vocab_size``);
- torch's ``[out, in]`` weights become ``[in, out]`` kernels.

Optimizer state (Adam): ``optimizer.state.{exp_avg,exp_avg_sq}.<param>`` (Megatron's plain
optimizer; with bf16 also ``fp32_param``, the fp32 master), or the distributed optimizer's
``fully_reshardable`` ``optimizer.state.{param,exp_avg,exp_avg_sq}.<param>``, or its
``dp_reshardable`` flat per-bucket buffers (see :mod:`.megatron_buckets`). The fp32 master, where
there is one, is the atom's value (slot ``fp32``); the moments are slots ``exp_avg`` /
``exp_avg_sq``.

>>> ucp.torch.import_megatron("ckpt/iter_0000100", "/tmp/ucp/gpt", heads=32)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from ...errors import NotACheckpointError
from ...llama_config import LlamaConfig
from ...mapping.patterns import FusedMark
from ...untrusted.json import read_json_file
from ...untrusted.lazy import jsonable
from ...untrusted.limits import ucp_errors
from ..common.dcp_files import (
    read_metadata,
    read_objects,
    read_tensor,
)
from ..common.writer import AtomWriter, to_numpy
from .common import LAYERS, MAX_METADATA_BYTES, TENSORS, MegatronFormatError

# Megatron tensor -> (atom, or the per-layer atom after "blocks.{i}.", how it maps)
_MASTER = ("optimizer.state.fp32_param.", "optimizer.state.param.")  # the fp32 value, if any
_MOMENTS = {"exp_avg": "optimizer.state.exp_avg.", "exp_avg_sq": "optimizer.state.exp_avg_sq."}


def _check_backend(folder: str) -> None:
    path = os.path.join(folder, "metadata.json")
    if not os.path.isfile(path):
        raise NotACheckpointError(
            f"{folder}: no metadata.json; not a Megatron-Core dist_checkpointing folder"
        )
    if os.path.islink(path):
        raise MegatronFormatError(
            f"{path}: is a symbolic link; a checkpoint's files must be its own"
        )
    meta = read_json_file(
        path, 'metadata.json (Megatron writes ~100 bytes: {"sharded_backend": "torch_dist"})',
        max_bytes=MAX_METADATA_BYTES, expect=dict, error=MegatronFormatError,
    )  # fmt: skip
    backend = meta.get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronFormatError(
            f"{path}: sharded_backend is {backend!r}; this importer reads 'torch_dist' "
            "checkpoints (convert zarr ones with Megatron's own tools first)"
        )


def infer_config(
    shapes: dict[str, tuple[int, ...]],
    heads: int,
    vocab_size: int | None,
    norm_eps: float,
    rope_theta: float,
    where: str,
) -> LlamaConfig:
    """The Llama-family config of a Megatron GPT from its tensor shapes and its head count."""
    missing = [k for k, (_, how) in TENSORS.items() if how != "same" and k not in shapes]
    if missing:
        raise MegatronFormatError(
            f"{where}: no tensor {missing[0]!r}; expected a Megatron GPTModel with untied "
            "embeddings, a SwiGLU MLP and no biases (a Llama-like model)"
        )
    vp, d = shapes["embedding.word_embeddings.weight"]
    layers, rows, _ = shapes[LAYERS + "self_attention.linear_qkv.weight"]
    proj_in = shapes[LAYERS + "self_attention.linear_proj.weight"][2]
    ff2 = shapes[LAYERS + "mlp.linear_fc1.weight"][1]
    if proj_in % heads:
        raise MegatronFormatError(f"{where}: heads={heads} does not divide {proj_in}")
    hd = proj_in // heads
    groups, rem = divmod(rows - proj_in, 2 * hd)
    if rem or groups <= 0 or heads % groups:
        raise MegatronFormatError(
            f"{where}: linear_qkv has {rows} rows, which no number of query groups gives with "
            f"heads={heads} of width {hd}; pass the model's number of attention heads"
        )
    v = vp if vocab_size is None else int(vocab_size)
    if not 0 < v <= vp:
        raise MegatronFormatError(f"{where}: vocab_size={v} exceeds the stored (padded) {vp}")
    return LlamaConfig(
        model_type="llama", vocab_size=v, d_model=d, n_heads=heads, n_kv_heads=groups,
        head_dim=hd, n_layers=layers, d_ff=ff2 // 2, norm_eps=norm_eps, rope_theta=rope_theta,
        tie_embeddings=False, vocab_multiple=1,
    )  # fmt: skip


def layer_maps(cfg: LlamaConfig) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """How each kind of tensor becomes the atom (one layer's slice for stacked tensors)."""
    g, hd, v = cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    qpg = cfg.n_heads // g

    def qkv(w: torch.Tensor) -> torch.Tensor:
        per = w.reshape(g, qpg + 2, hd, w.shape[-1])
        q = per[:, :qpg].reshape(g * qpg * hd, -1)
        k = per[:, qpg].reshape(g * hd, -1)
        vv = per[:, qpg + 1].reshape(g * hd, -1)
        return torch.cat([q, k, vv], 0).T

    return {
        "same": lambda w: w,
        "t": lambda w: w.T,
        "vocab": lambda w: w[:v],
        "vocab_t": lambda w: w[:v].T,
        "qkv": qkv,
        "glu": lambda w: w.T,  # [all gate; all up] rows = [gate | up] columns
    }


def write_rows(w: AtomWriter, name: str, slot: str, m: torch.Tensor) -> None:
    """Write `m` (often a transposed view) into a slot in whole-shard row blocks: one block is
    copied contiguous at a time, so memory holds the source and one shard, not a second copy."""
    w.array(name, slot, to_numpy(torch.empty((), dtype=m.dtype)).dtype)
    shape = tuple(m.shape)
    fb = w.flat_block(name, slot)
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    step = max(1, fb // inner) if fb and len(shape) > 1 else max(1, shape[0] if shape else 1)
    for r0 in range(0, shape[0] if shape else 1, step):
        block = (m[r0 : r0 + step] if shape else m).contiguous()
        box = ((r0, r0 + block.shape[0]), *((0, d) for d in shape[1:])) if shape else ()
        w.write(name, slot, box, to_numpy(block), keep=block)


def fused_of(cfg: LlamaConfig, how: str) -> list[FusedMark]:
    if how == "qkv":
        return [FusedMark(cfg.qkv_sizes, 1)]
    if how == "glu":
        return [FusedMark((cfg.d_ff, cfg.d_ff), 1)]
    return []


def _heads_from(objects: dict[str, Any]) -> int | None:
    args = (objects.get("common_state") or {}).get("args") if isinstance(
        objects.get("common_state"), dict) else None  # fmt: skip
    n = getattr(args, "num_attention_heads", None)
    return n if isinstance(n, int) else None


def _step_of(common: Any) -> int | None:
    if not isinstance(common, dict):
        return None
    it = common.get("iteration")
    return int(it) if isinstance(it, int) else None


@ucp_errors(MegatronFormatError, "import_megatron")
def import_megatron(
    src: Any,
    dst: Any,
    *,
    heads: int | None = None,
    vocab_size: int | None = None,
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
    overwrite: bool = False,
    step: int | None = None,
) -> str:
    """Import a Megatron-Core torch_dist checkpoint of a Llama-like GPT as ``models.llama`` atoms.

    Args:
        src: the checkpoint folder (``.metadata``, ``__<rank>_0.distcp``, ``metadata.json``).
        dst: where to write the universal checkpoint.
        heads: the number of attention heads (default: Megatron-LM's ``args`` in the common state).
        vocab_size: the true vocabulary size; the rows beyond it are TP padding (default: keep all).
        norm_eps: the RMSNorm epsilon (``layernorm_epsilon``), recorded in the model config.
        rope_theta: the RoPE base (``rotary_base``), recorded in the model config.
        overwrite: replace an existing checkpoint at ``dst``.
        step: the step to record (default: the common state's ``iteration``).

    Returns:
        The location of the written checkpoint; its manifest's ``extra["hf_config"]`` is the
        model config (``ucp_jax.models.llama.config_from_checkpoint``).

    Raises:
        NotACheckpointError: no ``.metadata`` / ``metadata.json``.
        MegatronFormatError: another backend, model or layout than this importer reads.
        UnsafePickleError: a pickle in it names a global outside the allow-list.

    >>> ucp.torch.import_megatron("ckpt/iter_0000002", "/tmp/ucp/gpt", heads=4)  # doctest: +SKIP
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .buckets import bucket_tensors

    folder = os.fspath(src)
    _check_backend(folder)
    md = read_metadata(folder)
    entries = md.state_dict_metadata
    shapes = {
        k: tuple(int(d) for d in v.size)
        for k, v in entries.items()
        if isinstance(v, TensorStorageMetadata)
    }
    objects = read_objects(folder, md)
    common = objects.get("common_state")
    heads = heads or _heads_from(objects)
    if heads is None:
        raise MegatronFormatError(
            f"{folder}: the number of attention heads is not recorded in the checkpoint; pass "
            "heads= (--heads)"
        )
    cfg = infer_config(shapes, heads, vocab_size, norm_eps, rope_theta, folder)
    extra_tensors = [k for k in shapes if not k.startswith("optimizer.") and k not in TENSORS]
    if extra_tensors:
        raise MegatronFormatError(
            f"{folder}: tensor {extra_tensors[0]!r} is not part of a Llama-like GPT (untied "
            "embeddings, RMSNorm, SwiGLU, no biases, no MoE); this importer does not map it"
        )
    flat = bucket_tensors(folder, md, objects, shapes)  # dp_reshardable, or {}
    maps = layer_maps(cfg)

    def tensor(key: str, slot: str) -> torch.Tensor | None:
        if (key, slot) in flat:
            return flat[(key, slot)]
        if slot == "fp32":
            fqn = next((p + key for p in _MASTER if p + key in shapes), key)
        else:
            fqn = _MOMENTS[slot] + key
        return read_tensor(folder, md, fqn, MegatronFormatError) if fqn in shapes else None

    with AtomWriter(dst, overwrite=overwrite) as w:
        for key, (atom, how) in TENSORS.items():
            if key not in shapes:
                continue
            for slot in ("fp32", *_MOMENTS):
                t = tensor(key, slot)
                if t is None:
                    continue
                stacked = key.startswith(LAYERS)
                parts = [(f"blocks.{i}.{atom}", t[i]) for i in range(t.shape[0])] if stacked else [
                    (atom, t)]  # fmt: skip
                for name, part in parts:
                    m = maps[how](part)  # a view, but for qkv's regrouping
                    w.atom(name, m.shape, fused=fused_of(cfg, how))
                    write_rows(w, name, slot, m)
                del t, parts
            w.release_sources()
        if step is None:
            step = _step_of(common)
        info: dict[str, Any] = {"path": os.path.abspath(folder), "heads": heads,
                                "padded_vocab": shapes["embedding.word_embeddings.weight"][0],
                                "common": jsonable(common) if common is not None else None}  # fmt: skip
        try:
            json.dumps(info)
        except (TypeError, ValueError):
            info["common"] = repr(common)[:2000]
        source = {"framework": "megatron-core", "megatron": info}
        return w.commit(step=step, source=source, extra={"hf_config": cfg.to_hf()})


__all__ = ["MegatronFormatError", "import_megatron", "infer_config", "read_objects", "read_tensor"]
