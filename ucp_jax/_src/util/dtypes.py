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


def _integer(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.iinfo(dtype)
    except (ValueError, TypeError):
        return False
    return dtype != np.dtype(bool)


def cast_loss(value: np.ndarray, dtype: Any) -> str | None:
    """What `value.astype(dtype)` would lose beyond rounding, or None: values outside an integer
    type's range (or NaN / inf into one), finite values that overflow a float type to inf, or
    imaginary parts dropped. Rounding a float to a narrower one or to an integer is the cast.

    >>> cast_loss(np.array([1, 2**40]), np.int32)
    'holds 1099511627776, outside int32 [-2147483648, 2147483647]'
    >>> cast_loss(np.array([1e300]), np.float32)
    "holds 1e+300, beyond float32's range (it would become inf)"
    >>> cast_loss(np.array([70000], np.int32), np.float16)
    "holds 70000.0, beyond float16's range (it would become inf)"
    >>> cast_loss(np.array([0.5, 3.0], np.float32), ml_dtypes.bfloat16) is None
    True
    """
    src, dst = np.dtype(value.dtype), np_dtype(dtype)
    if src == dst or dst == np.dtype(bool) or value.size == 0:
        return None
    v = value
    if src.kind == "c" and dst.kind != "c":
        imag = np.imag(v) != 0
        if imag.any():
            return f"holds {v.flat[int(np.argmax(imag))]}, whose imaginary part {dst.name} drops"
        v = np.real(v)
    if _integer(dst):
        info = ml_dtypes.iinfo(dst)
        if _integer(np.dtype(v.dtype)) or v.dtype == np.dtype(bool):
            lo, hi = v.min(), v.max()
            bad = lo if lo < info.min else hi if hi > info.max else None
        else:
            f = v.astype(np.float64)
            with np.errstate(invalid="ignore"):
                out = ~np.isfinite(f) | (np.trunc(f) < info.min) | (np.trunc(f) > info.max)
            bad = f.flat[int(np.argmax(out))] if out.any() else None
        if bad is not None:
            return f"holds {bad}, outside {dst.name} [{info.min}, {info.max}]"
        return None
    if dst.kind == "c":
        return None
    try:
        ml_dtypes.finfo(dst)
    except (ValueError, TypeError):
        return None
    f = v.astype(np.float64) if v.dtype.kind != "f" else v
    with np.errstate(over="ignore", invalid="ignore"):
        cast = v.astype(dst)
    out = np.isfinite(f) & ~np.isfinite(cast)
    if out.any():
        at = int(np.argmax(out))
        return f"holds {f.flat[at]}, beyond {dst.name}'s range (it would become {cast.flat[at]})"
    return None
