"""The torch tensors (and optimizer states) of a Llama checkpoint's atoms, read lazily, by name.

Shared by ``ucp export torchtitan`` and ``ucp export dcp --names hf|torchtitan``: every tensor of
:data:`llama_names.NAMES` becomes a :class:`LazyTensor` that reads its region of the atom (one
column group of a fused atom), transposes it and, for torchtitan, puts the q / k rows back into
torchtitan's pair order. Optimizer slots (``exp_avg``, ``exp_avg_sq``, ``step``, ...) are keyed by
the parameter: torchtitan's fused ``wqkv`` (q, k, v regrouped per KV head) or each tensor's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...checkpoint import Checkpoint
from ...format.manifest import PARAM_SLOT
from ...llama_config import LlamaConfig
from . import llama_names as N
from .dcp_write import LazyTensor
from .optax_count import adam_step
from .torch_arrays import to_torch, torch_dtype


def _region(cfg: LlamaConfig, row: N.TorchName) -> tuple[slice, ...] | None:
    cols = N.part_slice(cfg, row)
    return None if cols is None else (slice(None), cols)


def _reader(
    ck: Checkpoint, cfg: LlamaConfig, row: N.TorchName, i: int | None, slot: str, kind: str
) -> Callable[[], torch.Tensor]:
    atom = N.fill(row.atom, i)

    def load() -> torch.Tensor:
        region = _region(cfg, row)
        a = to_torch(ck.read(atom, slot) if region is None else ck.read(atom, slot, region))
        return N.from_atom_part(a, cfg, row, kind)

    return load


def _const(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def _fused(loads: list[Callable[[], torch.Tensor]], cfg: LlamaConfig) -> Callable[[], torch.Tensor]:
    """torchtitan's ``wqkv`` from the q, k and v readers."""

    def load() -> torch.Tensor:
        q, k, v = (f() for f in loads)
        return N.fuse_wqkv(q, k, v, cfg)

    return load


def param_slots(ck: Checkpoint, cfg: LlamaConfig) -> list[str]:
    """The optimizer slots every parameter atom holds (``exp_avg``, ``exp_avg_sq``, ``step``...)."""
    atoms = {N.fill(row.atom, i) for row, i in N.rows_of(cfg)}
    common: set[str] | None = None
    for a in atoms:
        have = set(ck.atoms[a].slots) - {PARAM_SLOT} if a in ck.atoms else set()
        common = have if common is None else common & have
    return sorted(common or ())


def model_entries(ck: Checkpoint, cfg: LlamaConfig, kind: str, prefix: str = "") -> dict[str, Any]:
    """``prefix + name`` -> LazyTensor of every weight (``kind``: "torchtitan" or "hf")."""
    out: dict[str, Any] = {}
    for row, i in N.rows_of(cfg):
        atom = N.fill(row.atom, i)
        if atom not in ck.atoms or PARAM_SLOT not in ck.atoms[atom].slots:
            raise KeyError(f"{ck.path}: no atom {atom!r} with weights (a Llama-family model)")
        dt = torch_dtype(ck.atoms[atom].slots[PARAM_SLOT].dtype)
        out[prefix + N.fill(getattr(row, kind), i)] = LazyTensor(
            N.shape_of(cfg, row), dt, _reader(ck, cfg, row, i, PARAM_SLOT, kind)
        )
    return out


def optimizer_entries(
    ck: Checkpoint, cfg: LlamaConfig, kind: str, prefix: str, *, fuse_qkv: bool
) -> dict[str, Any]:
    """``prefix + <param>.<slot>`` -> LazyTensor of every optimizer slot of every parameter.

    With ``fuse_qkv`` (torchtitan), q / k / v make one ``wqkv`` parameter. A scalar slot (AdamW's
    ``step``) is written once per parameter; without one, optax's count (else the checkpoint's
    step) is used.
    """
    slots = param_slots(ck, cfg)
    if not slots:
        return {}
    fallback = None  # the step of parameters without a `step` slot: read once
    if "step" not in slots:
        slots.append("step")
        fallback = np.float32(adam_step(ck))
    out: dict[str, Any] = {}
    for row, i in N.rows_of(cfg):
        atom = N.fill(row.atom, i)
        fused = fuse_qkv and atom.endswith("attn.qkv.kernel")
        if fused and row.part != 0:
            continue
        param = N.fill(N.WQKV if fused else getattr(row, kind), i)
        for slot in slots:
            info = ck.atoms[atom].slots.get(slot)
            if info is None or ck.atoms[atom].slot_shape(slot) == ():
                value = ck.read(atom, slot) if info is not None else fallback
                t = to_torch(np.asarray(value, np.float32))
                out[f"{prefix}{param}.{slot}"] = LazyTensor((), torch.float32, _const(t))
                continue
            dt = torch_dtype(info.dtype)
            if fused:
                parts = [r for r in N.NAMES if r.atom == row.atom]  # q, k, v
                loads = [_reader(ck, cfg, r, i, slot, kind) for r in parts]
                shape = (sum(cfg.qkv_sizes), cfg.d_model)
                out[f"{prefix}{param}.{slot}"] = LazyTensor(shape, dt, _fused(loads, cfg))
            else:
                out[f"{prefix}{param}.{slot}"] = LazyTensor(
                    N.shape_of(cfg, row), dt, _reader(ck, cfg, row, i, slot, kind)
                )
    return out


def param_names(cfg: LlamaConfig, kind: str, *, fuse_qkv: bool) -> list[str]:
    """The model's parameter names, in order (torchtitan: the fused ``wqkv``)."""
    out: list[str] = []
    for row, i in N.rows_of(cfg):
        fused = fuse_qkv and row.atom.endswith("attn.qkv.kernel")
        if fused and row.part != 0:
            continue
        out.append(N.fill(N.WQKV if fused else getattr(row, kind), i))
    return out
