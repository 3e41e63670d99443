"""Universal ``models.llama`` atoms -> a Megatron-Core torch_dist checkpoint (any TP / PP on load).

The inverse of :mod:`.megatron`: every tensor is written in its global shape, as Megatron's
``dist_checkpointing`` stores it (stacked layers ``[L, ...]``, per-group ``[q..., k, v]`` rows,
``[all gate; all up]`` SwiGLU rows, the vocabulary padded with zero rows), so Megatron-Core's
``dist_checkpointing.load`` reshards it to whatever TP / PP the loading job runs. The optimizer
state is written in the layout of Megatron's non-distributed optimizer
(``optimizer.state.{exp_avg,exp_avg_sq}.<param>``, plus ``fp32_param`` when the model is bf16),
the common state (iteration, the optimizer's step and parameter groups) as the pickled
``common_state`` entry of 0.19, and ``metadata.json``. Torch DCP writes the files (one process).

>>> ucp.torch.export_megatron("/tmp/ucp/gpt", "ckpt/iter_0000002")  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import numpy as np
import torch

from ...checkpoint import Checkpoint
from ...errors import UcpError
from ...format import space
from ...llama_config import LlamaConfig, config_from_checkpoint
from .common import LAYERS, TENSORS

_EXTRA = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
          "mlp.linear_fc2")  # fmt: skip
_NAMES = [
    k for k in TENSORS if not k.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight"))
]


class MegatronExportError(UcpError, ValueError):
    """The checkpoint cannot be written as a Megatron-Core GPT (not a dense Llama-like model)."""


def _inverse(cfg: LlamaConfig, how: str, a: np.ndarray, padded: int) -> np.ndarray:
    """One atom (one layer's for stacked tensors) -> Megatron's tensor."""
    if how == "same":
        return a
    if how in ("t", "glu"):
        return a.T
    if how in ("vocab", "vocab_t"):
        w = a if how == "vocab" else a.T
        out = np.zeros((padded, *w.shape[1:]), w.dtype)
        out[: w.shape[0]] = w
        return out
    g, hd, qpg = cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    w = a.T  # [q + k + v, d]
    nq = cfg.n_heads * hd
    q = w[:nq].reshape(g, qpg, hd, -1)
    k = w[nq : nq + g * hd].reshape(g, 1, hd, -1)
    v = w[nq + g * hd :].reshape(g, 1, hd, -1)
    return np.concatenate([q, k, v], 1).reshape(g * (qpg + 2) * hd, -1)


def _param_groups(ck: Checkpoint, lr: float, weight_decay: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: the Megatron source's, if it was one; else Adam defaults
    for Megatron's two groups (with and without weight decay)."""
    common = (ck.manifest.source.get("megatron") or {}).get("common")
    opt = common.get("optimizer") if isinstance(common, dict) else None
    if isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict):  # mixed precision
        opt = opt["optimizer"]
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
        out = copy.deepcopy(groups)
        for g in out:
            if isinstance(g.get("betas"), list):
                g["betas"] = tuple(g["betas"])
            g.pop("step", None)
        return out
    base = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": lr, "min_lr": None, "lr": lr,
            "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay, "amsgrad": False,
            "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": None, "decoupled_weight_decay": True}  # fmt: skip
    return [base | {"wd_mult": 1.0}, base | {"wd_mult": 0.0}]


def _obj(obj: Any) -> list[Any]:
    """A ShardedObject's stored value: the list of its shards' data (DCP torch.saves it)."""
    return [obj]


def export_megatron(
    src: Any,
    dst: Any,
    *,
    dtype: str = "fp32",
    padded_vocab: int | None = None,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    overwrite: bool = False,
) -> str:
    """Write a universal checkpoint of ``ucp_jax.models.llama`` as a Megatron-Core torch_dist folder.

    Args:
        src: the universal checkpoint (with the model config, as import_megatron / import_hf /
            ``ucp.save(extra=llama.ucp_extra(cfg))`` record it).
        dst: the folder to write (Megatron's ``iter_XXXXXXX``).
        dtype: the model's parameter dtype, ``"fp32"`` or ``"bf16"`` (then with fp32 masters).
        padded_vocab: the vocabulary Megatron's model holds (default: the source's padded size if
            it came from Megatron, else a multiple of 128).
        lr, weight_decay: the optimizer groups' values when the source records none.
        overwrite: replace ``dst``.

    Returns:
        ``dst``.

    Raises:
        MegatronExportError: not a dense Llama-like model, or an unknown dtype.
        FileExistsError: ``dst`` exists and ``overwrite`` is not set.

    >>> ucp.torch.export_megatron("/tmp/ucp/gpt", "ckpt/iter_0000002")  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    if dtype not in ("fp32", "bf16"):
        raise MegatronExportError(f"export_megatron: dtype={dtype!r}; expected 'fp32' or 'bf16'")
    ck = Checkpoint(src)
    cfg = config_from_checkpoint(ck)
    if cfg.n_experts or cfg.qkv_bias or cfg.tie_embeddings or cfg.sliding_window:
        raise MegatronExportError(
            f"{ck.path}: the model has experts, q/k/v biases, tied embeddings or a sliding window; "
            "export_megatron writes dense Llama-like GPTs only"
        )
    meg = ck.manifest.source.get("megatron") or {}
    vp = padded_vocab or meg.get("padded_vocab") or -(-cfg.vocab_size // 128) * 128
    dst = os.fspath(dst)
    if os.path.exists(dst) and not overwrite:
        raise FileExistsError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
    total = sum(a.nbytes for a in ck.atoms.values())  # the whole state dict is built in memory
    space.require_memory(2 * total, f"{dst}: the export", space.EXPORT_FIX)
    step = ck.step or 0
    model_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    sd: dict[str, Any] = {}
    for key in _NAMES:
        atom, how = TENSORS[key]
        names = (
            [f"blocks.{i}.{atom}" for i in range(cfg.n_layers)]
            if key.startswith(LAYERS)
            else [atom]
        )
        if names[0] not in ck.atoms:
            raise MegatronExportError(f"{ck.path}: no atom {names[0]!r} (a Llama-family model)")
        slots = ck.atoms[names[0]].slots
        for slot, prefix in (("fp32", ""), ("exp_avg", "optimizer.state.exp_avg."),
                             ("exp_avg_sq", "optimizer.state.exp_avg_sq.")):  # fmt: skip
            if slot not in slots:
                if slot == "fp32":
                    raise MegatronExportError(f"{ck.path}: atom {names[0]!r} has no weights")
                continue
            parts = [_inverse(cfg, how, ck.read(n, slot).astype(np.float32), vp) for n in names]
            t = torch.from_numpy(np.stack(parts) if key.startswith(LAYERS) else parts[0])
            if slot == "fp32":
                sd[key] = t.to(model_dtype)
                if dtype == "bf16":
                    sd["optimizer.state.fp32_param." + key] = t
            else:
                sd[prefix + key] = t
    for i in range(cfg.n_layers):
        for m in _EXTRA:
            sd[f"{LAYERS}{m}._extra_state/shard_{i}_{cfg.n_layers}"] = _obj(None)
    optim = {"state": {"common_step": torch.tensor(float(step))},
             "param_groups": _param_groups(ck, lr, weight_decay)}  # fmt: skip
    # Megatron's bf16 (mixed-precision) optimizer nests torch's state dict one level deeper
    common = {"optimizer": {"optimizer": optim} if dtype == "bf16" else optim, "iteration": step}
    sd["common_state/shard_0_1"] = _obj(common)
    with space.folder_in_place(dst, "the export") as tmp:  # an old dst goes at the end
        dcp.save(
            sd,
            storage_writer=dcp.FileSystemWriter(tmp),
            no_dist=True,
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        )
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    return dst


__all__ = ["MegatronExportError", "export_megatron"]
