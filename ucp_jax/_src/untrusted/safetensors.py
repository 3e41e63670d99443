"""Reading Hugging Face safetensors files (untrusted input): header checks, memory-mapped tensors.

A safetensors file is a JSON header plus raw little-endian tensors. Every header entry is checked
(dtype, shape, offsets inside the data section, no overlap) before a byte is mapped; a sharded
model is read through `model.safetensors.index.json`, whose file names must stay in its folder.
"""

from __future__ import annotations

import errno
import os
import struct
from typing import IO, Any

import ml_dtypes
import numpy as np

from ..errors import HostMemoryError, NotACheckpointError, UcpError
from .json import read_json
from .limits import as_int, as_shape, numel
from .paths import join_inside, open_inside, open_regular

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64,
    "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}  # fmt: skip
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20


class SafetensorsError(UcpError, ValueError):
    """A safetensors file or index is malformed, or a preset does not fit the tensors."""


# ---------------------------------------------------------------------------------- reading


class SafetensorsFile:
    """One safetensors file, memory-mapped: `names`, `meta(name)`, `array(name)` (a view).

    The header is checked before any tensor is touched: its length against the file, its JSON
    nesting, and for every tensor a known dtype, a shape of non-negative integers, and
    `data_offsets` inside the data section that hold exactly shape x itemsize bytes, no two of
    them sharing bytes.
    `root`/`rel`: open `root/rel`, refusing names that leave `root` and symbolic links.
    """

    def __init__(self, path: str, *, root: str | None = None) -> None:
        self.path = path
        with _open(path, root, "safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise SafetensorsError(
                    f"{path}: header length {n} (the first 8 bytes) exceeds the file "
                    f"({size} bytes) or {MAX_HEADER}; not a safetensors file, or truncated"
                )
            raw = f.read(n)
            self.base = 8 + n
            try:
                self._mm = np.memmap(f, np.uint8, mode="r") if size > self.base else None
            except (OSError, MemoryError) as e:  # ENOMEM: the map exceeds the address space
                if isinstance(e, OSError) and e.errno != errno.ENOMEM:
                    raise
                raise HostMemoryError(
                    f"{path}: cannot map its {size >> 20} MiB into this process's address space "
                    f"({e}); raise the address-space limit (ulimit -v), or split the file"
                ) from e
        header: dict[str, Any] = _parse_header(path, raw)
        self.metadata = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict[str, Any]] = header
        if not isinstance(self.metadata, dict):
            raise SafetensorsError(
                f"{path}: __metadata__ must be an object, found {self.metadata!r:.60}"
            )
        data = size - self.base
        for name, h in self.header.items():
            _check_entry(path, name, h, data)
        _check_disjoint(path, self.header)

    @property
    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(DTYPES[self.header[name]["dtype"]])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.header[name]["shape"])

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy view of the mapped file."""
        b, e = self.header[name]["data_offsets"]
        if self._mm is None or e == b:
            return np.zeros(self.shape(name), self.dtype(name))
        return (
            self._mm[self.base + b : self.base + e].view(self.dtype(name)).reshape(self.shape(name))
        )


def _open(path: str, root: str | None, what: str) -> IO[bytes]:
    """`path` (the file the user named), or `root/<path relative to root>` confined to `root`."""
    try:
        if root is None:
            return open_regular(path, f"the {what}")  # the file the user named
        return open_inside(root, os.path.relpath(path, root), what)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot open the {what} ({e.strerror or e})") from e


def _parse_header(path: str, raw: bytes) -> dict[str, Any]:
    """The header JSON: an object, nested at most MAX_JSON_DEPTH deep (checked before parsing)."""
    header: dict[str, Any] = read_json(
        raw, f"{path}: header", max_bytes=MAX_HEADER, expect=dict, error=SafetensorsError
    )
    return header


def _check_entry(path: str, name: str, h: Any, data: int) -> None:
    """One tensor entry: a known dtype, a valid shape, offsets inside the data section."""
    what = f"{path}: tensor {name!r}"
    if not isinstance(h, dict) or not {"dtype", "shape", "data_offsets"} <= set(h):
        raise SafetensorsError(f"{what}: expected {{dtype, shape, data_offsets}}, found {h!r:.80}")
    code = h["dtype"]
    if not isinstance(code, str) or code not in DTYPES:
        raise SafetensorsError(f"{what}: unsupported dtype {code!r:.40}; known: {sorted(DTYPES)}")
    shape = as_shape(h["shape"], what, SafetensorsError)
    itemsize = np.dtype(DTYPES[code]).itemsize
    count = numel(shape, what, itemsize=itemsize, backing=data, backed_by="the data section")
    offs = h["data_offsets"]
    if not isinstance(offs, list) or len(offs) != 2:
        raise SafetensorsError(f"{what}: data_offsets must be [begin, end], found {offs!r:.60}")
    b = as_int(offs[0], f"{what}: data_offsets begin", SafetensorsError)
    e = as_int(offs[1], f"{what}: data_offsets end", SafetensorsError)
    if not b <= e <= data or e - b != count * itemsize:
        raise SafetensorsError(
            f"{what}: data_offsets [{b}, {e}] must lie in the data section [0, {data}] and hold "
            f"{count * itemsize} bytes (shape {list(shape)} x {itemsize} bytes of {code}); the "
            "file is damaged"
        )


def _check_disjoint(path: str, header: dict[str, dict[str, Any]]) -> None:
    """No two tensors share bytes (the safetensors library refuses such a file too): a tensor
    aliasing another's bytes would import as that tensor's values."""
    spans = sorted((h["data_offsets"][0], h["data_offsets"][1], n) for n, h in header.items())
    prev_end, prev = 0, None
    for b, e, name in spans:
        if b == e:
            continue
        if b < prev_end:
            raise SafetensorsError(
                f"{path}: tensors {prev!r} and {name!r} share bytes (data_offsets overlap at "
                f"{b}); the file is damaged or crafted, and the safetensors library refuses it too"
            )
        prev_end, prev = e, name


def _load_index(path: str, root: str | None) -> dict[str, str]:
    """The weight_map of a model.safetensors.index.json (inside `root` when given)."""
    with _open(path, root, "safetensors index") as f:
        raw = f.read(MAX_HEADER + 1)
    index = read_json(raw, f"{path}: the index", max_bytes=MAX_HEADER, error=SafetensorsError)
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise SafetensorsError(f"{path}: an index without a weight_map of tensor -> file name")
    return wmap


def open_tensors(src: Any) -> dict[str, SafetensorsFile]:
    """Tensor name -> its file, for a .safetensors file, an index.json, or a folder of either.

    Files named by an index or found in a folder must lie inside that folder (no `..`, no
    absolute paths, no symbolic links).
    """
    src = os.fspath(src)
    root = None
    if os.path.isdir(src):
        root = src
        if os.path.isfile(os.path.join(src, INDEX)):
            src = os.path.join(src, INDEX)
        else:
            names = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
            if not names:
                raise NotACheckpointError(f"{src}: no *.safetensors files and no {INDEX}")
            out: dict[str, SafetensorsFile] = {}
            for f in names:
                sf = SafetensorsFile(join_inside(src, f, "safetensors file"), root=src)
                for n in sf.names:
                    if n in out:
                        raise SafetensorsError(f"{src}: tensor {n!r} is in {f} and in another file")
                    out[n] = sf
            return out
    if not os.path.isfile(src):
        raise NotACheckpointError(f"{src}: no such file or directory")
    if src.endswith(".json"):
        wmap = _load_index(src, root)
        folder = os.path.dirname(src)
        files = {
            f: SafetensorsFile(join_inside(folder, f, f"{src}: weight_map file"), root=folder)
            for f in sorted(set(wmap.values()))
        }
        out = {}
        for n, f in wmap.items():
            if n not in files[f].header:
                raise SafetensorsError(f"{src}: the index puts {n!r} in {f}, which lacks it")
            out[n] = files[f]
        return out
    sf = SafetensorsFile(src)
    return dict.fromkeys(sf.names, sf)


__all__ = ["DTYPES", "INDEX", "SafetensorsError", "SafetensorsFile", "open_tensors"]
