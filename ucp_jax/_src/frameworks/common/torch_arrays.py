"""CPU torch tensors and numpy arrays as views of each other, every dtype both sides have.

`Tensor.numpy()` and `torch.from_numpy` know only numpy's own types. bfloat16 and the float8s
(ml_dtypes on the numpy side) have the same bits on both sides, so they go across as views of an
integer of their width, without a copy.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ...util.dtypes import np_dtype

# numpy (ml_dtypes) name -> torch attribute: the types torch.numpy() does not take
_SAME_BITS = {
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
}
_CARRIER = {1: np.uint8, 2: np.int16}


@functools.cache
def _pairs() -> dict[Any, str]:
    """torch dtype -> numpy name, for the _SAME_BITS types this torch has."""
    import torch

    return {getattr(torch, t): n for n, t in _SAME_BITS.items() if hasattr(torch, t)}


def to_numpy(t: Any) -> np.ndarray:
    """A CPU torch tensor as a numpy array without copying (bfloat16 and float8s via ml_dtypes).

    >>> import torch
    >>> to_numpy(torch.ones(2, dtype=torch.float8_e4m3fn)).dtype
    dtype(float8_e4m3fn)
    """
    import torch

    t = t.detach()
    name = _pairs().get(t.dtype)
    if name is None:
        return t.numpy()
    dt = np_dtype(name)
    carrier = torch.uint8 if dt.itemsize == 1 else torch.int16
    return t.view(carrier).numpy().view(dt)


def torch_dtype(name: str) -> Any:
    """The torch dtype of a stored dtype name.

    Raises:
        TypeError: torch has no such dtype (e.g. int4).

    >>> torch_dtype("float8_e5m2")
    torch.float8_e5m2
    """
    import torch

    dt = np.dtype(np_dtype(name))
    if dt.name in _SAME_BITS and hasattr(torch, _SAME_BITS[dt.name]):
        return getattr(torch, _SAME_BITS[dt.name])
    try:
        return torch.from_numpy(np.empty(0, dt)).dtype
    except TypeError as e:
        raise TypeError(f"torch has no dtype for {dt.name}; cast the atom to one it has") from e


def to_torch(a: np.ndarray) -> Any:
    """A numpy array as a CPU torch tensor, a view where the array is C-contiguous.

    >>> import ml_dtypes
    >>> to_torch(np.zeros(2, ml_dtypes.bfloat16)).dtype
    torch.bfloat16
    """
    import torch

    a = np.asarray(a)
    a = a if a.flags.c_contiguous else a.copy()  # (ascontiguousarray makes 0-d arrays 1-d)
    if a.dtype.name in _SAME_BITS:
        target = torch_dtype(a.dtype.name)
        return torch.from_numpy(a.view(_CARRIER[a.dtype.itemsize])).view(target)
    return torch.from_numpy(a)
