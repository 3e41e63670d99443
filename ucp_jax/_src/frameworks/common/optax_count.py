"""The optimizer step of a checkpoint saved from optax: its Adam-like count atom.

torch and DeepSpeed keep Adam's step per parameter; optax keeps one `count` per state (the atom
with role `ScaleByAdamState.count`). Exporters write it as each parameter's step.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def optax_count(ck: Any) -> float | None:
    """The count of the checkpoint's Adam-like optax state (`ScaleByAdamState.count` first, else
    any `*.count` role), or None without one."""
    roles = {n: a.role for n, a in ck.atoms.items() if a.role and a.role.endswith(".count")}
    if not roles:
        return None
    pick = [n for n, r in roles.items() if r == "ScaleByAdamState.count"] or sorted(roles)
    name = pick[0]
    slot = next(iter(ck.atoms[name].slots))
    return float(np.asarray(ck.read(name, slot)))


def adam_step(ck: Any) -> float:
    """The step to write as each parameter's Adam step: optax's count, else the checkpoint's
    step, else 0."""
    count = optax_count(ck)
    return count if count is not None else float(ck.step or 0)
