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
import json
import mmap
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import MismatchError, NotACheckpointError
from ...hf_config import config_from_hf, read_config_json
from ...llama_config import LlamaConfig
from ...untrusted.limits import ucp_errors
from ...untrusted.paths import join_inside
from ...untrusted.safetensors import INDEX, SafetensorsError, SafetensorsFile, open_tensors
from ..common.hf_names import expand, hf_mapping, hf_shapes
from ..common.model_dtype import model_float
from ..common.writer import AtomWriter
from .fused_experts import ExpertView, per_expert
from .safetensors import write_concatenated

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
GENERATION = "generation_config.json"  # written back by export_hf
RELEASE_BYTES = 128 << 20  # source pages read since the last release, before they are dropped


def _release(tensors: Mapping[str, SafetensorsFile | ExpertView], names: list[str]) -> None:
    """Drop the mapped pages of source tensors already written (they would stay in our RSS)."""
    page = mmap.PAGESIZE
    for n in names:
        t = tensors[n]
        sf, n = (t.file, t.name) if isinstance(t, ExpertView) else (t, n)  # a fused one's pages
        mm = getattr(sf._mm, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            continue
        b, e = sf.header[n]["data_offsets"]
        start = (sf.base + b) // page * page
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_DONTNEED, start, sf.base + e - start)


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
    tensors: Mapping[str, SafetensorsFile | ExpertView], config: LlamaConfig, where: str
) -> np.dtype:
    """Names, shapes and floating dtypes, before anything is written; returns the most used dtype."""
    # what config.json claims, against what the files hold, before listing every name it implies
    per_layer = 6 + (1 + 3 * config.n_experts if config.n_experts else 3)  # q k v o, 2 norms, MLP
    if config.n_layers * per_layer > len(tensors):
        f = tensors[next(iter(tensors))].path if tensors else where
        experts = f" of {config.n_experts} experts" if config.n_experts else ""
        last = f"model.layers.{config.n_layers - 1}."
        absent = [n for n in (last + "self_attn.q_proj.weight",
                              f"{last}block_sparse_moe.experts.{config.n_experts - 1}.w1.weight")
                  if n not in tensors and (config.n_experts or "experts" not in n)][:1]  # fmt: skip
        raise SafetensorsError(
            f"{os.path.dirname(f) or where}: config.json describes {config.model_type} with "
            f"{config.n_layers} layers{experts}, at least {config.n_layers * per_layer} tensors, "
            f"but the files hold {len(tensors)}"
            + (f" (no {absent[0]!r})" if absent else "")
            + "; a shard is missing or the config does not match the weights"
        )
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
    tied_head = config.tie_embeddings and "lm_head.weight" in names
    if tied_head:
        _check_tied_head(tensors)
    extra = sorted(
        n for n in names - set(want)
        if not n.endswith("rotary_emb.inv_freq") and not (tied_head and n == "lm_head.weight")
    )  # fmt: skip
    if extra:
        raise SafetensorsError(
            f"{tensors[extra[0]].path}: tensor(s) {extra[:4]} are not part of a {config.model_type} "
            f"model as config.json describes it; the config and the weights disagree"
        )
    counts: dict[np.dtype, int] = {}
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
        counts[dt] = counts.get(dt, 0) + 1  # mixed (bf16 weights, fp32 norms) as transformers
    return max(counts, key=lambda d: counts[d])


def _check_tied_head(tensors: Mapping[str, SafetensorsFile | ExpertView]) -> None:
    """A tied model's file may repeat the embedding as ``lm_head.weight``, but only unchanged."""
    emb, head = "model.embed_tokens.weight", "lm_head.weight"
    a, b = tensors[emb], tensors[head]
    same = a.shape(emb) == b.shape(head) and a.dtype(emb) == b.dtype(head)
    if same:
        x, y = a.array(emb), b.array(head)
        same = np.array_equal(x.view(np.uint8), y.view(np.uint8))
    if not same:
        raise SafetensorsError(
            f"{b.path}: config.json ties the output projection to the embedding "
            f"(tie_word_embeddings=true), but {head!r} differs from {emb!r}; importing would drop "
            f"{head!r}. If the model uses its own {head!r}, set tie_word_embeddings to false in "
            "config.json; if it is tied, remove the stale tensor"
        )


def _weights(src: str, named: Any = None) -> dict[str, SafetensorsFile]:
    """The model's tensors, from the file transformers loads: the one ``config.json`` names in
    ``transformers_weights``, else ``model.safetensors``, else the index (``save_pretrained`` of
    an unsharded model over a sharded one leaves the old index beside the new file:
    transformers loads the file, and so must we).

    Other ``*.safetensors`` beside them (adapters, consolidated copies) are not the model's.

    Raises:
        SafetensorsError: ``transformers_weights`` names no safetensors file or index.
    """
    if named is not None:
        if not isinstance(named, str) or not named.endswith(
            (".safetensors", ".safetensors.index.json")
        ):
            raise SafetensorsError(
                f"{src}: config.json's transformers_weights is {named!r:.80}; expected the name "
                "of a .safetensors file or a .safetensors.index.json in the folder (a pickle is not "
                "imported)"
            )
        return open_tensors(join_inside(src, named, "model weights"))
    for name in (WEIGHTS, INDEX):
        if os.path.isfile(os.path.join(src, name)):
            return open_tensors(join_inside(src, name, "model weights"))
    if os.path.isdir(src) and not any(f.endswith(".safetensors") for f in os.listdir(src)):
        pickled = sorted(f for f in os.listdir(src) if f.startswith("pytorch_model") and
                         (f.endswith(".bin") or f.endswith(".bin.index.json")))  # fmt: skip
        if pickled:
            raise NotACheckpointError(
                f"{src}: the weights are in {pickled[:3]} (torch pickles), which ucp does not "
                f"unpickle for an import; convert them to safetensors first, e.g. with "
                "transformers: AutoModelForCausalLM.from_pretrained(src).save_pretrained(out)"
            )
    return open_tensors(src)


def _generation_config(src: str) -> dict[str, Any] | None:
    """``generation_config.json`` (end tokens, sampling defaults), if the folder has one."""
    if not os.path.isfile(os.path.join(src, GENERATION)):
        return None
    return read_config_json(join_inside(src, GENERATION, "generation config"), "generation config")


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
        src: a folder with ``config.json`` and ``model.safetensors`` (or sharded with an index);
            its ``generation_config.json``, if any, is kept for :func:`export_hf`.
        dst: where to write the universal checkpoint.
        dtype: store the weights in this dtype: "float32", "bfloat16" or "float16" ("fp32",
            "bf16", "fp16"); default: as stored (a tensor fused with one of another dtype, as
            q with k and v, is stored as float32).
        overwrite: replace an existing checkpoint at ``dst``.
        step: training step to record.

    Returns:
        The location of the written checkpoint; its manifest's ``extra["hf_config"]`` is the config.

    Raises:
        HFConfigError: config.json is missing, malformed, or describes an unsupported feature.
        SafetensorsError: a shard is missing or malformed, a tensor is not floating, or a tied
            model's ``lm_head.weight`` differs from its embedding.
        ArgumentError: ``dtype`` is not a floating dtype a model loads.
        MismatchError: a tensor's shape disagrees with config.json.

    >>> ucp.torch.import_hf("llama-tiny/", "/tmp/ucp/llama")  # doctest: +SKIP
    """
    src = os.fspath(src)
    want = model_float(dtype, f"import_hf(dtype=...) of {src}")
    config, _ = load_config(src)
    tensors = per_expert(
        _weights(src, json.loads(config.hf).get("transformers_weights")), config.n_experts
    )
    stored = _check_tensors(tensors, config, src)
    generation = _generation_config(src)
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
        extra: dict[str, Any] = {"hf_config": config.to_hf()}
        if generation is not None:
            extra["hf_generation_config"] = generation
        return w.commit(step=step, source=source, extra=extra)


__all__ = ["hf_mapping", "hf_shapes", "import_hf", "load_config"]
