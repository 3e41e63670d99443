"""The dtype an import or export casts a model's weights to, checked before anything is written."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import ArgumentError
from ...util.dtypes import np_dtype

# the short names users type (`ucp export megatron --dtype bf16`) for the dtypes they mean
FLOAT_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "bf16": "bfloat16",
                 "fp16": "float16", "f16": "float16", "half": "float16"}  # fmt: skip
MODEL_FLOATS = ("float32", "bfloat16", "float16")  # what transformers and torch trainers load


def model_float(value: Any, where: str, allowed: tuple[str, ...] = MODEL_FLOATS) -> np.dtype | None:
    """The dtype a ``--dtype`` / ``dtype=`` names, refused unless it is one of ``allowed``.

    Args:
        value: None (keep the stored dtypes), a name ("bfloat16", "bf16", "fp32") or a dtype.
        where: what the dtype is for, named in the error.
        allowed: the dtype names the target loads.

    Returns:
        The numpy dtype, or None for None.

    Raises:
        ArgumentError: an unknown name, or a dtype outside ``allowed`` (a cast to int8 would keep
            nothing of a weight in [-1, 1]).

    >>> model_float("bf16", "export").name, model_float(None, "export")
    ('bfloat16', None)
    """
    if value is None:
        return None
    name = FLOAT_ALIASES.get(value, value) if isinstance(value, str) else value
    try:
        dt: np.dtype | None = np_dtype(name)
    except TypeError:
        dt = None
    if dt is None or dt.name not in allowed:
        raise ArgumentError(
            f"{where}: dtype {value!r} is not one the model's weights can take; pass one of "
            f"{list(allowed)} (or {sorted(FLOAT_ALIASES)}), or none to keep the stored dtypes"
        )
    return dt
