"""Megatron-Core `torch_dist` checkpoints -> atoms of ``ucp_jax.models.llama`` (any TP / PP / EP / DP).

Megatron-Core's ``dist_checkpointing.save`` writes a torch.distributed.checkpoint folder
(`.metadata`, one ``__<rank>_0.distcp`` per rank, ``metadata.json``); the common state (iteration,
optimizer hyperparameters, Megatron-LM's ``args``) is a pickled bytes entry ``common_state/...``
inside it (0.19), or ``common.pt`` next to it (older releases). Every tensor is stored in its
*global* shape: TP shards, pipeline stages and expert-parallel ranks are chunks of it. This
importer reads those chunks with the restricted unpickler of the DCP importer (Megatron is not
needed) and turns Megatron's tensors into the model's tensors, the atoms the Hugging Face importer
writes too:

- layers are stacked on a leading axis ``[L, ...]``: one atom per layer (``blocks.{i}...``);
  SequentialMLP experts ``[L, E, ...]``: one atom per layer and expert
  (``blocks.{i}.experts.{e}.gate_up.kernel``), the JAX MoE model's expert axis;
- ``linear_qkv.weight`` (and its bias) holds, per query group, the group's query heads then its
  key and value head: split into ``[q | k | v]`` columns (a fused atom, as ``q_proj``/``k_proj``/
  ``v_proj``);
- ``linear_fc1.weight`` of a SwiGLU MLP is ``[all gate; all up]``: the ``[gate | up]`` fused atom;
  a GELU MLP's is ``mlp.up.kernel``;
- the norms that ride on the linears (``linear_qkv.layer_norm_weight``) are the block's norms;
- the vocabulary padding rows of the embedding and output layer are dropped (``vocab_size``);
- torch's ``[out, in]`` weights become ``[in, out]`` kernels.

The model's shape comes from :mod:`.config` (the tensors, and Megatron-LM's ``args`` where the
checkpoint has them). Optimizer state (Adam): ``[chained_<n>.]optimizer.state.{exp_avg,exp_avg_sq}
.<param>`` (Megatron's plain optimizer; with bf16 also ``fp32_param``, the fp32 master; a MoE
model's ``ChainedOptimizer`` keeps the experts' in ``chained_1``), or the distributed optimizer's
``fully_reshardable`` ``optimizer.state.{param,exp_avg,exp_avg_sq}.<param>``, or its
``dp_reshardable`` flat per-bucket buffers (dense models; see :mod:`.buckets`). The fp32 master,
where there is one, is the atom's value (slot ``fp32``); the moments are slots ``exp_avg`` /
``exp_avg_sq``.

>>> ucp.torch.import_megatron("ckpt/iter_0000100", "/tmp/ucp/gpt", heads=32)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import re
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
    per_row_chunks,
    read_metadata,
    read_objects,
    read_tensor,
)
from ..common.writer import AtomWriter, write_rows
from .common import (
    BACKEND_FILE,
    EXPERTS,
    LAYERS,
    MASTER_FIELDS,
    MAX_METADATA_BYTES,
    MOMENTS,
    OPT_RE,
    TENSORS,
    MegatronFormatError,
    atom_of,
    param_groups,
)
from .config import infer_config, megatron_args
from .tracker import iteration_folder

_CHAINED_BUCKETS = re.compile(r"^chained_\d+\.optimizer\.distributed\.")


def _check_backend(folder: str) -> None:
    path = os.path.join(folder, BACKEND_FILE)
    if not os.path.isfile(path):
        hint = ""
        if os.path.isfile(os.path.join(folder, ".metadata")):
            hint = " (a plain torch.distributed.checkpoint folder: `ucp convert dcp` reads it)"
        raise NotACheckpointError(
            f"{folder}: no metadata.json; not a Megatron-Core dist_checkpointing folder{hint}"
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


def layer_maps(cfg: LlamaConfig) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """How each kind of tensor becomes the atom (one layer's slice for stacked tensors)."""
    g, hd, v = cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    qpg = cfg.n_heads // g

    def qkv(w: torch.Tensor) -> torch.Tensor:
        per = w.reshape(g, qpg + 2, hd, -1)
        q = per[:, :qpg].reshape(g * qpg * hd, -1)
        k = per[:, qpg].reshape(g * hd, -1)
        vv = per[:, qpg + 1].reshape(g * hd, -1)
        out = torch.cat([q, k, vv], 0)
        return out.T if w.dim() == 2 else out.reshape(-1)

    return {
        "same": lambda w: w,
        "t": lambda w: w.T,
        "vocab": lambda w: w[:v],
        "vocab_t": lambda w: w[:v].T,
        "qkv": qkv,
    }


def fused_of(cfg: LlamaConfig, atom: str) -> list[FusedMark]:
    """The fusion an atom (without ``blocks.{i}.``) records: q/k/v, or SwiGLU's gate and up."""
    rest = atom.rsplit(".", 2)[-2:]
    if rest[0] == "qkv":
        return [FusedMark(cfg.qkv_sizes, 1 if rest[1] == "kernel" else 0)]
    if rest[0] == "gate_up":
        return [FusedMark((cfg.d_ff, cfg.d_ff), 1 if rest[1] == "kernel" else 0)]
    return []


def optimizer_tensors(shapes: dict[str, Any], where: str) -> dict[tuple[str, str], str]:
    """(model tensor, slot) -> the optimizer tensor holding it (slots fp32, exp_avg, exp_avg_sq)."""
    out: dict[tuple[str, str], str] = {}
    for fqn in shapes:
        if _CHAINED_BUCKETS.match(fqn):
            raise MegatronFormatError(
                f"{where}: {fqn!r} is the distributed optimizer's dp_reshardable layout of a "
                "ChainedOptimizer (a MoE model); only its fully_reshardable layout is read "
                "(distrib_optim_sharding_type)"
            )
        m = OPT_RE.match(fqn)
        if m is None:
            continue
        if m["key"] not in TENSORS:
            raise MegatronFormatError(
                f"{where}: optimizer tensor {fqn!r} is the state of {m['key']!r}, which is not a "
                "tensor of the GPT models this importer maps"
            )
        slot = "fp32" if m["field"] in MASTER_FIELDS else m["field"]
        if slot != "fp32" or m["field"] == MASTER_FIELDS[0] or (m["key"], slot) not in out:
            out[(m["key"], slot)] = fqn
    return out


def check_master(
    master: torch.Tensor, weight: torch.Tensor, key: str, lead: int | None, where: str
) -> None:
    """Refuse an optimizer's fp32 master that does not give the model's weight saved beside it.

    Megatron copies the master into the weight after every step (a cast for bf16/fp16), so the two
    agree in every checkpoint it writes correctly. megatron-core 0.19.2's distributed optimizer
    with several gradient buckets (`overlap_grad_reduce`) saves each later bucket's window shifted,
    in its `fully_reshardable` layout too: the masters and moments there are other parameters'.
    """
    cast = master.to(weight.dtype)
    same = (cast == weight) | (cast.isnan() & weight.isnan())
    if bool(same.all()):
        return
    bad = int(same.numel() - int(same.sum()))
    at = f"{key}[{lead}]" if lead is not None else key
    raise MegatronFormatError(
        f"{where}: the optimizer's fp32 master of {at!r} does not match the model weight saved "
        f"beside it ({bad} of {same.numel()} elements differ, cast to {weight.dtype}); Megatron "
        "keeps them equal, so this checkpoint's optimizer state is not that of its weights. "
        "megatron-core's distributed optimizer saves shifted state with several gradient buckets "
        "(overlap_grad_reduce); weights saved before the parameter all-gather "
        "(overlap_param_gather without Megatron-LM's force_param_sync) are stale. Resave with "
        "one bucket per buffer (a bucket_size above the model's size), or import the weights "
        "alone from a copy without the optimizer state"
    )


def _step_of(common: Any) -> int | None:
    if not isinstance(common, dict):
        return None
    it = common.get("iteration")
    return int(it) if isinstance(it, int) else None


def _parts(
    key: str, atom: str, t: torch.Tensor, lead: int | None
) -> list[tuple[str, torch.Tensor]]:
    """(atom name, tensor) of each layer (and expert) of a stacked Megatron tensor: all of them,
    or those of layer `lead` when `t` is that layer's slice."""
    if not key.startswith(LAYERS):
        return [(atom, t)]
    layers = [(lead, t)] if lead is not None else [(i, t[i]) for i in range(t.shape[0])]
    if key.startswith(EXPERTS):
        return [(f"blocks.{i}." + atom.replace("{e}", str(e)), x[e])
                for i, x in layers for e in range(x.shape[0])]  # fmt: skip
    return [(f"blocks.{i}.{atom}", x) for i, x in layers]


@ucp_errors(MegatronFormatError, "import_megatron")
def import_megatron(
    src: Any,
    dst: Any,
    *,
    heads: int | None = None,
    vocab_size: int | None = None,
    norm_eps: float | None = None,
    rope_theta: float | None = None,
    top_k: int | None = None,
    activation: str | None = None,
    overwrite: bool = False,
    step: int | None = None,
) -> str:
    """Import a Megatron-Core torch_dist checkpoint of a GPTModel as ``models.llama`` atoms.

    Llama-like models (SwiGLU, RMSNorm, RoPE, no biases), GPT-style ones (GELU MLP, LayerNorm,
    biases, learned positions, tied embeddings) and mixture-of-experts ones (SequentialMLP
    experts, any expert parallelism). What the checkpoint records (the tensors' shapes, and
    Megatron-LM's ``args`` when its common state has them) sets the model; the arguments below
    are asked for only where it records nothing.

    Args:
        src: the checkpoint folder (``.metadata``, ``__<rank>_0.distcp``, ``metadata.json``),
            or Megatron-LM's save folder (the iteration its ``latest_checkpointed_iteration.txt``
            names is read).
        dst: where to write the universal checkpoint.
        heads: the number of attention heads (default: Megatron-LM's ``args`` in the common state;
            no tensor shape records it).
        vocab_size: the true vocabulary size; the rows beyond it are TP padding (default: keep all).
        norm_eps: the norm epsilon (default: ``args.norm_epsilon``, else 1e-5).
        rope_theta: the RoPE base (default: ``args.rotary_base``, else 10000).
        top_k: experts per token of a MoE model (default: ``args.moe_router_topk``).
        activation: the MLP's activation (default: SiLU for a gated MLP, else GELU; ``args``).
        overwrite: replace an existing checkpoint at ``dst``.
        step: the step to record (default: the common state's ``iteration``).

    Returns:
        The location of the written checkpoint; its manifest's ``extra["hf_config"]`` is the
        model config (``ucp_jax.models.llama.config_from_checkpoint``).

    Raises:
        NotACheckpointError: no ``.metadata`` / ``metadata.json``.
        MegatronFormatError: another backend, model or layout than this importer reads, or a
            shape nothing records (names the argument to pass).
        UnsafePickleError: a pickle in it names a global outside the allow-list.

    >>> ucp.torch.import_megatron("ckpt/iter_0000002", "/tmp/ucp/gpt", heads=4)  # doctest: +SKIP
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .buckets import bucket_tensors

    folder = iteration_folder(os.fspath(src))  # Megatron-LM's save folder: its tracker's
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
    args = megatron_args(objects)
    model = [k for k in shapes if not (k.startswith("optimizer.") or OPT_RE.match(k)
                                       or _CHAINED_BUCKETS.match(k))]  # fmt: skip
    unknown = [k for k in model if k not in TENSORS]
    if unknown:
        hint = " (grouped-GEMM experts are not read: SequentialMLP only)" if ".experts." in unknown[
            0] else ""  # fmt: skip
        raise MegatronFormatError(
            f"{folder}: tensor {unknown[0]!r} is not part of the GPT models this importer maps "
            f"(dense or SequentialMLP experts; no qk-norm, no shared experts){hint}"
        )
    cfg = infer_config(shapes, args, folder, heads=heads, vocab_size=vocab_size,
                       norm_eps=norm_eps, rope_theta=rope_theta, top_k=top_k,
                       activation=activation)  # fmt: skip
    opt = optimizer_tensors(shapes, folder)
    flat = bucket_tensors(folder, md, objects, shapes, cfg)  # dp_reshardable, or {}
    maps = layer_maps(cfg)

    def tensor(key: str, slot: str, lead: int | None) -> torch.Tensor | None:
        if (key, slot) in flat:
            t = flat[(key, slot)] if lead is None else flat[(key, slot)][lead]
        else:
            fqn = opt.get((key, slot), key if slot == "fp32" else None)
            if fqn is None:
                return None
            t = read_tensor(folder, md, fqn, MegatronFormatError, lead)
            if fqn == key:
                return t
        if slot == "fp32" and key in shapes:  # an optimizer's master: the model weight agrees
            check_master(t, read_tensor(folder, md, key, MegatronFormatError, lead), key, lead,
                         folder)  # fmt: skip
        return t

    with AtomWriter(dst, overwrite=overwrite) as w:
        for key, (_, how) in TENSORS.items():
            if key not in shapes:
                continue
            atom = atom_of(key, cfg)
            # a stacked tensor saved one layer per chunk (as Megatron saves) is read layer by
            # layer: memory ~ one layer's tensor, not all layers' (experts: all of one layer's)
            by_layer = key.startswith(LAYERS) and per_row_chunks(md, key)
            for slot in ("fp32", *MOMENTS):
                for lead in range(shapes[key][0]) if by_layer else [None]:
                    t = tensor(key, slot, lead)
                    if t is None:
                        continue
                    for name, part in _parts(key, atom, t, lead):
                        m = maps[how](part)  # a view, but for qkv's regrouping
                        w.atom(name, m.shape, fused=fused_of(cfg, name))
                        write_rows(w, name, slot, m)
                    del t
                w.release_sources()
        if step is None:
            step = _step_of(common)
        info: dict[str, Any] = {"path": os.path.abspath(folder), "heads": cfg.n_heads,
                                "padded_vocab": shapes["embedding.word_embeddings.weight"][0],
                                "common": jsonable(common) if common is not None else None,
                                "param_groups": jsonable(param_groups(common, objects))}  # fmt: skip
        try:
            json.dumps(info)
        except (TypeError, ValueError):
            info["common"] = repr(common)[:2000]
        source = {"framework": "megatron-core", "megatron": info}
        return w.commit(step=step, source=source, extra={"hf_config": cfg.to_hf()})


__all__ = [
    "MegatronFormatError",
    "import_megatron",
    "optimizer_tensors",
    "read_objects",
    "read_tensor",
]
