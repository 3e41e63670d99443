"""dtype names as stored in manifests and zarr3 metadata."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

_EXTRA = {"bfloat16": ml_dtypes.bfloat16}


def np_dtype(name: Any) -> np.dtype:
    """A numpy dtype from a name ('bfloat16' included) or dtype-like."""
    if isinstance(name, str) and name in _EXTRA:
        return np.dtype(_EXTRA[name])
    return np.dtype(name)


def dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype ('float32', 'bfloat16', 'int32', 'bool')."""
    return np.dtype(dtype).name


def zarr_dtype(dtype: Any) -> str:
    """The zarr3 data_type for a dtype."""
    name = dtype_name(dtype)
    if name == "bool":
        return "bool"
    return name
