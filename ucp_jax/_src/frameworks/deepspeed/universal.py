"""DeepSpeed `ds_to_universal` folders (`zero/<param>/<slot>.pt`) -> universal atoms.

Each `<param>/<slot>.pt` holds a whole tensor (`{"param": tensor, "cat_dim": d}`, plus
`"vocab_tensor": True` for a padded vocabulary), so every file becomes one slot of one atom; the
model states file gives the shapes (ZeRO-3 universal tensors are flat) and the run's metadata.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from ...mapping.patterns import Partitioned, Pattern, VocabPadded
from ...untrusted.lazy import LazyTensor, jsonable
from ...untrusted.lazy import load_lazy as load
from ...untrusted.limits import as_shape, ucp_errors
from ...untrusted.paths import refuse_symlinks
from ..common.progress import Progress
from ..common.writer import AtomWriter
from .common import (
    OSD,
    DeepSpeedFormatError,
    DeepSpeedRun,
    deepspeed_source,
    param_groups,
    read_step,
    resolve_folder,
)


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
        tag: the tag folder to import (default: the one the `latest_universal` file names).
        overwrite: replace an existing checkpoint at `dst`.
        progress: draw a progress bar (default: when on a terminal).

    Returns:
        The location of the written checkpoint.

    Raises:
        NotACheckpointError: `src` or the tag does not exist.
        DeepSpeedFormatError: no `zero/` folder (not a ds_to_universal output).

    >>> ucp.torch.import_deepspeed_universal("ds_univ/global_step3", "/tmp/ucp/step_3")  # doctest: +SKIP
    """
    folder, found_tag = resolve_folder(src, tag, latest="latest_universal")
    zero = refuse_symlinks(folder, "zero", "zero/ folder")
    if not os.path.isdir(zero):
        raise DeepSpeedFormatError(
            f"{folder}: no zero/ folder; this is not a ds_to_universal output "
            "(for a ZeRO checkpoint use import_deepspeed)"
        )
    meta, shapes = _model_states(folder)
    osd = _optimizer_state(zero)
    params = sorted(p for p in os.listdir(zero) if os.path.isdir(os.path.join(zero, p)))
    files = [refuse_symlinks(zero, f"{p}/{f}", "parameter file")
             for p in params for f in os.listdir(refuse_symlinks(zero, p, "parameter folder"))]  # fmt: skip
    bar = Progress(progress, sum(os.path.getsize(f) for f in files), "ucp import")
    step = _zero3_step(osd)
    with AtomWriter(dst, overwrite=overwrite) as w:
        try:
            for name in params:
                _import_param(w, os.path.join(zero, name), name, shapes, step, bar)
                w.release_sources()
            run = _run(folder, found_tag, meta, osd)
            return w.commit(step=run.step(), source=deepspeed_source(run, "universal"))
        finally:
            bar.stop()


def _model_states(folder: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """(small entries of the first model states file, parameter name -> shape)."""
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
    return meta, shapes


def _optimizer_state(zero: str) -> dict[str, Any]:
    """`zero/optimizer_state.pt` (global optimizer state), or {} when absent."""
    path = refuse_symlinks(zero, "optimizer_state.pt", "optimizer state")
    return load(path) if os.path.isfile(path) else {}


def _zero3_step(osd: dict[str, Any]) -> Any:
    """The step ZeRO-3's universal folders keep in the optimizer state (not per parameter)."""
    inner = osd.get(OSD) if isinstance(osd.get(OSD), dict) else None
    if inner and isinstance(inner.get("state"), dict) and inner["state"]:
        return read_step(next(iter(inner["state"].values())))
    return None


def _import_param(w: AtomWriter, pdir: str, name: str, shapes: dict[str, tuple[int, ...]],
                  z3_step: Any, bar: Progress) -> None:  # fmt: skip
    """Write every `<slot>.pt` of one parameter (fp32 first, so the atom's shape is known)."""
    slots = sorted(f[:-3] for f in os.listdir(pdir) if f.endswith(".pt"))
    for slot in sorted(slots, key=lambda s: (s != "fp32", s)):
        path = os.path.join(pdir, slot + ".pt")
        obj = load(path)
        if slot == "step":
            w.atom(name, shapes.get(name, ()))
            w.write_scalar(name, "step", read_step({"step": obj}))
        else:
            _write_slot(w, name, slot, obj, shapes)
        bar.advance(os.path.getsize(path))
    if z3_step is not None and "step" not in slots:
        w.write_scalar(name, "step", z3_step)


def _write_slot(w: AtomWriter, name: str, slot: str, obj: Any,
                shapes: dict[str, tuple[int, ...]]) -> None:  # fmt: skip
    """One `<slot>.pt`: `{"param": tensor, "cat_dim": d, "vocab_tensor": bool}` or a tensor."""
    t = obj["param"] if isinstance(obj, dict) else obj
    if not isinstance(t, LazyTensor):
        raise DeepSpeedFormatError(f"{name}/{slot}.pt: expected a tensor, found {t!r:.60}")
    shape = tuple(t.shape)
    if t.dim() == 1 and name in shapes and shapes[name] != shape:
        shape = shapes[name]  # ZeRO-3 universal tensors are flat
    pattern: list[Pattern] = []
    if isinstance(obj, dict) and obj.get("vocab_tensor"):
        pattern.append(VocabPadded(shape[0], axis=0))
    if isinstance(obj, dict) and obj.get("cat_dim", 0) and len(shape) > 1:
        pattern.append(Partitioned(int(obj["cat_dim"])))
    w.atom(name, shape, pattern=pattern)
    w.write(name, slot, tuple((0, d) for d in shape), t.reshape(shape).numpy())


def _run(folder: str, tag: str | None, meta: dict[str, Any], osd: dict[str, Any]) -> DeepSpeedRun:
    """The run a universal folder came from (what the manifest's source records)."""
    small = {k: v for k, v in osd.items() if k not in (OSD, "fp32_flat_groups")}
    small["param_groups"] = param_groups(osd.get("param_groups", []))
    stage = int(jsonable(osd.get("zero_stage", 0)) or 0)
    dp = int(meta.get("dp_world_size", 1) or 1)
    return DeepSpeedRun(folder, tag, stage, 1, 1, dp, meta, small)


__all__ = ["import_deepspeed_universal"]
