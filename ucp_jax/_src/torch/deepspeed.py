"""DeepSpeed checkpoints -> universal atoms: ZeRO-1/2/3 folders and ds_to_universal folders.

A ZeRO checkpoint keeps, per data-parallel rank, flat fp32 master and optimizer partitions of each
parameter group, with the address of every parameter's fragment (ZeRO-1/2: `param_slice_mappings`;
ZeRO-3: every parameter padded to a multiple of the DP size, in `param_shapes` order). The import
reads the rank files once, in order, and writes each fragment straight to its place in the atom
(flat ranges become boxes), so memory stays about one rank file plus the writes in flight.
Megatron-style tensor/pipeline parallel files (`mp_rank_XX`, `layer_XX-model_YY`) are merged with
the patterns of `universal_checkpoint_info`, as DeepSpeed's `ds_to_universal` does. DeepSpeed
itself is not needed: its pickles are read weights-only with data stand-ins (see unpickle).
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import NotACheckpointError
from ..format.paths import open_inside, refuse_symlinks
from ..util.gcpause import gc_paused
from .limits import as_shape, check_disjoint, check_range, numel, ucp_errors
from .tp_merge import DeepSpeedFormatError, _Merger
from .unpickle import LazyTensor
from .unpickle import load_lazy as load
from .writer import AtomWriter

_OPTIM_RE = re.compile(
    r"^(?:bf16_|fp16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_?optim_states\.pt$"
)
_MODEL_RE = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
_Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
_LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
_EXPERT_RE = re.compile(r"^(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$|^expp_rank_")

OSD = "optimizer_state_dict"
UC_INFO = "universal_checkpoint_info"
STATE_SLOTS = ("fp32", "exp_avg", "exp_avg_sq")


# ------------------------------------------------------------------------------- utilities


def jsonable(x: Any) -> Any:
    """Plain JSON data from checkpoint metadata (tuples, sizes, enums, 0-d tensors, stand-ins)."""
    if isinstance(x, bool | int | float | str) or x is None:
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        return x
    if isinstance(x, enum.Enum):
        return jsonable(x.value)
    if isinstance(x, LazyTensor) or (hasattr(x, "numel") and hasattr(x, "item")):
        return jsonable(x.item()) if x.numel() == 1 else f"<tensor {tuple(x.shape)}>"
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if hasattr(x, "__dict__"):
        return {k: jsonable(v) for k, v in vars(x).items()}
    return repr(x)


def _progress(enabled: bool | None, total: int, what: str) -> Any:
    """A rich progress bar over bytes (off when stderr is not a terminal, unless forced)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoProgress()
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,  # fmt: skip
        TransferSpeedColumn,
    )

    p = Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), console=Console(stderr=True), transient=False,
    )  # fmt: skip
    p.start()
    p._ucp_task = p.add_task(what, total=total)  # type: ignore[attr-defined]
    return p


class _NoProgress:
    def advance(self, n: int) -> None:
        pass

    def stop(self) -> None:
        pass


def _advance(p: Any, n: int) -> None:
    if isinstance(p, _NoProgress):
        return
    p.advance(p._ucp_task, n)


def resolve_folder(src: Any, tag: str | None, latest: str = "latest") -> tuple[str, str | None]:
    """The folder holding the rank files: `src/tag`, `src/<contents of latest>`, or `src` itself."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        raise NotACheckpointError(f"{src}: no such directory")
    if tag is not None:
        folder = refuse_symlinks(src, str(tag), "tag")
        if not os.path.isdir(folder):
            tags = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
            raise NotACheckpointError(f"{src}: no tag {tag!r} (tags here: {tags[:10]})")
        return folder, str(tag)
    lf = os.path.join(src, latest)
    if os.path.isfile(lf):
        with open_inside(src, latest, "tag file") as f:
            t = f.read(4096).decode("utf-8", "replace").strip()
        folder = refuse_symlinks(src, t, f"{lf}: tag")
        if not os.path.isdir(folder):
            raise NotACheckpointError(f"{lf} names tag {t!r} but {folder} does not exist")
        return folder, t
    return src, None


def _read_step(state: dict[str, Any]) -> Any:
    step = state.get("step")
    if step is None:
        return None
    if isinstance(step, LazyTensor):
        return step.numpy().reshape(())
    return np.asarray(step)


# --------------------------------------------------------------------------------- layout


@dataclasses.dataclass
class _Layout:
    folder: str
    tag: str | None
    stage: int
    tp: int
    pp: int
    dp: int
    optim: dict[tuple[int, int], str]  # (dp, mp) -> file
    model: dict[int, str]  # mp -> model states file (dp 0 for ZeRO-3)
    meta: dict[str, Any]  # first model states (small entries only)
    osd0: dict[str, Any]  # first optim file's optimizer_state_dict (no tensors kept)


def _scan(folder: str) -> _Layout:
    names = sorted(os.listdir(folder))
    optim: dict[tuple[int, int], str] = {}
    model: dict[int, str] = {}
    z3_model: dict[tuple[int, int], str] = {}
    for n in names:
        if _EXPERT_RE.match(n):
            raise DeepSpeedFormatError(
                f"{folder}: {n} is a mixture-of-experts file; MoE checkpoints are not supported "
                "yet (convert them with DeepSpeed's ds_to_universal and import_deepspeed_universal)"
            )
        if m := _OPTIM_RE.match(n):
            optim[(int(m["dp"]), int(m["mp"]))] = refuse_symlinks(folder, n, "rank file")
        elif m := _MODEL_RE.match(n):
            model[int(m["mp"])] = refuse_symlinks(folder, n, "rank file")
        elif m := _Z3_MODEL_RE.match(n):
            z3_model[(int(m["dp"]), int(m["mp"]))] = refuse_symlinks(folder, n, "rank file")
    if not optim:
        hint = ""
        if os.path.isdir(os.path.join(folder, "zero")):
            hint = "; it looks like a ds_to_universal folder: use import_deepspeed_universal"
        raise DeepSpeedFormatError(
            f"{folder}: no ZeRO optimizer files (*zero_pp_rank_*_mp_rank_*_optim_states.pt) "
            f"found among {names[:8]}{hint}"
        )
    dps = sorted({d for d, _ in optim})
    mps = sorted({m for _, m in optim})
    if dps != list(range(len(dps))) or mps != list(range(len(mps))):
        raise DeepSpeedFormatError(f"{folder}: rank files are missing (dp {dps}, mp {mps})")
    for d in dps:
        for m in mps:
            if (d, m) not in optim:
                raise DeepSpeedFormatError(f"{folder}: no optimizer file for dp {d}, mp {m}")
    first = load(optim[(0, 0)])[OSD]
    stage = int(first.get("zero_stage", 1))
    if stage >= 3:
        if not z3_model:
            raise DeepSpeedFormatError(f"{folder}: ZeRO-3 optimizer files but no model states")
        model = {m: z3_model[(0, m)] for m in mps if (0, m) in z3_model}
    if not model:
        raise DeepSpeedFormatError(f"{folder}: no model states file (mp_rank_XX_model_states.pt)")
    meta_full = load(model[min(model)])
    meta = {k: v for k, v in meta_full.items() if k not in ("module", "optimizer")}
    dims = meta.get("checkpoint_parallel_dimensions") or {}
    tp = int(dims.get("tp_degree") or 0)
    pp = int(dims.get("pp_degree") or 0)
    if not tp or not pp:
        layers = [n for n in names if _LAYER_RE.match(n)]
        if layers and stage < 3:
            tp = len({n for n in layers if n.startswith("layer_01-")}) or 1
            pp = max(1, len(mps) // tp)
        else:
            tp, pp = len(mps), 1
    if tp * pp != len(mps):
        raise DeepSpeedFormatError(
            f"{folder}: {len(mps)} model-parallel ranks but tp_degree {tp} x pp_degree {pp}"
        )
    osd0 = {k: v for k, v in first.items() if not isinstance(v, list | dict) or k == "param_groups"}
    osd0["param_groups"] = _param_groups(first)
    return _Layout(folder, None, stage, tp, pp, len(dps), optim, model, meta, osd0)


def _param_groups(osd: dict[str, Any]) -> list[dict[str, Any]]:
    base = osd.get("base_optimizer_state") or osd.get(OSD) or {}
    groups = base.get("param_groups", []) if isinstance(base, dict) else []
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _per_tp_shapes(lay: _Layout) -> dict[str, list[tuple[int, ...] | None]]:
    """Parameter name -> its slice shape on each TP rank (PP stages united, as ds_to_universal)."""
    out: dict[str, list[tuple[int, ...] | None]] = {}
    files = [os.path.join(lay.folder, n) for n in os.listdir(lay.folder)]
    held = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    for mp, path in sorted(lay.model.items()):
        t = mp % lay.tp
        sd = load(path) if mp != min(lay.model) else lay.meta
        groups = [*(sd.get("param_shapes") or []), sd.get("frozen_param_shapes") or {}]
        for group in groups:
            for name, shape in group.items():
                what = f"{path}: parameter {name!r}"
                shape = as_shape(shape, what, DeepSpeedFormatError)
                numel(shape, what, itemsize=1, backing=held, backed_by="the folder's files")
                out.setdefault(name, [None] * lay.tp)[t] = shape
    return out


def _source(lay: _Layout, kind: str) -> dict[str, Any]:
    m, o = lay.meta, lay.osd0
    ds = {
        "format": kind,
        "path": os.path.abspath(lay.folder),
        "tag": lay.tag,
        "zero_stage": lay.stage,
        "tp_degree": lay.tp,
        "pp_degree": lay.pp,
        "dp_degree": lay.dp,
        "ds_version": m.get("ds_version") or o.get("ds_version"),
        "global_steps": m.get("global_steps", m.get("iteration")),
        "global_samples": m.get("global_samples"),
        "skipped_steps": m.get("skipped_steps"),
        "param_groups": o.get("param_groups"),
        "clip_grad": o.get("clip_grad"),
        "loss_scaler": o.get("loss_scaler"),
        "dynamic_loss_scale": o.get("dynamic_loss_scale"),
        "lr_scheduler": m.get("lr_scheduler"),
        UC_INFO: m.get(UC_INFO),
        "ds_config": m.get("ds_config"),
    }
    out = jsonable(ds)
    json.dumps(out)
    return {"framework": "deepspeed", "deepspeed": out}


# ---------------------------------------------------------------------------------- import


def _fragments_z12(
    lay: _Layout, osd: dict[str, Any], pp_index: int, uc: dict[str, Any]
) -> Iterator[tuple[str, str, LazyTensor, Any]]:
    """(param, slot, flat fragment, step) of one ZeRO-1/2 rank file, in file order."""
    skip = (uc or {}).get("pipeline_replicated_parameter_patterns", []) or []
    states = osd["base_optimizer_state"]["state"]
    fp32 = osd["single_partition_of_fp32_groups"]
    for g, mapping in enumerate(osd["param_slice_mappings"]):
        st = states.get(g, states.get(str(g), {})) if isinstance(states, dict) else states[g]
        flats = {"fp32": fp32[g]}
        for key, val in st.items():
            if key != "step" and isinstance(val, LazyTensor) and val.dim() > 0:
                flats[key] = val
        step = _read_step(st)
        ranges = [
            (n, getattr(f, "start", None), getattr(f, "numel", None)) for n, f in mapping.items()
        ]
        check_disjoint(ranges, f"{fp32[g].path}: param_slice_mappings[{g}]", DeepSpeedFormatError)
        for name, frag in mapping.items():
            if pp_index > 0 and any(re.match(p, name) for p in skip):
                continue
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
        step = _read_step(st)
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
) -> str:
    """Import a DeepSpeed ZeRO-1/2/3 checkpoint (fp32 or bf16, any DP, TP/PP) as universal atoms.

    Atoms are named like the torch parameters; slots are `fp32` (master weights), the optimizer's
    flat states (`exp_avg`, `exp_avg_sq` for Adam) and `step` (a scalar per atom, as DeepSpeed's
    universal format keeps it). Reads every rank file once, weights-only; DeepSpeed is not needed.

    Args:
        src: the checkpoint directory (with a `latest` file), or a tag folder itself.
        dst: where to write the universal checkpoint (local path or kvstore URL).
        tag: the tag to import (default: the one `latest` names).
        overwrite: replace an existing checkpoint at `dst`.
        progress: show a progress bar (default: when stderr is a terminal).
        max_inflight_bytes: bound on bytes of writes in flight.

    Returns:
        The location of the written checkpoint.

    Raises:
        NotACheckpointError: `src` or the tag does not exist.
        DeepSpeedFormatError: not a DeepSpeed ZeRO folder (names what was found).
        UnsafePickleError: a file asks for a global outside the allow-list.

    >>> ucp.torch.import_deepspeed("ds_ckpt", "/tmp/ucp/step_3")  # doctest: +SKIP
    """
    folder, found_tag = resolve_folder(src, tag)
    lay = _scan(folder)
    lay.tag = found_tag or os.path.basename(os.path.normpath(folder))
    kw = {} if max_inflight_bytes is None else {"max_inflight_bytes": max_inflight_bytes}
    with AtomWriter(dst, overwrite=overwrite, **kw) as w:
        _import_zero(lay, w, progress)
        step = lay.meta.get("global_steps", lay.meta.get("iteration"))
        return w.commit(step=None if step is None else int(step), source=_source(lay, "zero"))


def _import_zero(lay: _Layout, w: AtomWriter, progress: bool | None) -> None:
    uc = lay.meta.get(UC_INFO) or {}
    shapes = _per_tp_shapes(lay)
    merger = _Merger(w, uc, lay.tp, shapes)
    files = [(d, m, lay.optim[(d, m)]) for d in range(lay.dp) for m in range(lay.tp * lay.pp)]
    _precreate(lay, merger)
    bar = _progress(progress, sum(os.path.getsize(f) for *_, f in files), "ucp import")
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
                for name, slot, frag, step in _fragments_z12(lay, osd, pp_index, uc):
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
            _advance(bar, os.path.getsize(path))

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
        _module_fallback(lay, merger)
        w.flush()
    finally:
        bar.stop()


def _read_ahead(items: Iterator[tuple[Any, ...]], budget: int, threads: int = 4) -> Iterator[Any]:
    """(item, item[3].numpy()) in order, reading up to `budget` bytes ahead on a thread pool."""
    import collections
    from concurrent.futures import ThreadPoolExecutor

    window: collections.deque[tuple[Any, Any, int]] = collections.deque()
    ahead = 0
    with ThreadPoolExecutor(threads, thread_name_prefix="ucp-read") as pool:
        for item in items:
            n = item[3].nbytes
            window.append((item, pool.submit(item[3].numpy), n))
            ahead += n
            while window and ahead > budget:
                it, fut, nb = window.popleft()
                ahead -= nb
                yield it, fut.result()
        while window:
            it, fut, _ = window.popleft()
            yield it, fut.result()


def _precreate(lay: _Layout, merger: _Merger) -> None:
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
    step = _read_step(st)
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


def _frozen_z3(lay: _Layout, merger: _Merger, d: int, m: int, t: int) -> None:
    """Frozen parameters of ZeRO-3: each rank's model states hold its fragment."""
    path = os.path.join(lay.folder, f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt")
    if not os.path.isfile(path):
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


def _module_fallback(lay: _Layout, merger: _Merger) -> None:
    """Parameters without optimizer state (never got a gradient, frozen): fp32 from the module."""
    if lay.stage >= 3:
        return
    for mp, path in sorted(lay.model.items()):
        t = mp % lay.tp
        sd = load(path)
        module = sd.get("module")
        if not module:
            continue
        for name, tensor in module.items():
            if name in sd.get("buffer_names", []) or not isinstance(tensor, LazyTensor):
                continue
            if merger.w.has(name, "fp32"):
                continue
            if name not in merger.shapes:
                merger.shapes[name] = [None] * lay.tp
            if merger.shapes[name][t] is None:
                merger.shapes[name][t] = tuple(tensor.shape)
            flat = tensor.numpy().astype(np.float32).reshape(-1)
            merger.put(name, t, "fp32", flat, 0, keep=None)
    merger.check_done()


# ------------------------------------------------------------------ ds_to_universal folders


@ucp_errors(DeepSpeedFormatError, "import_deepspeed_universal")
def import_deepspeed_universal(
    src: Any,
    dst: Any,
    *,
    tag: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> str:
    """Import a folder written by DeepSpeed's `ds_to_universal` (`zero/<param>/<slot>.pt`).

    Args:
        src: the universal tag folder (holding `zero/`), or its parent with `latest_universal`.
        dst: where to write the universal checkpoint.
        tag, overwrite, progress: as for `import_deepspeed`.

    Returns:
        The location of the written checkpoint.

    >>> ucp.torch.import_deepspeed_universal("ds_univ/global_step3", "/tmp/ucp/step_3")  # doctest: +SKIP
    """
    folder, found_tag = resolve_folder(src, tag, latest="latest_universal")
    zero = refuse_symlinks(folder, "zero", "zero/ folder")
    if not os.path.isdir(zero):
        raise DeepSpeedFormatError(
            f"{folder}: no zero/ folder; this is not a ds_to_universal output "
            "(for a ZeRO checkpoint use import_deepspeed)"
        )
    models = [refuse_symlinks(folder, os.path.basename(p), "model states")
              for p in sorted(glob.glob(os.path.join(folder, "*model_states.pt")))]  # fmt: skip
    meta: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    if models:
        full = load(models[0])
        meta = {k: v for k, v in full.items() if k not in ("module", "optimizer")}
        for group in full.get("param_shapes") or []:
            for name, shape in group.items():
                shapes[name] = as_shape(shape, f"{models[0]}: {name!r}", DeepSpeedFormatError)
    osd: dict[str, Any] = {}
    opt_path = refuse_symlinks(zero, "optimizer_state.pt", "optimizer state")
    if os.path.isfile(opt_path):
        osd = load(opt_path)
    params = sorted(p for p in os.listdir(zero) if os.path.isdir(os.path.join(zero, p)))
    files = [refuse_symlinks(zero, f"{p}/{f}", "parameter file")
             for p in params for f in os.listdir(refuse_symlinks(zero, p, "parameter folder"))]  # fmt: skip
    bar = _progress(progress, sum(os.path.getsize(f) for f in files), "ucp import")
    z3_step = None
    inner = osd.get(OSD) if isinstance(osd.get(OSD), dict) else None
    if inner and isinstance(inner.get("state"), dict) and inner["state"]:
        z3_step = _read_step(next(iter(inner["state"].values())))
    with AtomWriter(dst, overwrite=overwrite) as w:
        try:
            for name in params:
                pdir = os.path.join(zero, name)
                slots = sorted(f[:-3] for f in os.listdir(pdir) if f.endswith(".pt"))
                for slot in sorted(slots, key=lambda s: (s != "fp32", s)):
                    path = os.path.join(pdir, slot + ".pt")
                    obj = load(path)
                    if slot == "step":
                        w.atom(name, shapes.get(name, ()))
                        w.write_scalar(name, "step", _read_step({"step": obj}))
                    else:
                        t = obj["param"] if isinstance(obj, dict) else obj
                        if not isinstance(t, LazyTensor):
                            raise DeepSpeedFormatError(
                                f"{path}: expected a tensor, found {t!r:.60}"
                            )
                        shape = tuple(t.shape)
                        if t.dim() == 1 and name in shapes and shapes[name] != shape:
                            shape = shapes[name]  # ZeRO-3 universal tensors are flat
                        pattern = []
                        if isinstance(obj, dict) and obj.get("vocab_tensor"):
                            pattern.append({"type": "VocabPadded", "size": shape[0], "axis": 0})
                        if isinstance(obj, dict) and obj.get("cat_dim", 0) and len(shape) > 1:
                            pattern.append({"type": "Partitioned", "axis": int(obj["cat_dim"])})
                        w.atom(name, shape, pattern=pattern)
                        arr = t.reshape(shape).numpy()
                        w.write(name, slot, tuple((0, d) for d in shape), arr)
                    _advance(bar, os.path.getsize(path))
                if z3_step is not None and "step" not in slots:
                    w.write_scalar(name, "step", z3_step)
                w.flush()
            lay = _Layout(folder, found_tag, int(jsonable(osd.get("zero_stage", 0)) or 0), 1, 1,
                          int(meta.get("dp_world_size", 1) or 1), {}, {}, meta,
                          {k: v for k, v in osd.items() if k not in (OSD, "fp32_flat_groups")})  # fmt: skip
            lay.osd0["param_groups"] = [
                {k: v for k, v in g.items() if k != "params"} for g in osd.get("param_groups", [])
            ]
            step = meta.get("global_steps", meta.get("iteration"))
            return w.commit(
                step=None if step is None else int(step), source=_source(lay, "universal")
            )
        finally:
            bar.stop()


__all__ = ["DeepSpeedFormatError", "import_deepspeed", "import_deepspeed_universal"]
