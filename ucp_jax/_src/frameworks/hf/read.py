"""Hugging Face model folders (``config.json`` + safetensors) -> atoms of ``ucp_jax.models.llama``.

``config.json`` picks the mapping by ``model_type`` (llama, mistral, qwen2, mixtral); the shards are
memory-mapped and streamed tensor by tensor into the atoms (memory ~ the writes in flight, not the
model); the config is recorded in the manifest's ``extra["hf_config"]`` so a restore can build the
model (:func:`ucp_jax.models.llama.config_from_checkpoint`). Every header, name, shape and dtype is
checked before anything is written: a refused import leaves nothing behind.

>>> ucp.torch.import_hf("Llama-3.2-1B/", "/tmp/ucp/llama")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import MismatchError
from ...llama_config import LlamaConfig, config_from_hf, read_config_json
from ...untrusted.limits import ucp_errors
from ...untrusted.paths import join_inside
from ...untrusted.safetensors import SafetensorsError, SafetensorsFile, open_tensors
from ..common.writer import AtomWriter
from .safetensors import AtomFrom, write_concatenated

CONFIG = "config.json"
_LAYER = "model.layers.{i}."
RELEASE_BYTES = 128 << 20  # source pages read since the last release, before they are dropped


def _release(tensors: Mapping[str, SafetensorsFile], names: list[str]) -> None:
    """Drop the mapped pages of source tensors already written (they would stay in our RSS)."""
    page = mmap.PAGESIZE
    for n in names:
        sf = tensors[n]
        mm = getattr(sf._mm, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            continue
        b, e = sf.header[n]["data_offsets"]
        start = (sf.base + b) // page * page
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_DONTNEED, start, sf.base + e - start)


def hf_mapping(config: LlamaConfig) -> dict[str, AtomFrom]:
    """Canonical atom (template, ``{i}`` = layer) -> the HF tensors it is built from.

    Args:
        config: the model configuration (q/k/v bias and tied embeddings change the mapping).

    Returns:
        An ordered mapping, usable as ``import_safetensors(preset=...)`` and ``export_hf(mapping=...)``.

    >>> hf_mapping(LlamaConfig())["blocks.{i}.attn.out.kernel"].sources
    ('model.layers.{i}.self_attn.o_proj.weight',)
    """
    lay = _LAYER
    qkv = tuple(lay + f"self_attn.{p}_proj.weight" for p in "qkv")
    out = {
        "embed.embedding": AtomFrom(("model.embed_tokens.weight",)),
        "blocks.{i}.ln1.scale": AtomFrom((lay + "input_layernorm.weight",)),
        "blocks.{i}.attn.qkv.kernel": AtomFrom(qkv, transpose=True, axis=1),
    }
    if config.qkv_bias:
        biases = tuple(lay + f"self_attn.{p}_proj.bias" for p in "qkv")
        out["blocks.{i}.attn.qkv.bias"] = AtomFrom(biases, axis=0)
    out |= {
        "blocks.{i}.attn.out.kernel": AtomFrom((lay + "self_attn.o_proj.weight",), transpose=True),
        "blocks.{i}.ln2.scale": AtomFrom((lay + "post_attention_layernorm.weight",)),
    }
    if config.n_experts:  # Mixtral: a router and per-expert w1 (gate), w3 (up), w2 (down)
        moe = lay + "block_sparse_moe."
        out["blocks.{i}.router.kernel"] = AtomFrom((moe + "gate.weight",), transpose=True)
        for e in range(config.n_experts):
            w = moe + f"experts.{e}.w"
            out[f"blocks.{{i}}.experts.{e}.gate_up.kernel"] = AtomFrom(
                (w + "1.weight", w + "3.weight"), transpose=True, axis=1
            )
            out[f"blocks.{{i}}.experts.{e}.down.kernel"] = AtomFrom((w + "2.weight",), True)
    else:
        out["blocks.{i}.mlp.gate_up.kernel"] = AtomFrom(
            (lay + "mlp.gate_proj.weight", lay + "mlp.up_proj.weight"), transpose=True, axis=1
        )
        out["blocks.{i}.mlp.down.kernel"] = AtomFrom((lay + "mlp.down_proj.weight",), True)
    out["ln_f.scale"] = AtomFrom(("model.norm.weight",))
    if not config.tie_embeddings:
        out["unembed.kernel"] = AtomFrom(("lm_head.weight",), transpose=True)
    return out


def hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the model -> its shape (torch layout), in ``state_dict`` order.

    Args:
        config: the model configuration.

    Returns:
        The names and shapes ``LlamaForCausalLM`` (or Mistral / Qwen2) holds.

    >>> hf_shapes(LlamaConfig(n_layers=1))["model.layers.0.self_attn.k_proj.weight"]
    (64, 64)
    """
    c = config
    d, q, kv = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.n_layers):
        pre = f"model.layers.{i}."
        for p, rows in (("q", q), ("k", kv), ("v", kv)):
            out[pre + f"self_attn.{p}_proj.weight"] = (rows, d)
            if c.qkv_bias:
                out[pre + f"self_attn.{p}_proj.bias"] = (rows,)
        out[pre + "self_attn.o_proj.weight"] = (d, q)
        if c.n_experts:
            out[pre + "block_sparse_moe.gate.weight"] = (c.n_experts, d)
            for e in range(c.n_experts):
                w = pre + f"block_sparse_moe.experts.{e}.w"
                out |= {w + "1.weight": (c.d_ff, d), w + "2.weight": (d, c.d_ff)}
                out[w + "3.weight"] = (c.d_ff, d)
        else:
            out[pre + "mlp.gate_proj.weight"] = (c.d_ff, d)
            out[pre + "mlp.up_proj.weight"] = (c.d_ff, d)
            out[pre + "mlp.down_proj.weight"] = (d, c.d_ff)
        out[pre + "input_layernorm.weight"] = (d,)
        out[pre + "post_attention_layernorm.weight"] = (d,)
    out["model.norm.weight"] = (d,)
    if not c.tie_embeddings:
        out["lm_head.weight"] = (c.vocab_size, d)
    return out


def expand(mapping: Mapping[str, AtomFrom], n_layers: int) -> dict[str, tuple[AtomFrom, list[str]]]:
    """Concrete atom name -> (spec, concrete source names), ``{i}`` expanded for every layer.

    Args:
        mapping: atom template -> AtomFrom.
        n_layers: the number of layers.

    Returns:
        The expanded mapping, in the template order, layer by layer.
    """
    out: dict[str, tuple[AtomFrom, list[str]]] = {}
    for tmpl, spec in mapping.items():
        for i in range(n_layers) if "{i}" in tmpl else [None]:
            fill = str if i is None else (lambda s, i=i: s.replace("{i}", str(i)))
            out[fill(tmpl)] = (spec, [fill(s) for s in spec.sources])
    return out


def load_config(src: str) -> tuple[LlamaConfig, str]:
    """The model configuration of a HF folder, and the path of its ``config.json``.

    Args:
        src: the model folder.

    Returns:
        ``(config, path of config.json)``.

    Raises:
        HFConfigError: no readable config.json, or one this model family cannot represent.
    """
    path = join_inside(src, CONFIG, "model config")
    return config_from_hf(read_config_json(path), path), path


def _check_tensors(
    tensors: Mapping[str, SafetensorsFile], config: LlamaConfig, where: str
) -> np.dtype:
    """Names, shapes and one floating dtype, before anything is written; returns the dtype."""
    want = hf_shapes(config)
    names = set(tensors)
    missing = [n for n in want if n not in names]
    if missing:
        f = tensors[next(iter(tensors))].path if tensors else where
        raise SafetensorsError(
            f"{os.path.dirname(f) or where}: tensor(s) {missing[:4]}{'...' if len(missing) > 4 else ''} "
            f"are missing, which {config.model_type} with {config.n_layers} layers needs "
            f"(config.json); a shard is missing or the config does not match the weights"
        )
    extra = sorted(
        n for n in names - set(want)
        if not n.endswith("rotary_emb.inv_freq") and not (config.tie_embeddings and n == "lm_head.weight")
    )  # fmt: skip
    if extra:
        raise SafetensorsError(
            f"{tensors[extra[0]].path}: tensor(s) {extra[:4]} are not part of a {config.model_type} "
            f"model as config.json describes it; the config and the weights disagree"
        )
    dtypes: dict[np.dtype, str] = {}
    for n in want:
        sf = tensors[n]
        shape, dt = sf.shape(n), sf.dtype(n)
        if shape != want[n]:
            raise MismatchError(
                f"{sf.path}: tensor {n!r} has shape {list(shape)}, config.json implies "
                f"{list(want[n])}; the config and the weights disagree"
            )
        if dt.kind != "f" and dt.name != "bfloat16":
            raise SafetensorsError(
                f"{sf.path}: tensor {n!r} has dtype {dt.name}, expected a floating dtype"
            )
        dtypes.setdefault(dt, f"{n!r} in {os.path.basename(sf.path)}")
        if len(dtypes) > 1:
            first = next(iter(dtypes))
            raise SafetensorsError(
                f"{sf.path}: tensor {n!r} is {dt.name}, but {dtypes[first]} is {first.name}; every "
                "weight of a model must have one dtype (the shard is damaged or from another model)"
            )
    return next(iter(dtypes))


@ucp_errors(SafetensorsError, "import_hf")
def import_hf(
    src: Any,
    dst: Any,
    *,
    dtype: Any = None,
    overwrite: bool = False,
    step: int | None = None,
) -> str:
    """Import a Hugging Face Llama / Mistral / Qwen2 / Mixtral folder as ``ucp_jax.models.llama`` atoms.

    Args:
        src: a folder with ``config.json`` and ``model.safetensors`` (or sharded with an index).
        dst: where to write the universal checkpoint.
        dtype: store the weights in this dtype (default: as stored, e.g. bf16).
        overwrite: replace an existing checkpoint at ``dst``.
        step: training step to record.

    Returns:
        The location of the written checkpoint; its manifest's ``extra["hf_config"]`` is the config.

    Raises:
        HFConfigError: config.json is missing, malformed, or describes an unsupported feature.
        SafetensorsError: a shard is missing, malformed, or holds tensors of another dtype.
        MismatchError: a tensor's shape disagrees with config.json.

    >>> ucp.torch.import_hf("llama-tiny/", "/tmp/ucp/llama")  # doctest: +SKIP
    """
    src = os.fspath(src)
    config, _ = load_config(src)
    tensors = open_tensors(src)
    stored = _check_tensors(tensors, config, src)
    want = None if dtype is None else np.dtype(dtype)
    plan = expand(hf_mapping(config), config.n_layers)
    read: list[str] = []
    nread = 0
    with AtomWriter(dst, overwrite=overwrite) as w:
        for atom, (spec, srcs) in plan.items():
            arrays = [tensors[s].array(s) for s in srcs]
            if spec.transpose:
                arrays = [a.T for a in arrays]
            write_concatenated(w, atom, arrays, spec.axis, want)
            read += srcs
            nread += sum(a.nbytes for a in arrays)
            if nread > RELEASE_BYTES:  # bounded memory: written, so their pages can go
                w.release_sources()
                _release(tensors, read)
                read, nread = [], 0
        files = sorted({os.path.basename(sf.path) for sf in tensors.values()})
        source = {
            "framework": "huggingface",
            "huggingface": {"path": os.path.abspath(src), "files": files,
                            "model_type": config.model_type, "dtype": stored.name},
        }  # fmt: skip
        return w.commit(step=step, source=source, extra={"hf_config": config.to_hf()})


__all__ = ["hf_mapping", "hf_shapes", "import_hf", "load_config"]
