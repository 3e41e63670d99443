"""Universal atoms -> a Hugging Face model folder that ``AutoModelForCausalLM.from_pretrained`` loads.

Writes ``config.json``, size-bounded ``model-0000k-of-0000n.safetensors`` shards and
``model.safetensors.index.json``. Streaming: one tensor is read from the checkpoint (only its
region of a fused atom), transposed, cast and appended to its shard at a time, so memory stays
near the largest tensor, whatever the model size. Everything goes to ``<dst>.ucp-tmp`` first and is
renamed into place at the end: an error leaves nothing behind.

>>> ucp.torch.export_hf("/tmp/ucp/llama_step100", "llama-finetuned/")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...checkpoint import Checkpoint
from ...errors import DestinationExistsError, MismatchError
from ...format import space
from ...format.manifest import PARAM_SLOT
from ...hf_config import config_from_checkpoint, config_from_hf
from ...llama_config import LlamaConfig
from ...untrusted.paths import check_component
from ...untrusted.safetensors import DTYPES, INDEX
from ..common.destination import local_destination, not_over_source
from ..common.model_dtype import model_float
from ..common.progress import Progress
from .read import GENERATION, hf_mapping, hf_shapes
from .safetensors import AtomFrom

DEFAULT_MAX_SHARD = "5GB"
BLOCK_BYTES = 32 << 20  # a tensor is read, transposed and written in row blocks of this size
_CODES = {np.dtype(v).name: k for k, v in DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    atom: str
    index: tuple[slice, ...]
    transpose: bool

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB`` / ``500MB`` / ``2GiB`` / an int (as transformers' ``max_shard_size``).

    >>> parse_size("5GB"), parse_size("1MiB"), parse_size(123)
    (5000000000, 1048576, 123)
    """
    if isinstance(size, int) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if not m or float(m[1]) <= 0:
        raise ValueError(f"max_shard_size {size!r}: expected bytes, or a size like '5GB', '500MB'")
    return int(float(m[1]) * _UNITS[m[2] or ""])


def _layers(tmpl: str, atoms: set[str]) -> list[int]:
    rx = re.compile(re.escape(tmpl).replace(r"\{i\}", r"(\d+)"))
    return sorted({int(m[1]) for a in atoms if (m := rx.fullmatch(a))})


def _split_sizes(ck: Checkpoint, atom: str, spec: AtomFrom) -> list[int]:
    """Sizes of the sources along ``spec.axis`` of the atom: its recorded fusion, or equal parts."""
    info = ck.atoms[atom]
    n, total = len(spec.sources), int(info.shape[spec.axis])
    if n == 1:
        return [total]
    for f in info.fused:
        if int(f.get("axis", -1)) == spec.axis and len(f.get("sizes", [])) == n:
            return [int(s) for s in f["sizes"]]
    if total % n:
        raise MismatchError(
            f"{ck.path}: atom {atom!r} (shape {list(info.shape)}) records no fusion sizes and does "
            f"not split into {n} equal parts on axis {spec.axis}; save it with a ucp.Fused rule"
        )
    return [total // n] * n


def plan_tensors(
    ck: Checkpoint, mapping: Mapping[str, AtomFrom], dtype: Any = None
) -> list[_Tensor]:
    """The HF tensors to write, each a region of one atom: name, shape, dtype, where it comes from.

    Args:
        ck: the checkpoint.
        mapping: atom template (``{i}`` = layer) -> the HF tensors the atom concatenates.
        dtype: cast to this dtype (default: each atom's stored dtype).

    Returns:
        The tensors, in mapping order, layer by layer.

    Raises:
        MismatchError: an atom of the mapping is missing, or a parameter atom is left unmapped.
    """
    params = {a for a, info in ck.atoms.items() if PARAM_SLOT in info.slots and info.role is None}
    out: list[_Tensor] = []
    used: set[str] = set()
    for tmpl, spec in mapping.items():
        layers: list[int | None] = list(_layers(tmpl, params)) if "{i}" in tmpl else [None]
        for i in layers:
            fill = str if i is None else (lambda s, i=i: s.replace("{i}", str(i)))
            atom = fill(tmpl)
            if atom not in params:
                raise MismatchError(
                    f"{ck.path}: no parameter atom {atom!r}, which the export mapping needs; "
                    "is this checkpoint of another model (or saved with other rules)?"
                )
            used.add(atom)
            info = ck.atoms[atom]
            want = (
                np.dtype(dtype)
                if dtype is not None
                else np.dtype(_np_name(info.slots[PARAM_SLOT].dtype))
            )
            off = 0
            for src, size in zip(spec.sources, _split_sizes(ck, atom, spec)):
                idx = [slice(None)] * len(info.shape)
                idx[spec.axis] = slice(off, off + size)
                off += size
                shape = list(info.shape)
                shape[spec.axis] = size
                if spec.transpose:
                    if len(shape) != 2:
                        raise MismatchError(f"{ck.path}: atom {atom!r}: only 2-d atoms transpose")
                    shape = shape[::-1]
                out.append(_Tensor(fill(src), tuple(shape), want, atom, tuple(idx), spec.transpose))
    left = sorted(params - used)
    if left:
        raise MismatchError(
            f"{ck.path}: parameter atom(s) {left[:4]} have no Hugging Face name in the mapping; "
            "they would be lost. Extend the mapping (AtomFrom), or export another checkpoint"
        )
    return out


def _np_name(dtype: str) -> str:
    from ...util.dtypes import np_dtype

    return np.dtype(np_dtype(dtype)).name


def shard(tensors: list[_Tensor], max_bytes: int) -> list[list[_Tensor]]:
    """Greedy, in order: a shard closes before it would exceed ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _blocks(t: _Tensor) -> list[tuple[tuple[slice, ...], int]]:
    """Atom regions of ``t``'s successive row blocks (<= BLOCK_BYTES each), with their bytes."""
    if not t.shape or t.nbytes <= BLOCK_BYTES:
        return [(t.index, t.nbytes)]
    rows = t.shape[0]
    row_bytes = t.nbytes // rows
    step = max(1, BLOCK_BYTES // max(row_bytes, 1))
    ax = 1 if t.transpose else 0  # the atom axis that holds the tensor's rows
    base = t.index[ax].start or 0
    out = []
    for r in range(0, rows, step):
        idx = list(t.index)
        idx[ax] = slice(base + r, base + min(r + step, rows))
        out.append((tuple(idx), (min(r + step, rows) - r) * row_bytes))
    return out


def _header(tensors: list[_Tensor]) -> bytes:
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        if t.dtype.name not in _CODES:
            raise MismatchError(
                f"export: tensor {t.name!r}: dtype {t.dtype.name} has no safetensors code"
            )
        head[t.name] = {"dtype": _CODES[t.dtype.name], "shape": list(t.shape),
                        "data_offsets": [off, off + t.nbytes]}  # fmt: skip
        off += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_folder(
    ck: Checkpoint,
    tensors: list[_Tensor],
    config_json: Mapping[str, Any],
    dst: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
    progress: bool | None = None,
    generation_config: Mapping[str, Any] | None = None,
) -> str:
    """Write ``config.json``, the shards and the index of ``tensors`` into ``dst`` (atomically).

    Args:
        ck: the checkpoint the tensors are read from.
        tensors: from :func:`plan_tensors`.
        config_json: the ``config.json`` content.
        dst: the folder to create.
        max_shard_size: bytes per shard at most (a larger single tensor gets a shard of its own).
        overwrite: replace ``dst`` if it exists.
        progress: show a progress bar (default: when stderr is a terminal).
        generation_config: written as ``generation_config.json`` (None: no such file).

    Returns:
        ``dst``.
    """
    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst) and not overwrite:
        raise DestinationExistsError(
            f"{dst} exists; pass overwrite=True (--overwrite) or export to a new folder"
        )
    for t in tensors:
        check_component(t.name, f"export: tensor name {t.name!r}")
    shards = shard(tensors, parse_size(max_shard_size))
    n = len(shards)
    # a block read (and the buffer TensorStore reads it into), converted, transposed
    space.require_memory(4 * BLOCK_BYTES, f"{dst}: the export", space.EXPORT_FIX)
    bar = Progress(progress, sum(t.nbytes for t in tensors), "ucp export hf")
    wmap: dict[str, str] = {}
    try:
        with space.folder_in_place(dst, "the export") as tmp:
            for k, group in enumerate(shards, 1):
                fname = f"model-{k:05d}-of-{n:05d}.safetensors"
                with open(os.path.join(tmp, fname), "wb") as f:
                    head = _header(group)
                    f.write(len(head).to_bytes(8, "little") + head)
                    for t in group:
                        for index, nbytes in _blocks(t):
                            a = ck.read(t.atom, PARAM_SLOT, index)
                            a = a.T if t.transpose else a
                            np.ascontiguousarray(a.astype(t.dtype, copy=False)).tofile(f)
                            bar.advance(nbytes)
                        wmap[t.name] = fname
            total = sum(t.nbytes for t in tensors)
            index_doc = {"metadata": {"total_size": total}, "weight_map": wmap}
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump(index_doc, f, indent=2)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(dict(config_json), f, indent=2, sort_keys=True)
            if generation_config is not None:
                with open(os.path.join(tmp, GENERATION), "w") as f:
                    json.dump(dict(generation_config), f, indent=2, sort_keys=True)
    finally:
        bar.stop()
    return dst


def export_hf(
    path: Any,
    dst: Any,
    *,
    config: LlamaConfig | Mapping[str, Any] | None = None,
    mapping: Mapping[str, AtomFrom] | None = None,
    dtype: Any = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
    progress: bool | None = None,
) -> str:
    """Write a universal checkpoint (saved in any layout) as a Hugging Face model folder.

    Args:
        path: a committed universal checkpoint (or an open ``ucp.Checkpoint``).
        dst: the model folder to create.
        config: a :class:`LlamaConfig` or ``config.json`` dict; default: the manifest's
            ``extra["hf_config"]`` (recorded by ``import_hf``, or by ``ucp.save(extra=ucp_extra(cfg))``).
        mapping: atom template -> :class:`AtomFrom` for your own model (then ``config`` is written
            as ``config.json`` unchanged); default: the Llama-family mapping of ``config``.
        dtype: cast the weights: "float32", "bfloat16" or "float16" ("fp32", "bf16", "fp16");
            default: as stored.
        max_shard_size: bytes per shard, or "5GB" / "500MB"...
        overwrite: replace ``dst`` if it exists.
        progress: show a progress bar (default: when stderr is a terminal).

    Returns:
        ``dst``; ``transformers.AutoModelForCausalLM.from_pretrained(dst)`` loads it. The
        ``generation_config.json`` that ``import_hf`` found (end tokens, sampling) is written back.

    Raises:
        HFConfigError: no config given or recorded, or an unsupported one.
        MismatchError: the atoms do not match the mapping / config.
        ArgumentError: ``dtype`` is not a floating dtype transformers loads.

    >>> ucp.torch.export_hf("/tmp/ucp/llama_step100", "llama-ft/", max_shard_size="2GB")  # doctest: +SKIP
    """
    dst = local_destination(dst, "the Hugging Face model folder")
    dtype = model_float(dtype, f"export_hf(dtype=...) to {dst}")
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    not_over_source(dst, ck.loc.local_path, "the Hugging Face model folder")
    extra = ck.manifest.extra if isinstance(ck.manifest.extra, dict) else {}
    generation = extra.get("hf_generation_config")
    generation = generation if isinstance(generation, dict) else None
    if mapping is not None:
        cfg_json = dict(config.to_hf() if isinstance(config, LlamaConfig) else config or {})
        tensors = plan_tensors(ck, mapping, dtype)
        return write_folder(ck, tensors, cfg_json, dst, max_shard_size=max_shard_size,
                            overwrite=overwrite, progress=progress,
                            generation_config=generation)  # fmt: skip
    if config is None:
        cfg = config_from_checkpoint(ck)
    elif isinstance(config, LlamaConfig):
        cfg = config
    else:
        cfg = config_from_hf(config, "export_hf(config=...)")
    tensors = plan_tensors(ck, hf_mapping(cfg), dtype)
    want = hf_shapes(cfg)
    got = {t.name: t.shape for t in tensors}
    if got != want:
        bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[:4]
        raise MismatchError(
            f"{ck.path}: the atoms do not make the {cfg.model_type} model of the config "
            f"({[(k, got.get(k), want.get(k)) for k in bad]}: found vs expected); wrong config?"
        )
    order = {n: j for j, n in enumerate(want)}
    tensors.sort(key=lambda t: order[t.name])
    cfg_json = cfg.to_hf()
    dtypes = {t.dtype.name for t in tensors}
    if len(dtypes) == 1:
        cfg_json["dtype"] = cfg_json["torch_dtype"] = dtypes.pop()
    return write_folder(ck, tensors, cfg_json, dst, max_shard_size=max_shard_size,
                        overwrite=overwrite, progress=progress,
                        generation_config=generation)  # fmt: skip


__all__ = ["export_hf", "parse_size"]
