"""What the DeepSpeed importers share: finding the tag folder, reading steps, the source record.

`import_deepspeed` (ZeRO rank files, `deepspeed.py`) and `import_deepspeed_universal`
(`ds_to_universal` folders, `deepspeed_universal.py`) both record where they came from in the
manifest's `source` with `deepspeed_source`, which `export_deepspeed_universal` reads back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from ...errors import NotACheckpointError, UcpError
from ...untrusted.lazy import LazyTensor, jsonable
from ...untrusted.paths import open_inside, refuse_symlinks
from ...util import config
from ...util.hostmem import allocatable

OSD = "optimizer_state_dict"
UC_INFO = "universal_checkpoint_info"
# `import_deepspeed`'s bytes in flight by default: four writing transactions of 64 MiB rather than
# of 16 MiB (the other importers' 64 MiB) keep the disk busier while the next shards are encoded.
# The 1.5 GiB benchmark import: 0.87x the wall time in one process, 0.95x as a fresh `ucp convert`
# (which also faults in the larger window's memory); peak RSS about 0.58x its largest rank file
# instead of 0.4x (docs/performance.md).
DEEPSPEED_INFLIGHT_BYTES = 256 << 20


class DeepSpeedFormatError(UcpError, ValueError):
    """The folder is not a DeepSpeed checkpoint this importer understands (says what it found)."""


def resolve_folder(src: Any, tag: str | None, latest: str = "latest") -> tuple[str, str | None]:
    """The folder holding the rank files: `src/tag`, `src/<contents of latest>`, or `src` itself.

    Returns:
        (folder, the tag it was found by, or None when `src` is the folder).

    Raises:
        NotACheckpointError: `src` or the tag does not exist.
    """
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


def default_inflight_bytes() -> int:
    """`UCP_IMPORT_INFLIGHT_BYTES` if set, else DEEPSPEED_INFLIGHT_BYTES where this process can
    allocate four times that, else the other importers' default (64 MiB).

    >>> default_inflight_bytes() in (DEEPSPEED_INFLIGHT_BYTES, config.import_inflight_bytes())
    True
    """
    have = allocatable()
    room = have is None or have[0] >= 4 * DEEPSPEED_INFLIGHT_BYTES
    return config.import_inflight_bytes(DEEPSPEED_INFLIGHT_BYTES) if room else (
        config.import_inflight_bytes())  # fmt: skip


def read_step(state: dict[str, Any]) -> Any:
    """The `step` of an optimizer state entry as a 0-d numpy array, or None."""
    step = state.get("step")
    if step is None:
        return None
    if isinstance(step, LazyTensor):
        return step.numpy().reshape(())
    return np.asarray(step)


def param_groups(groups: Any) -> list[dict[str, Any]]:
    """Optimizer param groups without their `params` index lists (hyperparameters only)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in groups or []]


@dataclasses.dataclass
class DeepSpeedRun:
    """What an import records about the DeepSpeed run it read (see `deepspeed_source`).

    Attributes:
        folder, tag: where it was read.
        stage, tp, pp, dp: ZeRO stage and parallel degrees.
        meta: the model states file's small entries (steps, lr scheduler, ds_config, ...).
        osd: the optimizer state's small entries (param groups, clip_grad, loss scaler, ...).
    """

    folder: str
    tag: str | None
    stage: int
    tp: int
    pp: int
    dp: int
    meta: dict[str, Any]
    osd: dict[str, Any]

    def step(self) -> int | None:
        """The global step the run was saved at."""
        step = self.meta.get("global_steps", self.meta.get("iteration"))
        return None if step is None else int(step)


def deepspeed_source(run: DeepSpeedRun, kind: str) -> dict[str, Any]:
    """The manifest's `source` of an import: {"framework": "deepspeed", "deepspeed": {...}}."""
    m, o = run.meta, run.osd
    ds = {
        "format": kind,
        "path": os.path.abspath(run.folder),
        "tag": run.tag,
        "zero_stage": run.stage,
        "tp_degree": run.tp,
        "pp_degree": run.pp,
        "dp_degree": run.dp,
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
