"""Torch-free, lazy reading of zip-format `.pt` files: containers now, tensor bytes on demand.

`load_lazy` unpickles with the allow-list of `unpickle` (containers, tensor rebuilds, DeepSpeed's
stand-ins) and returns every tensor as a `LazyTensor` (file, offset, dtype, shape, strides) that
reads its bytes only when asked (`.numpy()`), so an importer holds one fragment at a time.
`jsonable` turns what was read into plain JSON for a manifest's `source`.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import math
import mmap
import os
import zipfile
from typing import Any

from ..errors import LimitError, UcpError
from .unpickle import (
    STAND_INS,
    RestrictedUnpickler,
    UnsafePickleError,
    numpy_globals,
    pickle_globals,
    zip_member,
)

_STORAGE_DTYPES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "UntypedStorage": "uint8",
}  # fmt: skip


# torch dtypes a tensor may have here (numpy / ml_dtypes hold each with the same bits)
_TENSOR_DTYPES = (
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip


class LazyTensor:
    """A tensor of a torch file, not read yet: file, byte offset, dtype, shape, strides (elements).

    `numpy()` reads exactly its bytes (pread); `narrow`/`reshape` of contiguous tensors are free.
    """

    __slots__ = ("dtype", "offset", "path", "shape", "stride")

    def __init__(self, path: str, offset: int, dtype: Any, shape: tuple[int, ...],
                 stride: tuple[int, ...]) -> None:  # fmt: skip
        self.path, self.offset, self.dtype = path, offset, dtype
        self.shape, self.stride = tuple(int(d) for d in shape), tuple(int(d) for d in stride)

    def __repr__(self) -> str:
        return (
            f"LazyTensor({self.shape}, {self.dtype}, {os.path.basename(self.path)}@{self.offset})"
        )

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def dim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def is_contiguous(self) -> bool:
        expect = 1
        for d, st in zip(reversed(self.shape), reversed(self.stride)):
            if d != 1 and st != expect:
                return False
            expect *= d
        return True

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        if dim != 0 or not self.is_contiguous():
            raise ValueError("LazyTensor.narrow: only along dim 0 of a contiguous tensor")
        if not (self.shape and start >= 0 and length >= 0 and start + length <= self.shape[0]):
            raise LimitError(
                f"{self.path}: a slice [{start}, {start} + {length}) of a tensor of shape "
                f"{list(self.shape)} at byte {self.offset} lies outside it; the file is damaged"
            )
        row = self.numel() // self.shape[0] if self.shape and self.shape[0] else 0
        shape = (int(length), *self.shape[1:])
        return LazyTensor(self.path, self.offset + int(start) * row * self.dtype.itemsize,
                          self.dtype, shape, _contiguous_strides(shape))  # fmt: skip

    def reshape(self, *shape: Any) -> LazyTensor:
        if len(shape) == 1 and isinstance(shape[0], tuple | list):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        if -1 in shape:
            known = 1
            for d in shape:
                known *= d if d != -1 else 1
            shape = tuple(self.numel() // known if d == -1 else d for d in shape)
        if not self.is_contiguous():
            raise ValueError("LazyTensor.reshape: not contiguous")
        if min(shape, default=0) < 0 or _numel(shape) != self.numel():
            raise LimitError(
                f"{self.path}: cannot view a tensor of shape {list(self.shape)} at byte "
                f"{self.offset} as shape {list(shape)}; the file is damaged"
            )
        return LazyTensor(self.path, self.offset, self.dtype, shape, _contiguous_strides(shape))

    def numpy(self) -> Any:
        """Read the tensor into a new numpy array."""
        import numpy as np

        n = self.numel()
        if n == 0:
            return np.zeros(self.shape, self.dtype)
        if self.is_contiguous():
            buf = np.empty(n * self.dtype.itemsize, np.uint8)
            with open(self.path, "rb", buffering=0) as f:
                f.seek(self.offset)
                got = f.readinto(buf.data)
            if got != buf.nbytes:
                raise UnsafePickleError(f"{self.path}: tensor data truncated at {self.offset}")
            return buf.view(self.dtype).reshape(self.shape)
        span = 1 + sum((d - 1) * st for d, st in zip(self.shape, self.stride))
        flat = LazyTensor(self.path, self.offset, self.dtype, (span,), (1,)).numpy()
        item = self.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat, self.shape, tuple(st * item for st in self.stride)
        )
        return view.copy()

    def mapped(self) -> Any:
        """The tensor as a read-only numpy array over a mapping of its bytes in the file (no
        copy), for a contiguous tensor of at least MAP_MIN_BYTES; otherwise `numpy()`.

        The mapping ends when the array (and every view of it) is dropped. It reads the page
        cache in place: an importer then copies each byte once, into what it writes, instead of
        first into a buffer of its own. The file must not shrink while the array is used (a
        read past its end would be a SIGBUS); its size is checked when mapped.

        Raises:
            UnsafePickleError: the file is shorter than the tensor's bytes.
        """
        import numpy as np

        n = self.numel()
        nbytes = n * self.dtype.itemsize
        if nbytes < MAP_MIN_BYTES or not self.is_contiguous() or not hasattr(mmap, "PROT_READ"):
            return self.numpy()
        start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY
        with open(self.path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size < self.offset + nbytes:
                raise UnsafePickleError(f"{self.path}: tensor data truncated at {self.offset}")
            mm = mmap.mmap(f.fileno(), self.offset + nbytes - start, prot=mmap.PROT_READ,
                           offset=start)  # fmt: skip
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        return np.frombuffer(mm, self.dtype, n, self.offset - start).reshape(self.shape)

    def item(self) -> Any:
        return self.numpy().reshape(-1)[0].item()


MAP_MIN_BYTES = 1 << 20  # smaller tensors are read (a mapping costs a few system calls)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _Storage:
    __slots__ = ("dtype", "nbytes", "offset", "path")

    def __init__(self, path: str, offset: int, dtype: Any, nbytes: int) -> None:
        self.path, self.offset, self.dtype, self.nbytes = path, offset, dtype, nbytes


class TorchSize(tuple):
    """Stands in for torch.Size."""


def _rebuild_tensor(storage: _Storage, storage_offset: int, size: Any, stride: Any,
                    *_: Any) -> LazyTensor:  # fmt: skip
    """A LazyTensor, after checking every element it addresses lies inside its storage."""
    from .limits import check_extent

    check_extent(storage.path, storage.offset, storage.nbytes // storage.dtype.itemsize,
                 storage_offset, size, stride, storage.dtype.itemsize)  # fmt: skip
    off = storage.offset + storage_offset * storage.dtype.itemsize
    return LazyTensor(storage.path, off, storage.dtype, tuple(size), tuple(stride))


def _rebuild_tensor_v3(storage: _Storage, storage_offset: int, size: Any, stride: Any,
                       _requires_grad: Any, _hooks: Any, dtype: Any, *_: Any) -> LazyTensor:  # fmt: skip
    """What torch writes for a dtype without a typed storage class (the float8s): an untyped
    storage and the dtype; offsets and strides count elements of that dtype."""
    import numpy as np

    from ..util.dtypes import np_dtype

    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    if name not in _TENSOR_DTYPES:
        raise UnsafePickleError(f"{storage.path}: a tensor of unknown dtype {dtype!r}")
    typed = _Storage(storage.path, storage.offset, np.dtype(np_dtype(name)), storage.nbytes)
    return _rebuild_tensor(typed, storage_offset, size, stride)


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Any, _new_type: Any, args: Any, _state: Any) -> Any:
    return func(*args)


def _bytearray(*args: Any) -> bytearray:
    """`bytearray` as pickles rebuild one (from bytes, or a str and its encoding), never of a
    length: `bytearray(6_000_000_000)` in a 200-byte pickle allocates 6 GB."""
    if not args or isinstance(args[0], int):
        raise UnsafePickleError(f"bytearray{args!r:.40}: only bytearrays of given bytes are read")
    return bytearray(*args)


def _lazy_globals() -> dict[str, Any]:
    import codecs
    import collections

    import ml_dtypes  # noqa: F401  (bfloat16 for numpy)

    out: dict[str, Any] = dict(STAND_INS)
    out.update(numpy_globals())
    out.update({
        "collections.OrderedDict": collections.OrderedDict,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.complex": complex,
        "builtins.slice": slice, "builtins.bytearray": _bytearray, "_codecs.encode": codecs.encode,
        "torch.Size": TorchSize,
        "torch.device": lambda *a: str(a[0]) if a else "cpu",
        "torch.serialization._get_layout": str,
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch.Tensor": "torch.Tensor", "torch.nn.parameter.Parameter": "Parameter",
    })  # fmt: skip
    for name, dt in _STORAGE_DTYPES.items():
        out[f"torch.{name}"] = _StorageType(dt)
    out["torch.storage.UntypedStorage"] = _StorageType("uint8")  # with _rebuild_tensor_v3
    for dt in _TENSOR_DTYPES:
        out[f"torch.{dt}"] = f"torch.{dt}"
    return out


class _LazyUnpickler(RestrictedUnpickler):
    def __init__(
        self, file: Any, path: str, storages: dict[str, tuple[int, int]], byteorder: str
    ) -> None:
        super().__init__(file, _lazy_globals(), path)
        self._path, self._storages = path, storages

    def persistent_load(self, pid: Any) -> Any:
        import numpy as np

        from ..util.dtypes import np_dtype

        if not (isinstance(pid, tuple) and pid and pid[0] == "storage" and len(pid) >= 3):
            raise UnsafePickleError(f"{self._path}: unexpected persistent id {pid!r}")
        stype, key = pid[1], str(pid[2])
        if not isinstance(stype, _StorageType):
            raise UnsafePickleError(f"{self._path}: storage of unknown type {stype!r}")
        if key not in self._storages:
            raise UnsafePickleError(f"{self._path}: storage {key!r} is missing from the archive")
        dt = np.dtype(np_dtype(stype.dtype))
        off, nbytes = self._storages[key]
        return _Storage(self._path, off, dt, nbytes)


def load_lazy(path: str | os.PathLike[str]) -> Any:
    """Load a zip-format torch file without torch: containers come back, tensors as LazyTensor.

    The pickle is read by a restricted unpickler (allow-list: containers, tensor rebuilds, the
    DeepSpeed stand-ins); tensor bytes are not read until `LazyTensor.numpy()`, so memory stays
    at what the caller reads. Legacy (non-zip) torch files are refused: load them with `load`.

    Raises:
        UnsafePickleError: a global outside the allow-list, or a malformed file.
    """
    import struct

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(4)
        why = ("empty" if not head else "truncated or damaged (it starts as a torch zip file but "
               "its end is missing)" if head == b"PK\x03\x04"
               else "not a zip-format torch file (saved by torch < 1.6, or not by torch.save)")  # fmt: skip
        raise UnsafePickleError(f"{path}: {why}")
    with zipfile.ZipFile(path) as z, open(path, "rb") as raw:
        names = [n for n in z.namelist() if n.endswith("data.pkl")]
        if len(names) != 1:
            raise UnsafePickleError(f"{path}: a zip file without exactly one data.pkl")
        prefix = names[0][: -len("data.pkl")]
        order = (
            z.read(prefix + "byteorder").decode()
            if prefix + "byteorder" in z.namelist()
            else "little"
        )
        if order.strip() != "little":
            raise UnsafePickleError(f"{path}: big-endian tensors are not supported")
        storages: dict[str, tuple[int, int]] = {}  # key -> (byte offset, bytes)
        size = os.fstat(raw.fileno()).st_size
        for info in z.infolist():
            if not info.filename.startswith(prefix + "data/"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise UnsafePickleError(f"{path}: compressed tensor data is not supported")
            raw.seek(info.header_offset)
            head = raw.read(30)
            if head[:4] != b"PK\x03\x04":
                raise UnsafePickleError(f"{path}: bad zip local header for {info.filename}")
            n, m = struct.unpack("<HH", head[26:30])
            start = info.header_offset + 30 + n + m
            if start + info.file_size > size:
                raise UnsafePickleError(
                    f"{path}: zip entry {info.filename} claims bytes [{start}, "
                    f"{start + info.file_size}) of a {size}-byte file; the file is truncated"
                )
            storages[info.filename[len(prefix) + 5 :]] = (start, info.file_size)
        data = zip_member(z, names[0], path)
    try:
        pickle_globals(data)  # memo indices bounded before C's unpickler sizes its memo by them
        return _LazyUnpickler(io.BytesIO(data), path, storages, order).load()
    except UnsafePickleError as e:
        raise e if str(e).startswith(path) else UnsafePickleError(f"{path}: {e}") from None
    except UcpError:
        raise
    except MemoryError as e:
        raise UnsafePickleError(f"{path}: its pickle asks for more memory than there is") from e
    except Exception as e:
        raise UnsafePickleError(f"{path}: not a readable torch file ({e})") from e


def jsonable(x: Any) -> Any:
    """Plain JSON data from checkpoint metadata (tuples, sizes, enums, 0-d tensors, stand-ins).

    >>> jsonable({"betas": (0.9, 0.95), "eps": float("inf")})
    {'betas': [0.9, 0.95], 'eps': 'inf'}
    """
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


__all__ = ["LazyTensor", "jsonable", "load_lazy"]
