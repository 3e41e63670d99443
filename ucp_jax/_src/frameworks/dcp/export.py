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

import os
from typing import Any

from ...checkpoint import Checkpoint
from ...errors import UcpError
from ...format.manifest import PARAM_SLOT
from ...llama_config import config_from_checkpoint
from ..common import llama_export as X
from ..common.dcp_write import LazyTensor, write_dcp
from ..common.torch_arrays import to_torch, torch_dtype

NAMES = ("atoms", "hf", "torchtitan")


class DCPExportError(UcpError, ValueError):
    """The checkpoint cannot be written under the names asked for."""


def _atom_entries(ck: Checkpoint, model: str, optim: str, optimizer: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in ck.atoms.items():
        for slot, s in info.slots.items():
            if slot != PARAM_SLOT and (not optimizer or info.role is not None):
                continue
            key = f"{model}{name}" if slot == PARAM_SLOT else f"{optim}state.{name}.{slot}"

            def load(name: str = name, slot: str = slot) -> Any:
                return to_torch(ck.read(name, slot))

            out[key] = LazyTensor(tuple(info.slot_shape(slot)), torch_dtype(s.dtype), load)
    return out


def _source_objects(ck: Checkpoint) -> dict[str, Any]:
    """The non-tensor entries of the DCP checkpoint this one was imported from (``import_dcp``
    keeps them as JSON: the optimizer's ``param_groups``, ``step``, the user's own), written back
    so that ``dcp.load`` of the model and optimizer state dicts finds every key it asks for."""
    src = ck.manifest.source if isinstance(ck.manifest.source, dict) else {}
    if src.get("framework") != "torch.distributed.checkpoint":
        return {}
    objects = (src.get("dcp") or {}).get("objects") or {}
    return {k: v for k, v in objects.items()
            if isinstance(k, str) and not (isinstance(v, str) and v.startswith("<not loaded"))}  # fmt: skip


def export_dcp(
    src: Any,
    dst: Any,
    *,
    names: str = "atoms",
    optimizer: bool = True,
    model_prefix: str = "model.",
    optim_prefix: str = "optim.",
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
        overwrite: replace ``dst``.
        progress: show a progress bar (default: when stderr is a terminal).

    Returns:
        ``dst``. A checkpoint imported from DCP gets its non-tensor entries back with
        ``names="atoms"`` (the optimizer's ``param_groups``, ``step``, the user's own), as
        ``import_dcp`` kept them (JSON: tuples come back as lists).

    Raises:
        DCPExportError: unknown ``names``, or no Llama config for "hf" / "torchtitan".
    """
    if names not in NAMES:
        raise DCPExportError(f"export_dcp: names={names!r}; expected one of {NAMES}")
    ck = Checkpoint(src)
    if names == "atoms":
        entries = _atom_entries(ck, model_prefix, optim_prefix, optimizer)
        for key, value in _source_objects(ck).items():  # param groups, step, user entries
            if key not in entries and (optimizer or not key.startswith(optim_prefix)):
                entries[key] = value
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
