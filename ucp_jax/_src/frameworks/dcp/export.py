"""Universal atoms -> a plain torch.distributed.checkpoint (DCP) folder, any world size on load.

``{"model": <model state dict>, "optim": {"state": {<param>: {<slot>: tensor}}}}`` as DCP stores
it: flat keys ``model.<name>`` and ``optim.state.<name>.<slot>`` (``exp_avg``, ``exp_avg_sq``,
``step``, ...), every tensor whole, written one at a time. ``dcp.load`` fills a model's state dict
(and the optimizer's state, through ``torch.distributed.checkpoint.state_dict``) at any world size,
resharding into DTensors as the loading job holds them. Names:

- ``atoms``: the atoms' own names and layouts (``import_dcp`` reads it back unchanged);
- ``hf``: a Llama model's Hugging Face names (``model.layers.0.self_attn.q_proj.weight``, torch
  ``[out, in]`` layout);
- ``torchtitan``: torchtitan's names, q / k rows in its pair order, optimizer state keyed by the
  fused ``wqkv`` as torchtitan's parameters are.

>>> ucp.torch.export_dcp("/tmp/ucp/llama", "llama_dcp/", names="hf")  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
from typing import Any

import numpy as np
import torch

from ...checkpoint import Checkpoint
from ...errors import UcpError
from ...format.manifest import PARAM_SLOT
from ...hf_config import config_from_checkpoint
from ..common import llama_export as X
from ..common.dcp_write import LazyTensor, RawBlob, write_dcp
from ..common.destination import local_destination, not_over_source
from ..common.optax_count import adam_step
from ..common.torch_arrays import to_torch, torch_dtype

NAMES = ("atoms", "hf", "torchtitan")
log = logging.getLogger("ucp_jax")


class DCPExportError(UcpError, ValueError):
    """The checkpoint cannot be written under the names asked for."""


def _dcp_source(ck: Checkpoint) -> dict[str, Any]:
    """What ``import_dcp`` recorded of the DCP checkpoint this one came from ({} otherwise)."""
    src = ck.manifest.source if isinstance(ck.manifest.source, dict) else {}
    if src.get("framework") != "torch.distributed.checkpoint":
        return {}
    dcp = src.get("dcp")
    return dcp if isinstance(dcp, dict) else {}


def _atom_entries(ck: Checkpoint, model: str, optim: str, optimizer: bool) -> dict[str, Any]:
    """Every atom's weights (``<model><name>``; an imported DCP's tensors outside its model
    under their own names) and, with ``optimizer``, its slots (``<optim>state.<name>.<slot>``).
    Adam moments without a ``step`` slot (state saved by JAX: optax keeps one count) get one
    per parameter, as torch keeps it: optax's count (else the checkpoint's step)."""
    unprefixed = set(_dcp_source(ck).get("unprefixed") or ())
    step_value = adam_step(ck)  # optax's count
    out: dict[str, Any] = {}
    for name, info in ck.atoms.items():
        for slot, s in info.slots.items():
            if slot != PARAM_SLOT and (not optimizer or info.role is not None):
                continue
            if slot != PARAM_SLOT:
                key = f"{optim}state.{name}.{slot}"
            else:
                key = name if name in unprefixed else f"{model}{name}"

            def load(name: str = name, slot: str = slot) -> Any:
                return to_torch(ck.read(name, slot))

            out[key] = LazyTensor(tuple(info.slot_shape(slot)), torch_dtype(s.dtype), load)
        if optimizer and info.role is None and "exp_avg" in info.slots and "step" not in info.slots:
            step: torch.Tensor = to_torch(np.asarray(step_value, np.float32))
            out[f"{optim}state.{name}.step"] = LazyTensor((), torch.float32, step.clone)
    return out


def _source_objects(ck: Checkpoint) -> dict[str, Any]:
    """The non-tensor entries of the DCP checkpoint this one was imported from (the optimizer's
    ``param_groups``, ``step``, a data loader's state, the user's own), written back so that
    ``dcp.load`` of the model and optimizer state dicts finds every key it asks for: as the bytes
    ``import_dcp`` read (exactly what was saved), else its JSON form (older imports; entries
    beyond its size bound)."""
    dcp = _dcp_source(ck)
    objects = dcp.get("objects") or {}
    blobs = dcp.get("blobs") or {}
    out: dict[str, Any] = {k: v for k, v in objects.items()
                           if isinstance(k, str) and not (isinstance(v, str) and
                                                          v.startswith("<not loaded"))}  # fmt: skip
    for k, b64 in blobs.items():
        try:
            out[k] = RawBlob(base64.b64decode(b64, validate=True))
        except (binascii.Error, TypeError, ValueError) as e:
            raise DCPExportError(
                f"{ck.path}: the kept bytes of entry {k!r} are damaged ({e})"
            ) from e
    return out


def _param_group_entries(
    entries: dict[str, Any], optim: str, param_group: dict[str, Any]
) -> dict[str, Any]:
    """``<optim>param_groups.0.*``: one group of every parameter with optimizer state, its
    hyperparameters ``param_group`` (what ``torch.optim.AdamW(...).param_groups[0]`` holds)."""
    params = sorted({k[len(optim) + 6 : k.rindex(".")] for k in entries
                     if k.startswith(optim + "state.")})  # fmt: skip
    out = {f"{optim}param_groups.0.{k}": v for k, v in param_group.items() if k != "params"}
    out[f"{optim}param_groups.0.params"] = params
    return out


def export_dcp(
    src: Any,
    dst: Any,
    *,
    names: str = "atoms",
    optimizer: bool = True,
    model_prefix: str = "model.",
    optim_prefix: str = "optim.",
    param_group: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> str:
    """Write a universal checkpoint as a plain DCP folder.

    Args:
        src: the universal checkpoint.
        dst: the folder to write.
        names: "atoms", "hf" or "torchtitan" (the latter two need a Llama-family model config in
            the manifest, as the importers record it).
        optimizer: write the optimizer slots too (``<optim_prefix>state.<param>.<slot>``).
        model_prefix: the prefix of the model's keys (the top-level key of its state dict + ".").
        optim_prefix: the prefix of the optimizer's keys.
        param_group: the optimizer's hyperparameters (``torch.optim.AdamW(...).param_groups[0]``,
            its ``params`` left out) written as one parameter group of every parameter, for a
            checkpoint that records none (saved by JAX): ``dcp.load`` of an optimizer state dict
            asks for its ``param_groups``. A checkpoint imported from DCP has its own.
        overwrite: replace ``dst``.
        progress: show a progress bar (default: when stderr is a terminal).

    Returns:
        ``dst``. A checkpoint imported from DCP gets its non-tensor entries back with
        ``names="atoms"`` (the optimizer's ``param_groups``, ``step``, the user's own) as the
        bytes ``import_dcp`` kept of them (as JSON, tuples as lists, beyond its 64 MiB bound).

    Raises:
        DCPExportError: unknown ``names``, or no Llama config for "hf" / "torchtitan".
    """
    dst = local_destination(dst, "the torch.distributed.checkpoint folder")
    if names not in NAMES:
        raise DCPExportError(f"export_dcp: names={names!r}; expected one of {NAMES}")
    ck = Checkpoint(src)
    not_over_source(dst, ck.loc.local_path, "the torch.distributed.checkpoint folder")
    if names == "atoms":
        entries = _atom_entries(ck, model_prefix, optim_prefix, optimizer)
        for key, value in _source_objects(ck).items():  # param groups, step, user entries
            if key not in entries and (optimizer or not key.startswith(optim_prefix)):
                entries[key] = value
        groups = any(k.startswith(optim_prefix + "param_groups.") for k in entries)
        if optimizer and param_group is not None and not groups:
            entries |= _param_group_entries(entries, optim_prefix, dict(param_group))
        elif optimizer and not groups and any(k.startswith(optim_prefix) for k in entries):
            log.warning("export_dcp %s: the checkpoint records no optimizer param_groups; pass "
                        "param_group= (the loading optimizer's hyperparameters), or load the "
                        "optimizer state with DefaultLoadPlanner(allow_partial_load=True)",
                        ck.path)  # fmt: skip
    else:
        cfg = config_from_checkpoint(ck)
        if cfg.n_experts or cfg.qkv_bias:
            raise DCPExportError(
                f"{ck.path}: names={names!r} covers dense Llama models without biases; use "
                "names='atoms'"
            )
        try:
            entries = X.model_entries(ck, cfg, names, model_prefix)
        except KeyError as e:
            raise DCPExportError(str(e.args[0])) from e
        if optimizer:
            entries |= X.optimizer_entries(
                ck, cfg, names, optim_prefix + "state.", fuse_qkv=names == "torchtitan"
            )
    return write_dcp(os.fspath(dst), entries, overwrite=overwrite, progress=progress)


__all__ = ["NAMES", "DCPExportError", "export_dcp"]
