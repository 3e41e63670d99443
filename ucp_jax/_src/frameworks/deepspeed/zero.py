"""DeepSpeed ZeRO-1/2/3 checkpoints -> universal atoms (ds_to_universal folders: deepspeed_universal).

A ZeRO checkpoint keeps, per data-parallel rank, flat fp32 master and optimizer partitions of each
parameter group, with the address of every parameter's fragment (ZeRO-1/2: `param_slice_mappings`;
ZeRO-3: every parameter padded to a multiple of the DP size, in `param_shapes` order). The import
reads the rank files once, in order, and writes each fragment straight to its place in the atom
(flat ranges become boxes), so memory stays about one rank file plus the writes in flight.
Megatron-style tensor/pipeline parallel files (`mp_rank_XX`, `layer_XX-model_YY`) are merged with
the patterns of `universal_checkpoint_info`, as DeepSpeed's `ds_to_universal` does. Mixture-of-
experts param groups are renamed to global experts (see deepspeed_moe). DeepSpeed
itself is not needed: its pickles are read weights-only with data stand-ins (see unpickle).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...checkpoint import Checkpoint
from ...untrusted.lazy import LazyTensor
from ...untrusted.lazy import load_lazy as load
from ...untrusted.limits import as_shape, check_disjoint, check_range, ucp_errors
from ...util.gcpause import gc_paused
from ...util.inflight import InflightWindow
from ..common.hf_atoms import write_hf_atoms
from ..common.progress import Progress
from ..common.writer import AtomWriter
from .common import (
    OSD,
    UC_INFO,
    DeepSpeedFormatError,
    deepspeed_source,
    default_inflight_bytes,
    read_step,
    resolve_folder,
)
from .hf_model import find_hf_config
from .moe import check_expert_values
from .tp_merge import Merger
from .zero_layout import RankFiles, per_tp_shapes, scan_folder


def _fragments_z12(
    lay: RankFiles, osd: dict[str, Any], pp_index: int, uc: dict[str, Any], dp_rank: int
) -> Iterator[tuple[str, str, LazyTensor, Any]]:
    """(param, slot, flat fragment, step) of one ZeRO-1/2 rank file, in file order.

    Experts of MoE param groups are named globally (`lay.experts`): rank `dp_rank`'s local
    expert i is another global expert than the same local name on another expert-parallel rank.
    """
    skip = (uc or {}).get("pipeline_replicated_parameter_patterns", []) or []
    states = osd["base_optimizer_state"]["state"]
    pgroups = osd["base_optimizer_state"].get("param_groups")
    fp32 = osd["single_partition_of_fp32_groups"]
    for g, mapping in enumerate(osd["param_slice_mappings"]):
        st = (
            (states[g] if g in states else states.get(str(g), {}))
            if isinstance(states, dict)
            else states[g]
        )
        flats = {"fp32": fp32[g]}
        for key, val in st.items():
            if key != "step" and isinstance(val, LazyTensor) and val.dim() > 0:
                flats[key] = val
        step = read_step(st)
        ranges = [
            (n, getattr(f, "start", None), getattr(f, "numel", None)) for n, f in mapping.items()
        ]
        check_disjoint(ranges, f"{fp32[g].path}: param_slice_mappings[{g}]", DeepSpeedFormatError)
        for name, frag in mapping.items():
            if pp_index > 0 and any(re.match(p, name) for p in skip):
                continue
            if lay.experts is not None:
                name = lay.experts.name(lay.experts.group_in(g, pgroups), name, dp_rank)
            for slot, flat in flats.items():
                where = f"{flat.path}: param_slice_mappings[{g}][{name!r}] in {slot}"
                start, n = check_range(getattr(frag, "start", None), getattr(frag, "numel", None),
                                       flat.numel(), where, DeepSpeedFormatError)  # fmt: skip
                yield name, slot, flat.narrow(0, start, n), step


def _fragments_z3(
    osd: dict[str, Any], shapes: list[dict[str, Any]], dp_rank: int, dp: int
) -> Iterator[tuple[str, str, LazyTensor, int, Any]]:
    """(param, slot, flat fragment, start in the param, step) of one ZeRO-3 rank file."""
    inner = osd[OSD]["state"]
    groups = osd.get("ds_zero_partition_groups") or []
    for idx, sub in enumerate(shapes):
        st = inner.get(idx, {}) if isinstance(inner, dict) else inner[idx]
        flats = {"fp32": osd["fp32_flat_groups"][idx]}
        for key, val in st.items():
            if key != "step" and isinstance(val, LazyTensor) and val.dim() > 0:
                flats[key] = val
        step = read_step(st)
        meta = groups[idx] if idx < len(groups) else {}
        count = int(meta.get("partition_count", dp))
        rank = int(meta.get("partition_rank", dp_rank))
        offset = 0
        for name, shape in sub.items():
            size = math.prod(as_shape(shape, f"parameter {name!r}", DeepSpeedFormatError))
            part = -(-size // count)
            n = max(0, min(part, size - rank * part))
            for slot, flat in flats.items():
                if n:
                    where = f"{flat.path}: group {idx}, parameter {name!r} in {slot}"
                    check_range(offset, n, flat.numel(), where, DeepSpeedFormatError)
                    yield name, slot, flat.narrow(0, offset, n), rank * part, step
            offset += part


@ucp_errors(DeepSpeedFormatError, "import_deepspeed")
@gc_paused()
def import_deepspeed(
    src: Any,
    dst: Any,
    *,
    tag: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    max_inflight_bytes: int | None = None,
    hf_config: Any = None,
) -> str:
    """Import a DeepSpeed ZeRO-1/2/3 checkpoint (fp32 or bf16, any DP, TP/PP) as universal atoms.

    Atoms are named like the torch parameters (experts of `deepspeed.moe` layers, ZeRO-1/2, by
    their global index: `...deepspeed_experts.{e}...`, one atom each); slots are `fp32` (master weights), the optimizer's
    flat states (`exp_avg`, `exp_avg_sq` for Adam) and `step` (a scalar per atom, as DeepSpeed's
    universal format keeps it). Reads every rank file once, weights-only; DeepSpeed is not needed.

    A Hugging Face model's checkpoint (its `config.json` beside `global_step<N>/`, as the HF
    Trainer saves it, or `hf_config`) of a family `ucp_jax.models.llama` implements is imported as
    `import_hf` names it instead: fused q/k/v and gate/up, `[in, out]` kernels, one atom per
    Mixtral expert (transformers' per-expert `w1/w2/w3` or fused `gate_up_proj`/`down_proj`), the
    config in the manifest's `extra["hf_config"]`; every slot alike.

    Args:
        src: the checkpoint directory (with a `latest` file), or a tag folder itself.
        dst: where to write the universal checkpoint (local path or kvstore URL).
        tag: the tag to import (default: the one `latest` names).
        overwrite: replace an existing checkpoint at `dst`.
        progress: show a progress bar (default: when stderr is a terminal).
        max_inflight_bytes: bound on bytes read ahead and written in flight (default:
            `UCP_IMPORT_INFLIGHT_BYTES`, else 256 MiB where the process can allocate 1 GiB,
            else 64 MiB).
        hf_config: the model's `config.json` (or its folder); default: the one beside the
            checkpoint, if it describes a Llama / Mistral / Qwen2 / Mixtral model (another one is
            recorded as skipped in the manifest's source); False: name atoms as the torch
            parameters even so.

    Returns:
        The location of the written checkpoint.

    Raises:
        NotACheckpointError: `src` or the tag does not exist.
        DeepSpeedFormatError: not a DeepSpeed ZeRO folder (names what was found).
        UnsafePickleError: a file asks for a global outside the allow-list.
        HFConfigError: `hf_config` is unreadable or describes another model family.
        MismatchError: the Hugging Face config does not describe the checkpoint's parameters.

    >>> ucp.torch.import_deepspeed("ds_ckpt", "/tmp/ucp/step_3")  # doctest: +SKIP
    """
    if max_inflight_bytes is None:
        max_inflight_bytes = default_inflight_bytes()
    folder, found_tag = resolve_folder(src, tag)
    cfg, cfg_path, skipped = find_hf_config(os.fspath(src), folder, hf_config)
    lay = scan_folder(folder)
    lay.tag = found_tag or os.path.basename(os.path.normpath(folder))
    source = deepspeed_source(lay, "zero")
    if lay.experts is not None:  # each MoE layer's expert-parallel size (for the export)
        source["deepspeed"]["expert_parallel"] = {
            pre: lay.experts.groups[g] for g, pre in sorted(lay.experts.local)
        }
    if skipped:
        source["deepspeed"]["hf_config_skipped"] = skipped
    if cfg is None:
        with AtomWriter(
            dst,
            overwrite=overwrite,
            max_inflight_bytes=max_inflight_bytes,
            encode_whole_shards=True,
        ) as w:
            _import_raw(lay, w, progress)
            return w.commit(step=lay.step(), source=source)
    # the torch-named atoms first (a temporary checkpoint beside dst), then the model's
    local = "://" not in str(dst)
    tmp = tempfile.mkdtemp(prefix=".ucp-raw-", dir=os.path.dirname(os.path.abspath(dst)) if (
        local and os.path.isdir(os.path.dirname(os.path.abspath(dst)))) else None)  # fmt: skip
    try:
        raw = os.path.join(tmp, "raw")
        with AtomWriter(raw, max_inflight_bytes=max_inflight_bytes, encode_whole_shards=True) as w:
            _import_raw(lay, w, progress)
            w.commit(step=lay.step(), source=source)
        with AtomWriter(dst, overwrite=overwrite, max_inflight_bytes=max_inflight_bytes) as w:
            layout = write_hf_atoms(Checkpoint(raw), w, cfg)
            source["huggingface"] = {"config": os.path.abspath(str(cfg_path)),
                                     "model_type": cfg.model_type, "experts": layout}  # fmt: skip
            return w.commit(step=lay.step(), source=source, extra={"hf_config": cfg.to_hf()})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _import_raw(lay: RankFiles, w: AtomWriter, progress: bool | None) -> None:
    """The torch-named atoms of every rank file (experts checked against their files)."""
    _import_zero(lay, w, progress)
    if lay.experts is not None:
        check_expert_values(lay.experts, lambda n: w.array(n, "fp32", np.float32).read().result())


def _import_zero(lay: RankFiles, w: AtomWriter, progress: bool | None) -> None:
    uc = lay.meta.get(UC_INFO) or {}
    shapes = per_tp_shapes(lay)
    merger = Merger(w, uc, lay.tp, shapes)
    files = [(d, m, lay.optim[(d, m)]) for d in range(lay.dp) for m in range(lay.tp * lay.pp)]
    _precreate(lay, merger)
    bar = Progress(progress, sum(os.path.getsize(f) for *_, f in files), "ucp import")
    pos: dict[tuple[str, int, str], int] = {}
    z3_shapes: dict[int, list[dict[str, Any]]] = {}

    def split(item: tuple[str, int, str, LazyTensor, int, Any]) -> Iterator[tuple[Any, ...]]:
        """Cut a fragment at shard boundaries of its atom: each shard is then written whole."""
        name, t, slot, frag, start, step = item
        block = w.flat_block(name, slot) if lay.tp == 1 else None
        n = frag.numel()
        if not block or n <= block:
            yield item
            return
        off = 0
        while off < n:
            nxt = min(n, ((start + off) // block + 1) * block - start)
            yield name, t, slot, frag.narrow(0, off, nxt - off), start + off, step
            off = nxt

    def fragments() -> Iterator[tuple[str, int, str, LazyTensor, int, Any]]:
        """(param, TP rank, slot, fragment, start in the TP slice, step), file after file."""
        for d, m, path in files:
            pp_index, t = divmod(m, lay.tp)
            osd = load(path)[OSD]
            if lay.stage <= 2:
                for name, slot, frag, step in _fragments_z12(lay, osd, pp_index, uc, d):
                    key = (name, t, slot)
                    start = pos.get(key, 0)
                    pos[key] = start + frag.numel()
                    yield from split((name, t, slot, frag, start, step))
            else:
                if t not in z3_shapes:
                    z3_shapes[t] = (lay.meta if m == min(lay.model) else load(lay.model[m]))[
                        "param_shapes"
                    ]
                for name, slot, frag, start, step in _fragments_z3(osd, z3_shapes[t], d, lay.dp):
                    yield from split((name, t, slot, frag, start, step))
                _frozen_z3(lay, merger, d, m, t)
            bar.advance(os.path.getsize(path))

    try:
        # Reads run ahead on threads (bounded in bytes) while the writes of earlier fragments
        # proceed in TensorStore's threads: disk reads and writes overlap.
        for (name, t, slot, _, start, step), data in _read_ahead(fragments(), w.budget):
            merger.put(name, t, slot, data, start, keep=None)
            merger.step(name, step)
        for (name, t, slot), n in pos.items():  # ZeRO-1/2 fragments cover their parameter
            if n != math.prod(merger.slice_shape(name, t)):
                raise DeepSpeedFormatError(
                    f"{lay.folder}: the param_slice_mappings of {name!r} ({slot}, TP rank {t}) "
                    f"cover {n} of its {math.prod(merger.slice_shape(name, t))} elements"
                )
        merger.check_done()
        _tied(lay, merger)
        _module_fallback(lay, merger)
        w.flush()
    finally:
        bar.stop()


def _read_ahead(items: Iterator[tuple[Any, ...]], budget: int, threads: int = 4) -> Iterator[Any]:
    """(item, item[3].mapped()) in order, up to `budget` bytes ahead on a thread pool (mapped
    tensors are read where they are used; small ones are read here)."""
    from concurrent.futures import ThreadPoolExecutor

    window: InflightWindow[tuple[Any, Any]] = InflightWindow(budget)
    with ThreadPoolExecutor(threads, thread_name_prefix="ucp-read") as pool:
        for item in items:
            for it, fut in window.push((item, pool.submit(item[3].mapped)), item[3].nbytes):
                yield it, fut.result()
        for it, fut in window.drain():
            yield it, fut.result()


def _precreate(lay: RankFiles, merger: Merger) -> None:
    """Declare every atom and create all its slots concurrently (dtypes from the first file)."""
    osd = load(lay.optim[(0, 0)])[OSD]
    if lay.stage <= 2:
        states = osd["base_optimizer_state"]["state"]
        st = next(iter(states.values()), {}) if isinstance(states, dict) else states[0]
        fp32 = osd["single_partition_of_fp32_groups"][0]
    else:
        inner = osd[OSD]["state"]
        st = next(iter(inner.values()), {}) if isinstance(inner, dict) else inner[0]
        fp32 = osd["fp32_flat_groups"][0]
    slots: list[tuple[str, Any, Any]] = [("fp32", fp32.dtype, None)]
    for key, val in st.items():
        if isinstance(val, LazyTensor) and val.dim() > 0:
            slots.append((key, val.dtype, None))
    step = read_step(st)
    if step is not None:
        slots.append(("step", step.dtype, ()))
    frozen = set()
    for mp in lay.model:
        sd = lay.meta if mp == min(lay.model) else None
        if sd is not None:
            frozen |= set((sd.get("frozen_param_shapes") or {}).keys())
    todo = []
    for name in merger.shapes:
        if any(s is None for s in merger.shapes[name]):
            continue
        merger.declare(name)
        for slot, dtype, shape in slots if name not in frozen else slots[:1]:
            todo.append((name, slot, dtype, shape))
    merger.w.create_many(todo)


def _frozen_z3(lay: RankFiles, merger: Merger, d: int, m: int, t: int) -> None:
    """Frozen parameters of ZeRO-3: each rank's model states hold its fragment."""
    path = os.path.join(lay.folder, f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt")
    if not os.path.isfile(path):
        if lay.meta.get("frozen_param_shapes"):
            raise DeepSpeedFormatError(
                f"{path}: missing; under ZeRO-3 each rank's model states hold its part of the "
                f"frozen parameters ({sorted(lay.meta['frozen_param_shapes'])[:3]}...), so the "
                "checkpoint is incomplete"
            )
        return
    sd = lay.meta if path == lay.model.get(m) and d == 0 else load(path)
    frozen = sd.get("frozen_param_fragments") or {}
    for name, frag in frozen.items():
        numel = math.prod(merger.slice_shape(name, t))
        part = -(-numel // lay.dp)
        n = max(0, min(part, numel - d * part))
        if n:
            flat = frag.reshape(-1).narrow(0, 0, n).numpy().astype(np.float32)
            merger.put(name, t, "fp32", flat, d * part, keep=None)


def _tied(lay: RankFiles, merger: Merger) -> None:
    """Tied parameters (`shared_params`: a head that is the embedding): the fp32 master weights
    of the parameter they are, as DeepSpeed's zero_to_fp32 gives them. The module holds only a
    copy in the training dtype (rounded in a bf16 run) under ZeRO-1/2, and nothing under ZeRO-3.
    A tied parameter has one set of optimizer statistics: its source's.
    """
    shared = lay.meta.get("shared_params") or {}
    if not isinstance(shared, dict):
        raise DeepSpeedFormatError(
            f"{lay.folder}: shared_params is a {type(shared).__name__}, expected a dict of "
            "parameter names (tied -> the parameter it is)"
        )
    w = merger.w
    for alias, src in sorted(shared.items(), key=str):
        if not (isinstance(alias, str) and isinstance(src, str)):
            raise DeepSpeedFormatError(
                f"{lay.folder}: shared_params maps {alias!r:.80} to {src!r:.80}; expected "
                "parameter names"
            )
        if alias == src or w.has(alias, "fp32") or not w.has(src, "fp32"):
            continue  # (a source without master weights: the module's copy, below)
        w.flush()  # the source's fragments landed, to be read back
        value = np.asarray(w.array(src, "fp32", np.float32).read().result())
        w.atom(alias, value.shape)
        w.write(alias, "fp32", tuple((0, d) for d in value.shape), value)


def _module_fallback(lay: RankFiles, merger: Merger) -> None:
    """Parameters without optimizer state (never got a gradient, frozen): fp32 from the module;
    frozen expert parameters from their expert files."""
    if lay.stage >= 3:
        return
    for mp, path in sorted(lay.model.items()):
        t = mp % lay.tp
        sd = load(path)
        module = sd.get("module")
        if not module:
            continue
        frozen = set(sd.get("frozen_param_shapes") or {})  # declared, never in the optimizer
        for name, tensor in module.items():
            if name in sd.get("buffer_names", []) or not isinstance(tensor, LazyTensor):
                continue
            if merger.w.has(name, "fp32") and name not in frozen:
                continue
            if name not in merger.shapes:
                merger.shapes[name] = [None] * lay.tp
            if merger.shapes[name][t] is None:
                merger.shapes[name][t] = tuple(tensor.shape)
            flat = tensor.numpy().astype(np.float32).reshape(-1)
            merger.put(name, t, "fp32", flat, 0, keep=None)
    for name, path in sorted((lay.experts.frozen if lay.experts else {}).items()):
        tensor = load(path)[name]  # a frozen expert parameter: its expert file is its only copy
        merger.shapes[name] = [tuple(tensor.shape)] * lay.tp
        merger.put(name, 0, "fp32", tensor.numpy().astype(np.float32).reshape(-1), 0, keep=None)
    merger.check_done()


__all__ = ["DeepSpeedFormatError", "RankFiles", "import_deepspeed"]
