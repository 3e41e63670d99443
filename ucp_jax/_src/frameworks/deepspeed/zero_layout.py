"""The files of a DeepSpeed ZeRO checkpoint folder: which ranks wrote which states, its degrees.

`scan_folder` finds the optimizer and model state files of every (data, model)-parallel rank
(ZeRO-1/2: `mp_rank_XX_model_states.pt`; ZeRO-3: one per rank; pipeline layers:
`layer_XX-model_YY-model_states.pt`), checks that no rank's file is missing, and reads the
degrees and parameter shapes the import (`zero`) needs.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from ...untrusted.lazy import load_lazy as load
from ...untrusted.limits import as_shape, numel
from ...untrusted.paths import refuse_symlinks
from .common import (
    OSD,
    DeepSpeedFormatError,
    DeepSpeedRun,
    param_groups,
)
from .moe import ExpertGroups, expert_groups, refuse_other_moe

_OPTIM_RE = re.compile(
    r"^(?:bf16_|fp16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_?optim_states\.pt$"
)
_MODEL_RE = re.compile(r"^mp_rank_(?P<mp>\d+)_model_states\.pt$")
_Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")
_LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


@dataclasses.dataclass
class RankFiles(DeepSpeedRun):
    """A ZeRO checkpoint folder: its run (degrees, metadata) and where each rank's files are.

    Attributes:
        optim: (dp, mp) -> optimizer states file.
        model: mp -> model states file (dp 0's for ZeRO-3).
        experts: the MoE param groups' local -> global expert names (None without MoE).
        (and DeepSpeedRun's: folder, tag, stage, tp, pp, dp, meta (the first model states file's
        small entries), osd (the first optimizer file's small entries, no tensors kept))
    """

    optim: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    model: dict[int, str] = dataclasses.field(default_factory=dict)
    experts: ExpertGroups | None = None


def _find_rank_files(
    folder: str, names: list[str]
) -> tuple[dict[tuple[int, int], str], dict[int, str], dict[tuple[int, int], str]]:
    """(optim files by (dp, mp), model files by mp, ZeRO-3 model files by (dp, mp))."""
    optim: dict[tuple[int, int], str] = {}
    model: dict[int, str] = {}
    z3_model: dict[tuple[int, int], str] = {}
    for n in names:
        refuse_other_moe(folder, n)
        if m := _OPTIM_RE.match(n):
            optim[(int(m["dp"]), int(m["mp"]))] = refuse_symlinks(folder, n, "rank file")
        elif m := _MODEL_RE.match(n):
            model[int(m["mp"])] = refuse_symlinks(folder, n, "rank file")
        elif m := _Z3_MODEL_RE.match(n):
            z3_model[(int(m["dp"]), int(m["mp"]))] = refuse_symlinks(folder, n, "rank file")
    return optim, model, z3_model


def _check_ranks(folder: str, names: list[str], optim: dict[tuple[int, int], str]) -> list[int]:
    """Every (dp, mp) optimizer file is there; returns the mp ranks."""
    if not optim:
        hint = ""
        if os.path.isdir(os.path.join(folder, "zero")):
            hint = "; it looks like a ds_to_universal folder: use import_deepspeed_universal"
        else:
            tags = [n for n in names if os.path.isdir(os.path.join(folder, n)) and any(
                _OPTIM_RE.match(f) for f in os.listdir(os.path.join(folder, n)))]  # fmt: skip
            if tags:
                hint = (f"; the tag folders {tags[:4]} hold them, and there is no 'latest' file "
                        f"naming one: pass tag= (--tag {tags[-1]})")  # fmt: skip
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
    return mps


def _degrees(folder: str, names: list[str], meta: dict[str, Any], stage: int, n_mp: int
             ) -> tuple[int, int]:  # fmt: skip
    """(tp, pp): as recorded, else from the layer files' names, else all model parallel is TP."""
    dims = meta.get("checkpoint_parallel_dimensions") or {}
    tp = int(dims.get("tp_degree") or 0)
    pp = int(dims.get("pp_degree") or 0)
    if not tp or not pp:
        layers = [n for n in names if _LAYER_RE.match(n)]
        if layers and stage < 3:
            tp = len({n for n in layers if n.startswith("layer_01-")}) or 1
            pp = max(1, n_mp // tp)
        else:
            tp, pp = n_mp, 1
    if tp * pp != n_mp:
        raise DeepSpeedFormatError(
            f"{folder}: {n_mp} model-parallel ranks but tp_degree {tp} x pp_degree {pp}"
        )
    return tp, pp


def scan_folder(folder: str) -> RankFiles:
    """Find and check the rank files of a ZeRO folder; read its degrees and small metadata."""
    names = sorted(os.listdir(folder))
    optim, model, z3_model = _find_rank_files(folder, names)
    mps = _check_ranks(folder, names, optim)
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
    tp, pp = _degrees(folder, names, meta, stage, len(mps))
    osd0 = {k: v for k, v in first.items() if not isinstance(v, list | dict) or k == "param_groups"}
    base = first.get("base_optimizer_state") or first.get(OSD) or {}
    osd0["param_groups"] = param_groups(base.get("param_groups") if isinstance(base, dict) else [])
    dp = len({d for d, _ in optim})
    saved = meta.get("dp_world_size")
    if isinstance(saved, int) and 0 < saved != dp:  # files gone, or left by a larger save
        lo, hi = sorted((saved, dp))
        files = [f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt"
                 for d in range(lo, hi) for m in mps]  # fmt: skip
        listed = f"{files[:3]}{'...' if len(files) > 3 else ''}"
        what = (f"only {dp} have optimizer files: {listed} are missing" if saved > dp else
                f"{dp} have optimizer files: {listed} are left from another save of this tag by "
                "more ranks (DeepSpeed keeps the files a later save does not write); remove them, "
                "or import a tag saved once")  # fmt: skip
        raise DeepSpeedFormatError(
            f"{folder}: the job saved {saved} data-parallel ranks (dp_world_size in "
            f"{os.path.basename(model[min(model)])}) but {what}"
        )
    experts = expert_groups(folder, names, meta, first, dp, stage, len(mps))
    return RankFiles(folder, None, stage, tp, pp, dp, meta, osd0, optim, model, experts)


def per_tp_shapes(lay: RankFiles) -> dict[str, list[tuple[int, ...] | None]]:
    """Parameter name -> its slice shape on each TP rank (PP stages united, as ds_to_universal)."""
    out: dict[str, list[tuple[int, ...] | None]] = {}
    files = [os.path.join(lay.folder, n) for n in os.listdir(lay.folder)]
    held = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    for mp, path in sorted(lay.model.items()):
        t = mp % lay.tp
        sd = load(path) if mp != min(lay.model) else lay.meta
        shapes = sd.get("param_shapes") or []
        if lay.experts is not None:
            shapes = lay.experts.global_shapes(shapes)
        groups = [*shapes, sd.get("frozen_param_shapes") or {}]
        for group in groups:
            for name, shape in group.items():
                what = f"{path}: parameter {name!r}"
                shape = as_shape(shape, what, DeepSpeedFormatError)
                numel(shape, what, itemsize=1, backing=held, backed_by="the folder's files")
                out.setdefault(name, [None] * lay.tp)[t] = shape
    return out
