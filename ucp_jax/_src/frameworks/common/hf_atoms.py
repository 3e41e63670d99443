"""Atoms named as a Hugging Face model's torch parameters -> the atoms ``import_hf`` writes.

A checkpoint of a Hugging Face model trained by another framework (DeepSpeed ZeRO: the HF Trainer
writes ``config.json`` beside ``global_step<N>/``) holds one tensor per torch parameter of the
model, named as ``model.named_parameters()`` names them, with its optimizer state. Those names are
the safetensors names for the dense families; for Mixtral they depend on transformers' version:
before 5, one module per expert (``block_sparse_moe.experts.<e>.w1/w2/w3``, the safetensors names),
from 5 on, the experts fused on a leading expert axis (``mlp.experts.gate_up_proj [E, 2F, D]``,
``mlp.experts.down_proj [E, D, F]``, the router ``mlp.gate.weight``). Both are turned into the
canonical atoms (q/k/v and gate/up fused, transposed to ``[in, out]``, one atom per expert), every
slot alike (the fp32 master, the moments, a scalar ``step``), one source region at a time.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from ...checkpoint import Checkpoint
from ...errors import MismatchError
from ...llama_config import LlamaConfig
from ...mapping.patterns import FusedMark
from .hf_names import expand, hf_mapping
from .writer import AtomWriter

# transformers 5's fused experts and router: canonical atom -> (its parameter, expert index group)
_FUSED = (
    (re.compile(r"^blocks\.(\d+)\.router\.kernel$"), "model.layers.{}.mlp.gate.weight"),
    (re.compile(r"^blocks\.(\d+)\.experts\.(\d+)\.gate_up\.kernel$"),
     "model.layers.{}.mlp.experts.gate_up_proj"),
    (re.compile(r"^blocks\.(\d+)\.experts\.(\d+)\.down\.kernel$"),
     "model.layers.{}.mlp.experts.down_proj"),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Piece:
    """One source region of an atom: ``source[index]``, transposed or not."""

    source: str
    index: int | None
    transpose: bool


def plan(config: LlamaConfig, names: set[str], where: str) -> tuple[dict[str, tuple[list[Piece], int]], str]:  # fmt: skip
    """Canonical atom -> (its pieces, the axis they are concatenated on), and the expert layout
    found (``"per-expert"``, ``"fused"`` or ``"dense"``).

    Raises:
        MismatchError: a parameter the config's model needs is missing, or one is left over.
    """
    out: dict[str, tuple[list[Piece], int]] = {}
    missing: list[str] = []
    layouts = set()
    for atom, (spec, srcs) in expand(hf_mapping(config), config.n_layers).items():
        if all(s in names for s in srcs):
            out[atom] = ([Piece(s, None, spec.transpose) for s in srcs], spec.axis)
            if ".experts." in atom:
                layouts.add("per-expert")
            continue
        for rx, template in _FUSED:
            m = rx.match(atom)
            if m and template.format(m[1]) in names:
                e = int(m[2]) if rx.groups > 1 else None
                out[atom] = ([Piece(template.format(m[1]), e, True)], 0)
                layouts.add("fused")
                break
        else:
            missing += [s for s in srcs if s not in names]
    if missing:
        raise MismatchError(
            f"{where}: parameter(s) {missing[:4]}{'...' if len(missing) > 4 else ''} are missing, "
            f"which {config.model_type} with {config.n_layers} layers needs (config.json); the "
            "config does not describe the checkpoint's model"
        )
    used = {p.source for pieces, _ in out.values() for p in pieces}
    extra = sorted(names - used - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if extra:
        raise MismatchError(
            f"{where}: parameter(s) {extra[:4]} are not part of a {config.model_type} model as "
            "config.json describes it; the config and the checkpoint disagree"
        )
    if len(layouts) > 1:
        raise MismatchError(f"{where}: experts both per expert and fused; one layout is expected")
    return out, next(iter(layouts), "dense")


def _piece(ck: Checkpoint, p: Piece, slot: str) -> np.ndarray:
    a = ck.read(p.source, slot) if p.index is None else ck.read(p.source, slot, p.index)
    return a.T if p.transpose and a.ndim == 2 else a


def write_hf_atoms(ck: Checkpoint, w: AtomWriter, config: LlamaConfig) -> str:
    """Write the canonical atoms of `config`'s model from `ck`'s torch-named atoms into `w`.

    Returns:
        The expert layout found (``"per-expert"``, ``"fused"``, or ``"dense"``).
    """
    atoms, layout = plan(config, set(ck.atoms), ck.path)
    for atom, (pieces, axis) in atoms.items():
        first = ck.atoms[pieces[0].source]
        for slot in first.slots:
            if first.slot_shape(slot) == ():  # a scalar (DeepSpeed's step): the same in each
                w.write_scalar(atom, slot, ck.read(pieces[0].source, slot))
                continue
            parts = [_piece(ck, p, slot) for p in pieces]
            shape = list(parts[0].shape)
            shape[axis] = sum(a.shape[axis] for a in parts)
            sizes, fused_axis = tuple(a.shape[axis] for a in parts), axis
            if "gate_up" in atom and len(parts) == 1:  # transformers 5's [gate; up] rows
                sizes, fused_axis = (shape[1] // 2,) * 2, 1
            w.atom(atom, shape, fused=[FusedMark(sizes, fused_axis)] if len(sizes) > 1 else [])
            off = 0
            for a in parts:
                box = [(0, d) for d in a.shape]
                box[axis] = (off, off + a.shape[axis])
                off += a.shape[axis]
                w.write(atom, slot, tuple(box), np.ascontiguousarray(a))
        w.release_sources()  # this atom's pieces may go
    return layout


__all__ = ["Piece", "plan", "write_hf_atoms"]
