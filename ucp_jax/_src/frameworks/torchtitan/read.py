"""torchtitan checkpoints (DCP, any world size, FSDP / TP) -> atoms of ``ucp_jax.models.llama``.

torchtitan's ``CheckpointManager`` writes ``<dump>/checkpoint/step-N/`` with torch DCP: the model's
tensors at the top level (``tok_embeddings.weight``, ``layers.{i}.attention.qkv_linear.wq.weight``,
...), the AdamW state as ``optimizer.state.<param>.{step,exp_avg,exp_avg_sq}`` keyed by the model's
*parameters* (the fused ``wqkv``), the hyperparameters as ``optimizer.param_groups.<param>.*``,
and pickled ``lr_scheduler.*``, ``train_state.{step,ntokens_seen}`` and ``dataloader.*`` entries
(the data loader's state is opaque bytes per data-parallel rank). Tensors are stored in their
global shape (FSDP and TP shards are chunks), so one reader serves every layout.

Atoms are named as :func:`ucp_jax.torch.hf_mapping` names them (``blocks.{i}.attn.qkv.kernel``,
q/k rows in Hugging Face's rotate-half order), so the import restores into
``ucp_jax.models.llama`` on any mesh and exports to Hugging Face as well. Slots: ``fp32`` (the
weights), ``exp_avg`` / ``exp_avg_sq`` (fused ``wqkv`` moments split into the q / k / v columns),
``step``. The rest is kept in ``extra["torchtitan"]``: ``train_state``, ``lr_scheduler``,
``param_groups`` and ``dataloader`` (its bytes as base64, never unpickled). Everything is read
with the restricted unpickler; memory holds one atom at a time.

>>> ucp.torch.import_torchtitan("outputs/checkpoint/step-1000", "/tmp/ucp/tt", heads=32)  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import json
import os
import re
from typing import Any

import torch

from ...errors import UcpError
from ...llama_config import LlamaConfig
from ...mapping.patterns import FusedMark
from ...untrusted.lazy import jsonable
from ...untrusted.limits import ucp_errors
from ..common import llama_names as N
from ..common.dcp_files import read_metadata, read_objects, read_tensor
from ..common.writer import AtomWriter, write_rows

MAX_EXTRA_BYTES = 64 << 20  # the data loader's bytes (base64 in the manifest), all ranks
_OPTIM = re.compile(r"^optimizer\.state\.(?P<param>.+)\.(?P<field>[A-Za-z_]\w*)$")
_GROUP = re.compile(r"^optimizer\.param_groups\.(?P<param>.+)\.(?P<field>[A-Za-z_]\w*)$")
_KEPT = ("lr_scheduler.", "train_state.", "dataloader.")
LLAMA3_ROPE = (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
               ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192))  # fmt: skip


class TorchtitanFormatError(UcpError, ValueError):
    """The folder is not a torchtitan checkpoint of a Llama model this importer understands."""


def infer_config(
    shapes: dict[str, tuple[int, ...]], heads: int, norm_eps: float, rope_theta: float,
    rope_scaling: bool, where: str,
) -> LlamaConfig:  # fmt: skip
    """The Llama config of a torchtitan checkpoint from its tensor shapes and its head count."""
    need = ["tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight",
            "layers.0.attention.qkv_linear.wk.weight", "layers.0.feed_forward.w1.weight"]  # fmt: skip
    missing = [k for k in need if k not in shapes]
    if missing:
        raise TorchtitanFormatError(
            f"{where}: no tensor {missing[0]!r}; expected a torchtitan Llama (llama3 model)"
        )
    v, d = shapes["tok_embeddings.weight"]
    nq = shapes["layers.0.attention.qkv_linear.wq.weight"][0]
    nk = shapes["layers.0.attention.qkv_linear.wk.weight"][0]
    if heads <= 0 or nq % heads or (nq // heads) % 2:
        raise TorchtitanFormatError(
            f"{where}: heads={heads} does not divide wq's {nq} rows into heads of even width"
        )
    hd = nq // heads
    if nk % hd or heads % (nk // hd):
        raise TorchtitanFormatError(
            f"{where}: wk has {nk} rows: no KV head count with heads={heads}"
        )
    layers = 1 + max(int(m[1]) for k in shapes if (m := re.match(r"layers\.(\d+)\.", k)))
    return LlamaConfig(
        model_type="llama", vocab_size=v, d_model=d, n_heads=heads, n_kv_heads=nk // hd,
        head_dim=hd, n_layers=layers, d_ff=shapes["layers.0.feed_forward.w1.weight"][0],
        norm_eps=norm_eps, rope_theta=rope_theta, rope_scaling=LLAMA3_ROPE if rope_scaling else (),
        tie_embeddings="lm_head.weight" not in shapes, vocab_multiple=1,
    )  # fmt: skip


def _classify(folder: str, md: Any) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """Model tensors (canonical name -> stored name) and optimizer tensors ((param, field) ->
    stored name); any other tensor is refused by name."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model: dict[str, str] = {}
    optim: dict[str, tuple[str, str]] = {}
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        m = _OPTIM.match(key)
        if m:
            optim[key] = (N.canonical_torchtitan(m["param"]), m["field"])
            continue
        name = N.canonical_torchtitan(key)
        p = name.replace(".wqkv.", ".wq.")
        if N.match(name) is None and N.match(p) is None:
            raise TorchtitanFormatError(
                f"{folder}: tensor {key!r} is not part of a dense Llama (llama3: RMSNorm, SwiGLU, no "
                "biases, no MoE); this importer does not map it"
            )
        model[name] = key
    return model, {k: v for k, v in optim.items()}


def _kept(objects: dict[str, Any], folder: str) -> dict[str, Any]:
    """extra["torchtitan"]: train state, lr scheduler, data loader (base64), param groups."""
    out: dict[str, Any] = {"train_state": {}, "lr_scheduler": {}, "dataloader": {}}
    groups: dict[str, dict[str, Any]] = {}
    size = 0
    for key, value in objects.items():
        g = _GROUP.match(key)
        if g:
            groups.setdefault(N.canonical_torchtitan(g["param"]), {})[g["field"]] = jsonable(value)
            continue
        part = next((p for p in _KEPT if key.startswith(p)), None)
        if part is None:
            raise TorchtitanFormatError(
                f"{folder}: entry {key!r} is none of torchtitan's model, optimizer, lr_scheduler, "
                "train_state or dataloader state; this importer does not map it"
            )
        sub = key[len(part) :]
        if isinstance(value, bytes | bytearray):
            size += len(value)
            if size > MAX_EXTRA_BYTES:
                raise TorchtitanFormatError(
                    f"{folder}: {key!r}: the data loader state exceeds {MAX_EXTRA_BYTES} bytes"
                )
            value = {"base64": base64.b64encode(bytes(value)).decode()}
        out[part[:-1]][sub] = jsonable(value)
    out["param_groups"] = N.jsonable_groups(groups)
    return out


@ucp_errors(TorchtitanFormatError, "import_torchtitan")
def import_torchtitan(
    src: Any,
    dst: Any,
    *,
    heads: int | None = None,
    norm_eps: float = 1e-5,
    rope_theta: float = 500000.0,
    rope_scaling: bool = True,
    overwrite: bool = False,
    step: int | None = None,
) -> str:
    """Import a torchtitan checkpoint of a Llama 3 model as ``ucp_jax.models.llama`` atoms.

    Args:
        src: the step folder (``.metadata``, ``__<rank>_0.distcp``).
        dst: where to write the universal checkpoint.
        heads: the number of attention heads (torchtitan does not record it; required).
        norm_eps: the RMSNorm epsilon (torchtitan's default 1e-5).
        rope_theta: the RoPE base (torchtitan's llama3 flavors: 500000).
        rope_scaling: Llama 3 RoPE scaling (factor 8, as torchtitan's ``scaling="llama"``).
        overwrite: replace an existing checkpoint at ``dst``.
        step: the step to record (default: ``train_state.step``).

    Returns:
        The location of the written checkpoint. A model-only checkpoint (torchtitan's last save by
        default) gives atoms with the ``fp32`` slot alone, and ``source["torchtitan"]["model_only"]``.

    Raises:
        NotACheckpointError: no ``.metadata``.
        TorchtitanFormatError: another model, an unknown entry, or a head count that does not fit.
        UnsafePickleError: a pickle in it names a global outside the allow-list.
    """
    folder = os.fspath(src)
    md = read_metadata(folder)
    if heads is None:
        raise TorchtitanFormatError(
            f"{folder}: torchtitan does not record the number of attention heads; pass heads= "
            "(--heads), e.g. 32 for Llama 3 8B"
        )
    objects = read_objects(folder, md)  # every pickled entry, through the allow-list, first
    model, optim = _classify(folder, md)
    shapes = {n: tuple(int(d) for d in md.state_dict_metadata[k].size) for n, k in model.items()}
    cfg = infer_config(shapes, heads, norm_eps, rope_theta, rope_scaling, folder)
    by_param: dict[str, dict[str, str]] = {}
    for key, (param, field) in optim.items():
        by_param.setdefault(param, {})[field] = key
    for param in by_param:
        p = param.replace(".wqkv.", ".wq.")
        if N.match(param) is None and N.match(p) is None:
            raise TorchtitanFormatError(f"{folder}: optimizer state of unknown parameter {param!r}")

    def read(key: str) -> torch.Tensor:
        return read_tensor(folder, md, key, TorchtitanFormatError)

    def source_of(row: N.TorchName, i: int | None, slot: str) -> torch.Tensor | None:
        """The torch tensor of one table row (its slot), or None when it is not stored."""
        name = N.fill(row.torchtitan, i)
        if slot == "fp32":
            return read(model[name]) if name in model else None
        if name in by_param:
            key = by_param[name].get(slot)
            return read(key) if key else None
        fused = N.fill(N.WQKV, i)
        if row.atom.endswith("attn.qkv.kernel") and slot in by_param.get(fused, {}):
            t = read(by_param[fused][slot])
            return t if t.ndim == 0 else N.split_wqkv(t, cfg)[row.part or 0]
        return None

    fields = sorted({f for fs in by_param.values() for f in fs})
    atoms: dict[str, list[tuple[N.TorchName, int | None]]] = {}
    for row, i in N.rows_of(cfg):
        atoms.setdefault(N.fill(row.atom, i), []).append((row, i))
    with AtomWriter(dst, overwrite=overwrite) as w:
        for atom, parts in atoms.items():
            sizes = N.part_sizes(cfg, atom)
            fused = [FusedMark(sizes, 1)] if sizes else []
            for slot in ("fp32", *fields):
                got = [source_of(row, i, slot) for row, i in parts]
                if all(t is None for t in got):
                    continue
                if any(t is None for t in got):
                    raise TorchtitanFormatError(
                        f"{folder}: {atom}: {slot} of only some parts stored"
                    )
                ts = [t for t in got if t is not None]
                if ts[0].ndim == 0:  # a per-parameter scalar (AdamW's step)
                    w.atom(atom, _atom_shape(cfg, parts))
                    w.write_scalar(atom, slot, ts[0].numpy())
                    continue
                m = torch.cat([N.to_atom_part(t, cfg, row, "torchtitan")
                               for t, (row, _) in zip(ts, parts)], 1) if sizes else \
                    N.to_atom_part(ts[0], cfg, parts[0][0], "torchtitan")  # fmt: skip
                w.atom(atom, tuple(m.shape), fused=fused)
                write_rows(w, atom, slot, m)
            w.release_sources()
        kept = _kept(objects, folder)
        if step is None and isinstance(kept["train_state"].get("step"), int):
            step = kept["train_state"]["step"]
        info = {"path": os.path.abspath(folder), "heads": heads, "model_only": not optim,
                "world_size": kept["dataloader"].get("world_size")}  # fmt: skip
        extra = {"hf_config": cfg.to_hf(), "torchtitan": kept}
        json.dumps(extra)
        return w.commit(step=step, source={"framework": "torchtitan", "torchtitan": info},
                        extra=extra)  # fmt: skip


def _atom_shape(cfg: LlamaConfig, parts: list[tuple[N.TorchName, int | None]]) -> tuple[int, ...]:
    shapes = [N.shape_of(cfg, row) for row, _ in parts]
    row = parts[0][0]
    if len(shapes) > 1:
        return (shapes[0][1], sum(s[0] for s in shapes))
    return shapes[0][::-1] if row.transpose else shapes[0]


__all__ = ["TorchtitanFormatError", "import_torchtitan", "infer_config"]
