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
    type's range (or NaN / inf into one), into bool anything but 0 and 1, finite values beyond a float type's range (to inf, to
    NaN, or saturated to its largest value, as the float8 and float4 types without an infinity
    do), an infinity or NaN that becomes something else, or imaginary parts dropped. Rounding a
    float to a narrower one (its largest value included) or to an integer is the cast. A complex
    type is checked part by part against its float type.

    >>> cast_loss(np.array([1, 2**40]), np.int32)
    'holds 1099511627776, outside int32 [-2147483648, 2147483647]'
    >>> cast_loss(np.array([1e300]), np.float32)
    "holds 1e+300, beyond float32's range (it would become inf)"
    >>> cast_loss(np.array([70000], np.int32), np.float16)
    "holds 70000.0, beyond float16's range (it would become inf)"
    >>> cast_loss(np.array([1e30], np.float32), ml_dtypes.float4_e2m1fn)
    "holds 1e+30, beyond float4_e2m1fn's range (it would become 6.0)"
    >>> cast_loss(np.array([np.inf], np.float32), ml_dtypes.float8_e4m3fn)
    'holds inf, which float8_e4m3fn cannot hold (it would become nan)'
    >>> cast_loss(np.array([0.5, 3.0, 6.9], np.float32), ml_dtypes.float4_e2m1fn) is None
    True
    >>> cast_loss(np.array([0, 1, 2], np.int32), bool)
    'holds 2, which bool cannot hold (only 0 and 1; it would become True)'
    """
    src, dst = np.dtype(value.dtype), np_dtype(dtype)
    if src == dst or value.size == 0:
        return None
    v = value
    if dst == np.dtype(bool):  # a mask: 0 and 1 only (2 or 0.5 would become True)
        with np.errstate(invalid="ignore"):
            bad = ~((v == 0) | (v == 1))
        if bad.any():
            x = v.flat[int(np.argmax(bad))]
            return f"holds {x}, which bool cannot hold (only 0 and 1; it would become {bool(x)})"
        return None
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
            # the first integer past the top, a power of two and so exact in float64: the top
            # itself is not (int64's 2**63 - 1 rounds to 2**63, which would pass and then wrap)
            f, past_top = v.astype(np.float64), float(int(info.max) + 1)
            with np.errstate(invalid="ignore"):
                out = ~np.isfinite(f) | (np.trunc(f) < info.min) | (np.trunc(f) >= past_top)
            bad = f.flat[int(np.argmax(out))] if out.any() else None
        if bad is not None:
            return f"holds {bad}, outside {dst.name} [{info.min}, {info.max}]"
        return None
    if dst.kind == "c":  # each part against the parts' float type (complex64: float32)
        part = np.zeros((), dst).real.dtype
        parts = (np.real(v), np.imag(v)) if v.dtype.kind == "c" else (v,)
        return next((loss for x in parts if (loss := _float_loss(x, part, dst.name))), None)
    return _float_loss(v, dst, dst.name)


def _float_loss(v: np.ndarray, dst: np.dtype, named: str) -> str | None:
    """`cast_loss` into a real float type `dst` (None for a type that is not one), which the
    message calls `named` (a complex type, for its parts)."""
    try:
        info = ml_dtypes.finfo(dst)
    except (ValueError, TypeError):
        return None
    f = v.astype(np.float64)
    # a float value in its own repr (float32's 1e+30, not float64's 1.0000000150474662e+30)
    shown = f if _integer(v.dtype) or v.dtype == np.dtype(bool) else v
    with np.errstate(over="ignore", invalid="ignore"):
        cast = v.astype(dst)
        back = cast.astype(np.float64)
    # round to nearest reaches past the largest value from halfway to the next step up (the
    # step below it, in a type whose positive values are ordered as their bits): rounding
    # below that, beyond range from there (inf, NaN, or the largest value where that saturates)
    top = np.asarray(info.max, dst)
    below = top.view(f"u{dst.itemsize}") - 1
    step = float(top) - float(below.view(dst))
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(f)
        out = finite & (~np.isfinite(back) | (np.abs(f) >= float(top) + step / 2))
    if out.any():
        at = int(np.argmax(out))
        return f"holds {shown.flat[at]!s}, beyond {named}'s range (it would become {back.flat[at]})"
    # an infinity stays that infinity, a NaN a NaN
    with np.errstate(invalid="ignore"):
        out = (np.isnan(f) & ~np.isnan(back)) | (np.isinf(f) & (back != f))
    if out.any():
        at = int(np.argmax(out))
        return (
            f"holds {shown.flat[at]!s}, which {named} cannot hold (it would become {back.flat[at]})"
        )
    return None
