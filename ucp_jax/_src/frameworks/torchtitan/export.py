"""Universal ``models.llama`` atoms -> a torchtitan checkpoint step folder it resumes from.

The inverse of :mod:`.read`: the model's tensors under torchtitan's names (q / k rows back in
torchtitan's pair order), the AdamW state as ``optimizer.state.<param>.<slot>`` keyed by the fused
``wqkv`` parameter, ``optimizer.param_groups.<param>.*`` (the source's hyperparameters, else
torchtitan's AdamW defaults), ``lr_scheduler.*``, ``train_state.*`` and the data loader's bytes.
Every tensor is written whole by torch DCP, one at a time (bounded memory): torchtitan's
``dcp.load`` reshards it to the FSDP / TP layout of whatever world size resumes. The data loader's
state is per data-parallel rank: it is written when the resuming job has the source's data-parallel
size, and left out otherwise (then resume with ``--checkpoint.exclude-from-loading dataloader``).

>>> ucp.torch.export_torchtitan("/tmp/ucp/tt", "outputs/checkpoint/step-2")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Any

from ...checkpoint import Checkpoint
from ...errors import UcpError
from ...hf_config import config_from_checkpoint
from ..common import llama_export as X
from ..common.dcp_write import write_dcp
from ..common.destination import local_destination, not_over_source
from ..common.optax_count import adam_step


class TorchtitanExportError(UcpError, ValueError):
    """The checkpoint cannot be written as a torchtitan Llama (not a dense untied Llama)."""


def _defaults(lr: float) -> dict[str, Any]:
    """torchtitan's AdamW hyperparameters (``default_adamw``) as its param groups hold them."""
    return {"fused": True, "foreach": False, "lr": lr, "betas": (0.9, 0.95), "eps": 1e-8,
            "weight_decay": 0.1, "amsgrad": False, "maximize": False, "capturable": False,
            "differentiable": False, "decoupled_weight_decay": True, "initial_lr": lr}  # fmt: skip


def _groups(recorded: Any, params: list[str], lr: float) -> dict[str, dict[str, Any]]:
    by: dict[str, dict[str, Any]] = {}
    for g in recorded if isinstance(recorded, list) else []:
        if isinstance(g, dict) and isinstance(g.get("params"), list):
            values = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v)
                      for k, v in g.items() if k != "params"}  # fmt: skip
            for p in g["params"]:
                by[str(p)] = values
    fallback = next(iter(by.values()), None) or _defaults(lr)
    return {p: by.get(p, fallback) for p in params}


def dataloader_kept(path: Any, world_size: int | None) -> bool:
    """Whether an export for ``world_size`` data-parallel ranks carries the data loader's state."""
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    tt = (
        (ck.manifest.extra or {}).get("torchtitan") if isinstance(ck.manifest.extra, dict) else None
    )
    dl = (tt or {}).get("dataloader") or {}
    src = dl.get("world_size")
    return bool(dl) and (world_size is None or world_size == src)


def _dataloader(dl: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in dl.items():
        if isinstance(v, dict) and "base64" in v:
            try:
                v = base64.b64decode(v["base64"], validate=True)
            except (binascii.Error, TypeError, ValueError) as e:
                raise TorchtitanExportError(f"{where}: dataloader {k!r}: bad base64 ({e})") from e
        out["dataloader." + k] = v
    return out


def export_torchtitan(
    src: Any,
    dst: Any,
    *,
    world_size: int | None = None,
    lr: float = 8e-4,
    overwrite: bool = False,
    progress: bool | None = None,
) -> str:
    """Write a universal checkpoint of ``ucp_jax.models.llama`` as a torchtitan step folder.

    Args:
        src: the universal checkpoint (with the model config, as import_torchtitan / import_hf /
            import_megatron record it).
        dst: the step folder to write (``<dump>/checkpoint/step-N``).
        world_size: the data-parallel size of the job that resumes (default: the source's). The
            data loader's per-rank state is written only when it equals the source's.
        lr: the learning rate of the optimizer groups when the source records none.
        overwrite: replace ``dst``.
        progress: show a progress bar (default: when stderr is a terminal).

    Returns:
        ``dst``.

    Raises:
        TorchtitanExportError: not a dense, untied Llama without biases.
        FileExistsError: ``dst`` exists and ``overwrite`` is not set.
    """
    dst = local_destination(dst, "the torchtitan step folder")
    ck = Checkpoint(src)
    not_over_source(dst, ck.loc.local_path, "the torchtitan step folder")
    cfg = config_from_checkpoint(ck)
    if cfg.n_experts or cfg.qkv_bias or cfg.tie_embeddings or cfg.sliding_window:
        raise TorchtitanExportError(
            f"{ck.path}: the model has experts, q/k/v biases, tied embeddings or a sliding window; "
            "export_torchtitan writes torchtitan's dense Llama 3 (llama3) only"
        )
    extra = ck.manifest.extra if isinstance(ck.manifest.extra, dict) else {}
    found = extra.get("torchtitan")
    tt: dict[str, Any] = found if isinstance(found, dict) else {}
    # the training step: the checkpoint's, else (saved from JAX without one) optax's count
    step = int(ck.step) if ck.step is not None else int(adam_step(ck))
    try:
        entries = X.model_entries(ck, cfg, "torchtitan")
    except KeyError as e:
        raise TorchtitanExportError(str(e.args[0])) from e
    optim = X.optimizer_entries(ck, cfg, "torchtitan", "optimizer.state.", fuse_qkv=True)
    if optim:
        entries |= optim
        params = X.param_names(cfg, "torchtitan", fuse_qkv=True)
        for p, values in _groups(tt.get("param_groups"), params, lr).items():
            for k, v in values.items():
                entries[f"optimizer.param_groups.{p}.{k}"] = v
        for part, default in (("lr_scheduler", {"last_epoch": step}),
                              ("train_state", {"step": step, "ntokens_seen": 0})):  # fmt: skip
            for k, v in (tt.get(part) or default).items():
                entries[f"{part}.{k}"] = v
        if dataloader_kept(ck, world_size):
            entries |= _dataloader(tt["dataloader"], ck.path)
    return write_dcp(os.fspath(dst), entries, overwrite=overwrite, progress=progress,
                     what="ucp export torchtitan")  # fmt: skip


__all__ = ["TorchtitanExportError", "dataloader_kept", "export_torchtitan"]
