"""Universal ``models.llama`` atoms -> a Megatron-Core torch_dist checkpoint (any TP / PP / EP on load).

The inverse of :mod:`.read`: every tensor is written in its global shape, as Megatron's
``dist_checkpointing`` stores it (stacked layers ``[L, ...]``, SequentialMLP experts ``[L, E, ...]``,
per-group ``[q..., k, v]`` rows, ``[all gate; all up]`` SwiGLU rows, the vocabulary padded with
zero rows), so Megatron-Core's ``dist_checkpointing.load`` reshards it to whatever TP / PP / EP the
loading job runs. Llama-like, GPT-style (LayerNorm, GELU, biases, learned positions, tied
embeddings) and mixture-of-experts models. The optimizer state is written in the layout of
Megatron's non-distributed optimizer (``optimizer.state.{exp_avg,exp_avg_sq}.<param>``, plus
``fp32_param`` when the model is bf16) or, with ``optimizer="distributed"``, of the distributed
optimizer's ``fully_reshardable`` format (``optimizer.state.{param,exp_avg,exp_avg_sq}``). A MoE
job with expert parallelism runs a ``ChainedOptimizer`` that keeps the experts' state in
``chained_1.`` and the rest in ``chained_0.``; without it (EP=1), one optimizer holds all, so the
layout follows the loading job's expert-parallel size (``expert_parallel``): Megatron itself
cannot load its EP>1 checkpoints' optimizer state at EP=1. The common state (iteration, the optimizers' step and parameter groups) is the
pickled ``common_state`` entry of 0.19, next to ``metadata.json``. Torch DCP writes the files
(one process).

>>> ucp.torch.export_megatron("/tmp/ucp/gpt", "ckpt/iter_0000002")  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from typing import Any

import numpy as np
import torch

from ...checkpoint import Checkpoint
from ...errors import DestinationExistsError, UcpError
from ...format import space
from ...hf_config import config_from_checkpoint
from ...llama_config import LlamaConfig
from ..common.destination import local_destination, not_over_source
from .common import BACKEND_FILE, EXPERTS, LAYERS, TENSORS, atom_of, model_keys
from .tracker import write_tracker

log = logging.getLogger("ucp_jax")

_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
            "mlp.linear_fc2")  # fmt: skip
OPTIMIZERS = ("plain", "distributed")


class MegatronExportError(UcpError, ValueError):
    """The checkpoint cannot be written as a Megatron-Core GPTModel."""


def _inverse(cfg: LlamaConfig, how: str, a: np.ndarray, padded: int) -> np.ndarray:
    """One atom (one layer's, or one expert's, for stacked tensors) -> Megatron's tensor."""
    if how == "same":
        return a
    if how == "t":
        return a.T
    if how in ("vocab", "vocab_t"):
        w = a if how == "vocab" else a.T
        out = np.zeros((padded, *w.shape[1:]), w.dtype)
        out[: w.shape[0]] = w
        return out
    g, hd, qpg = cfg.n_kv_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    w = a.T if a.ndim == 2 else a[:, None]  # [q + k + v, d]
    nq = cfg.n_heads * hd
    q = w[:nq].reshape(g, qpg, hd, -1)
    k = w[nq : nq + g * hd].reshape(g, 1, hd, -1)
    v = w[nq + g * hd :].reshape(g, 1, hd, -1)
    out = np.concatenate([q, k, v], 1).reshape(g * (qpg + 2) * hd, -1)
    return out if a.ndim == 2 else out[:, 0]


def _source_chained(ck: Checkpoint) -> bool | None:
    """Whether the Megatron source saved a ChainedOptimizer (None: not from Megatron)."""
    common = (ck.manifest.source.get("megatron") or {}).get("common")
    opt = common.get("optimizer") if isinstance(common, dict) else None
    return isinstance(opt, dict) and "0" in opt if isinstance(opt, dict) else None


def _source_groups(ck: Checkpoint) -> list[dict[str, Any]]:
    """The parameter groups the Megatron source recorded (every optimizer of a chain), or []."""
    groups = (ck.manifest.source.get("megatron") or {}).get("param_groups")
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []


ADAM_DEFAULTS = {"lr": 1e-4, "min_lr": None, "weight_decay": 0.0, "betas": (0.9, 0.999),
                 "eps": 1e-8}  # fmt: skip


def _recorded_hyperparameters(ck: Checkpoint) -> dict[str, Any]:
    """The optimizer hyperparameters another trainer recorded (torchtitan's param groups: its
    first), by ADAM_DEFAULTS' names; {} when none are recorded."""
    extra = ck.manifest.extra if isinstance(ck.manifest.extra, dict) else {}
    groups = (extra.get("torchtitan") or {}).get("param_groups")
    first = (
        next((g for g in groups if isinstance(g, dict)), None) if isinstance(groups, list) else None
    )
    out: dict[str, Any] = {}
    for k in ADAM_DEFAULTS:
        v = (first or {}).get(k)
        if k == "betas" and isinstance(v, list) and len(v) == 2:
            v = tuple(v)
        if isinstance(v, float | int | tuple) and not isinstance(v, bool):
            out[k] = v
    return out


def hyperparameters(ck: Checkpoint, given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The Adam hyperparameters of groups the export makes (a source that is not Megatron): each
    the one given, else the one the source recorded, else Adam's default; and the names of
    those left at the default."""
    recorded = _recorded_hyperparameters(ck)
    out = ADAM_DEFAULTS | recorded | {k: v for k, v in given.items() if v is not None}
    return out, [k for k in ADAM_DEFAULTS if k not in recorded and given.get(k) is None]


def _param_groups(
    ck: Checkpoint, cfg: LlamaConfig, expert: bool, given: dict[str, Any]
) -> list[dict[str, Any]]:
    """One optimizer's parameter groups (the experts' or the rest): the Megatron source's, if it
    was one, with the hyperparameters `given` (not None) put in; else Megatron's groups (with and
    without weight decay) with `hyperparameters`.

    Megatron's optimizer takes each group's betas, eps and weight decay from the checkpoint, and
    pairs a group with the job's by its ``max_lr``, ``min_lr``, ``wd_mult``, ...: they must be
    the loading job's."""
    groups = [g for g in _source_groups(ck) if bool(g.get("is_expert_parallel")) == expert]
    if groups:
        out = copy.deepcopy(groups)
        for g in out:
            if isinstance(g.get("betas"), list):
                g["betas"] = tuple(g["betas"])
            g.pop("step", None)
            for k, v in given.items():
                if v is None:
                    continue
                if k == "lr" and not g.get("is_decoupled_lr"):
                    g["lr"] = g["max_lr"] = v
                elif k != "lr":  # weight_decay as Megatron stores it: wd_mult applies at a step
                    g[k] = v
        return out
    h, _ = hyperparameters(ck, given)
    base = {"is_expert_parallel": expert, "default_config": True, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": h["lr"], "min_lr": h["min_lr"], "lr": h["lr"],
            "betas": tuple(h["betas"]), "eps": h["eps"], "weight_decay": h["weight_decay"],
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
            "differentiable": False, "fused": None, "decoupled_weight_decay": True}  # fmt: skip
    if expert and not cfg.linear_bias:  # SwiGLU experts: only weights, all with weight decay
        return [base | {"wd_mult": 1.0}]
    return [base | {"wd_mult": 1.0}, base | {"wd_mult": 0.0}]


def _check_hyperparameters(given: dict[str, Any]) -> None:
    """Each given hyperparameter is a finite number (betas: two in [0, 1))."""
    for k, v in given.items():
        if v is None:
            continue
        values = v if k == "betas" else (v,)
        ok = (isinstance(values, tuple | list) and len(values) == (2 if k == "betas" else 1)
              and all(isinstance(x, float | int) and not isinstance(x, bool) and math.isfinite(x)
                      and x >= 0 for x in values))  # fmt: skip
        if ok and k == "betas":
            ok = all(x < 1 for x in values)
        if not ok:
            raise MegatronExportError(
                f"export_megatron: {k}={v!r} (--{k.replace('_', '-')}); expected "
                + ("two numbers in [0, 1)" if k == "betas" else "a non-negative finite number")
            )


def _common_optimizer(groups: list[dict[str, Any]], step: int, dtype: str, optimizer: str
                      ) -> dict[str, Any]:  # fmt: skip
    """One optimizer's common state, as Megatron's state_dict nests it for its kind."""
    if optimizer == "distributed":
        return {"optimizer": {"param_groups": [g | {"step": float(step)} for g in groups]},
                "param_state_sharding_type": "fully_reshardable"}  # fmt: skip
    optim = {"state": {"common_step": torch.tensor(float(step))}, "param_groups": groups}
    # Megatron's bf16 (mixed-precision) optimizer nests torch's state dict one level deeper
    return {"optimizer": optim} if dtype == "bf16" else optim


def _obj(obj: Any) -> list[Any]:
    """A ShardedObject's stored value: the list of its shards' data (DCP torch.saves it)."""
    return [obj]


def _extra_states(cfg: LlamaConfig) -> dict[str, Any]:
    """The linears' ``_extra_state`` objects (None for the local spec), one per layer (and expert)."""
    n, e, out = cfg.n_layers, cfg.n_experts, {}
    for i in range(n):
        for m in _LINEARS[:2] if e else _LINEARS:
            out[f"{LAYERS}{m}._extra_state/shard_{i}_{n}"] = _obj(None)
        for j in range(e):
            for m in ("linear_fc1", "linear_fc2"):
                out[f"{EXPERTS}{m}._extra_state/shard_{i}.{j}_{n}.{e}"] = _obj(None)
    return out


def _tensor(ck: Checkpoint, cfg: LlamaConfig, key: str, slot: str, vp: int) -> np.ndarray | None:
    """Megatron's global tensor `key` from the atoms' `slot` (None if the atoms lack the slot)."""
    atom, how = atom_of(key, cfg), TENSORS[key][1]
    if key.startswith(EXPERTS):
        names: list[Any] = [[f"blocks.{i}." + atom.replace("{e}", str(e))
                             for e in range(cfg.n_experts)] for i in range(cfg.n_layers)]  # fmt: skip
    elif key.startswith(LAYERS):
        names = [f"blocks.{i}.{atom}" for i in range(cfg.n_layers)]
    else:
        names = [atom]
    first = names[0][0] if isinstance(names[0], list) else names[0]
    if first not in ck.atoms:
        raise MegatronExportError(
            f"{ck.path}: no atom {first!r}, which a {cfg.model_type} model's {key!r} needs"
        )
    if slot not in ck.atoms[first].slots:
        if slot == "fp32":
            raise MegatronExportError(f"{ck.path}: atom {first!r} has no weights")
        return None

    def one(name: str) -> np.ndarray:
        return _inverse(cfg, how, ck.read(name, slot).astype(np.float32), vp)

    if key.startswith(EXPERTS):
        return np.stack([np.stack([one(n) for n in row]) for row in names])
    if key.startswith(LAYERS):
        return np.stack([one(n) for n in names])
    return one(names[0])


def export_megatron(
    src: Any,
    dst: Any,
    *,
    dtype: str = "fp32",
    optimizer: str = "plain",
    expert_parallel: int | None = None,
    padded_vocab: int | None = None,
    lr: float | None = None,
    weight_decay: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
    min_lr: float | None = None,
    overwrite: bool = False,
) -> str:
    """Write a universal checkpoint of ``ucp_jax.models.llama`` as a Megatron-Core torch_dist folder.

    Args:
        src: the universal checkpoint (with the model config, as import_megatron / import_hf /
            ``ucp.save(extra=llama.ucp_extra(cfg))`` record it).
        dst: the folder to write. Named ``<save>/iter_XXXXXXX`` (7 digits), ``<save>``'s
            ``latest_checkpointed_iteration.txt`` is pointed at it, so Megatron-LM's
            ``--load <save>`` loads it; ``dist_checkpointing.load`` reads any folder.
        dtype: the model's parameter dtype, ``"fp32"`` or ``"bf16"`` (then with fp32 masters).
        optimizer: the layout of the optimizer state: ``"plain"`` (Megatron's non-distributed
            optimizer) or ``"distributed"`` (``use_distributed_optimizer`` with the
            ``fully_reshardable`` format); the loading job must use the same.
        expert_parallel: the expert-parallel size of the MoE job that loads it: above 1, the
            experts' optimizer state goes to the second optimizer of a ``ChainedOptimizer``
            (``chained_1.``); 1, one optimizer for all (default: as the Megatron source was saved,
            else 2). With ``expert_tensor_parallel_size`` other than the tensor-parallel size,
            Megatron chains the optimizers at EP=1 too: pass 2 then.
        padded_vocab: the vocabulary Megatron's model holds (default: the source's padded size if
            it came from Megatron, else a multiple of 128).
        lr: the loading job's learning rate (Megatron pairs saved parameter groups with the
            job's by it, ``max_lr``); default: the source's (Megatron's groups, torchtitan's),
            else 1e-4.
        weight_decay: the weight decay (default: the source's, else 0.0).
        betas: Adam's betas, which Megatron's optimizer takes from the checkpoint, not from the
            job (default: the source's, else (0.9, 0.999)).
        eps: Adam's epsilon, also taken from the checkpoint (default: the source's, else 1e-8).
        min_lr: the job's ``min_lr``, also part of a group's pairing key (default: the source's,
            else None, Megatron's default).
        overwrite: replace ``dst``.

    Returns:
        ``dst``.

    Raises:
        MegatronExportError: a model Megatron's GPTModel does not compute this way (a sliding
            window, RoPE scaling), an unknown dtype or optimizer layout, or a `padded_vocab`
            below the vocabulary.
        FileExistsError: ``dst`` exists and ``overwrite`` is not set.

    >>> ucp.torch.export_megatron("/tmp/ucp/gpt", "ckpt/iter_0000002")  # doctest: +SKIP
    """
    dst = local_destination(dst, "the Megatron checkpoint folder")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    if dtype not in ("fp32", "bf16"):
        raise MegatronExportError(f"export_megatron: dtype={dtype!r}; expected 'fp32' or 'bf16'")
    if optimizer not in OPTIMIZERS:
        raise MegatronExportError(
            f"export_megatron: optimizer={optimizer!r}; expected one of {list(OPTIMIZERS)}"
        )
    ck = Checkpoint(src)
    not_over_source(dst, ck.loc.local_path, "the Megatron checkpoint folder")
    cfg = config_from_checkpoint(ck)
    if cfg.sliding_window or cfg.rope_scaling:
        raise MegatronExportError(
            f"{ck.path}: the model has a sliding window or RoPE scaling, which Megatron's "
            "GPTModel layer specs written here do not compute; export_megatron refuses it"
        )
    meg = ck.manifest.source.get("megatron") or {}
    if padded_vocab is not None and not (isinstance(padded_vocab, int) and not isinstance(
            padded_vocab, bool) and padded_vocab >= cfg.vocab_size):  # fmt: skip
        raise MegatronExportError(
            f"export_megatron: padded_vocab={padded_vocab!r} (--padded-vocab); expected the "
            f"rows of Megatron's embedding: at least the vocabulary, {cfg.vocab_size} (the "
            "loading job's padded size: Megatron pads to a multiple of 128 x its TP size, which "
            "this export cannot know)"
        )
    vp = padded_vocab or meg.get("padded_vocab") or -(-cfg.vocab_size // 128) * 128
    dst = os.fspath(dst)
    if os.path.exists(dst) and not overwrite:
        raise DestinationExistsError(
            f"{dst} exists; pass overwrite=True (--overwrite) to replace it"
        )
    total = sum(a.nbytes for a in ck.atoms.values())  # the whole state dict is built in memory
    space.require_memory(2 * total, f"{dst}: the export", space.EXPORT_FIX)
    step = ck.step or 0
    model_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    master = "param" if optimizer == "distributed" else "fp32_param" if dtype == "bf16" else None
    moments = any("exp_avg" in a.slots for a in ck.atoms.values())
    if not moments:  # weights only (from Hugging Face, say): no optimizer state Megatron could load
        master = None
        log.warning("export_megatron %s: the checkpoint has no Adam moments; the export holds "
                    "the weights only: load it without the optimizer (Megatron-LM: --no-load-optim, "
                    "or --finetune)", ck.path)  # fmt: skip
    given = {"lr": lr, "min_lr": min_lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
    _check_hyperparameters(given)
    if moments and not _source_groups(ck):
        h, defaulted = hyperparameters(ck, given)
        if defaulted:
            log.warning("export_megatron %s: the source records no Megatron parameter groups; "
                        "Megatron's optimizer will load Adam's %s from this export and pair its "
                        "groups by lr: written %s. If the loading job's differ, pass them "
                        "(%s)", ck.path, "/".join(defaulted),
                        ", ".join(f"{k}={h[k]}" for k in defaulted),
                        ", ".join(f"--{k.replace('_', '-')}" for k in defaulted))  # fmt: skip
    chained = bool(cfg.n_experts) and (
        expert_parallel > 1 if expert_parallel else _source_chained(ck) in (True, None)
    )
    sd: dict[str, Any] = {}
    for key in model_keys(cfg):
        chain = ("chained_1." if key.startswith(EXPERTS) else "chained_0.") if chained else ""
        for slot in ("fp32", "exp_avg", "exp_avg_sq"):
            a = _tensor(ck, cfg, key, slot, vp)
            if a is None:
                continue
            t = torch.from_numpy(a)
            if slot != "fp32":
                sd[f"{chain}optimizer.state.{slot}.{key}"] = t
                continue
            sd[key] = t.to(model_dtype)
            if master:
                sd[f"{chain}optimizer.state.{master}.{key}"] = t
    sd |= _extra_states(cfg)
    if not moments:
        common: dict[str, Any] = {"iteration": step}
    elif chained:
        opts = [_common_optimizer(_param_groups(ck, cfg, e, given), step, dtype, optimizer)
                for e in (False, True)]  # fmt: skip
        common = {"optimizer": dict(enumerate(opts)), "iteration": step}
    else:
        groups = _param_groups(ck, cfg, False, given)
        common = {"optimizer": _common_optimizer(groups, step, dtype, optimizer), "iteration": step}
    common["checkpoint_version"] = 3.0  # Megatron-LM's: its mcore layout, nothing to reorder
    if optimizer == "distributed":  # Megatron-LM builds the optimizer's layout from this
        common["content_metadata"] = {"distrib_optim_sharding_type": "fully_reshardable",
                                      "distrib_optim_fully_reshardable_mem_efficient": False}  # fmt: skip
    sd["common_state/shard_0_1"] = _obj(common)
    with space.folder_in_place(dst, "the export") as tmp:  # an old dst goes at the end
        dcp.save(
            sd,
            storage_writer=dcp.FileSystemWriter(tmp),
            no_dist=True,
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        )
        with open(os.path.join(tmp, BACKEND_FILE), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    write_tracker(dst)
    return dst


__all__ = ["MegatronExportError", "export_megatron"]
