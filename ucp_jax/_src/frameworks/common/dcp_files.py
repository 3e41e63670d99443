"""Reading torch.distributed.checkpoint (DCP) folders, untrusted: metadata, chunks, whole tensors.

A DCP folder holds `.metadata` (a pickle of torch's metadata dataclasses: global shape, dtype and
chunks of every tensor, and where each chunk is stored) and `__<rank>_<n>.distcp` files (each
chunk a `torch.save` blob, or raw bytes). The metadata is read with a restricted unpickler that
resolves only those dataclasses; every offset, size and shape is checked before it is used. The
DCP importer, Megatron-Core's `torch_dist` importer (a DCP folder too) and any other DCP-based
format read through these functions.
"""

from __future__ import annotations

import enum
import math
import os
import pathlib
from typing import Any

import torch

from ...errors import NotACheckpointError, UcpError
from ...format.manifest import MANIFEST
from ...untrusted.limits import as_shape, check_range
from ...untrusted.paths import open_inside, refuse_symlinks
from ...untrusted.unpickle import load, load_pickle, loads, torch_value_globals


class DCPFormatError(UcpError, ValueError):
    """The folder is not a torch.distributed.checkpoint this importer understands."""


def _metadata_globals() -> dict[str, Any]:
    from torch.distributed.checkpoint import filesystem, metadata, planner

    out = torch_value_globals()
    # planner: Megatron-Core's save caches torch's own SavePlan / WriteItem dataclasses in it
    for mod in (metadata, filesystem, planner):
        for name in dir(mod):
            obj = getattr(mod, name)
            data = isinstance(obj, type) and (
                hasattr(obj, "__dataclass_fields__") or issubclass(obj, enum.Enum)
            )
            if data and obj.__module__ == mod.__name__:
                out[f"{obj.__module__}.{obj.__qualname__}"] = obj
    out["torch.serialization._get_layout"] = torch.serialization._get_layout
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.Path):
        out[f"pathlib.{cls.__name__}"] = cls
    return out


def read_metadata(folder: str) -> Any:
    """The DCP `Metadata` of a folder, read with the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(folder, ".metadata")
    if not os.path.exists(folder):
        raise NotACheckpointError(f"{folder}: does not exist")
    if not os.path.isfile(path):
        hint = ""
        if os.path.isfile(folder):
            hint = (" (a file: `ucp convert safetensors` reads .safetensors files, `ucp convert "
                    "deepspeed` DeepSpeed's folders)")  # fmt: skip
        elif os.path.exists(os.path.join(folder, MANIFEST)):
            hint = " (a ucp_jax checkpoint already: `ucp inspect` it, `ucp export dcp` writes DCP)"
        raise NotACheckpointError(
            f"{folder}: no .metadata file; not a torch.distributed.checkpoint{hint}"
        )
    md = load_pickle(refuse_symlinks(folder, ".metadata", "DCP metadata"), _metadata_globals())
    if not (
        isinstance(md, Metadata)
        and isinstance(md.state_dict_metadata, dict)
        and isinstance(md.storage_data, dict)
    ):
        raise DCPFormatError(
            f"{path}: expected torch's Metadata with state_dict_metadata and storage_data dicts, "
            f"found {type(md).__name__}"
        )
    return md


def read_blob(folder: str, info: Any, what: str) -> bytes:
    """The bytes a storage entry names: a file inside `folder` (no `..`, absolute path or link),
    and an offset and length inside that file."""
    rel = getattr(info, "relative_path", None)
    try:
        f = open_inside(folder, rel, f"{what}: relative_path")  # type: ignore[arg-type]
    except OSError as e:
        raise DCPFormatError(f"{folder}: {what}: cannot open {rel!r} ({e.strerror or e})") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        off, n = check_range(getattr(info, "offset", None), getattr(info, "length", None), size,
                             f"{folder}/{rel}: {what}", DCPFormatError)  # fmt: skip
        f.seek(off)
        return f.read(n)


def read_chunk(
    folder: str, info: Any, dtype: torch.dtype, sizes: tuple[int, ...], what: str
) -> Any:
    if getattr(info, "transform_descriptors", None):
        raise DCPFormatError(
            f"{folder}: chunk in {info.relative_path} uses transforms {info.transform_descriptors}"
            " (e.g. compression), which this importer does not read"
        )
    blob = read_blob(folder, info, what)
    if blob[:2] == b"PK":
        t = loads(blob, f"{info.relative_path}@{info.offset}")
        if not isinstance(t, torch.Tensor):
            raise DCPFormatError(f"{folder}: chunk at {info.offset} is not a tensor")
    else:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(blob) != math.prod(sizes) * itemsize:
            raise DCPFormatError(
                f"{folder}/{info.relative_path}: {what}: {len(blob)} bytes at {info.offset}, "
                f"expected {math.prod(sizes) * itemsize} (sizes {list(sizes)} of {dtype})"
            )
        t = torch.frombuffer(bytearray(blob), dtype=dtype)
    if t.numel() != math.prod(sizes):
        raise DCPFormatError(
            f"{folder}/{info.relative_path}: {what}: holds a tensor of shape {list(t.shape)}, "
            f"expected sizes {list(sizes)}"
        )
    return t.reshape(sizes)


def check_tensor(folder: str, fqn: str, meta: Any) -> tuple[int, ...]:
    """The global shape of a tensor entry, after checking its chunks lie inside it and cover it."""
    what = f"{folder}/.metadata: tensor {fqn!r}"
    if not isinstance(getattr(meta.properties, "dtype", None), torch.dtype):
        raise DCPFormatError(f"{what}: no torch dtype in its properties ({meta.properties!r:.80})")
    shape = as_shape(meta.size, what, DCPFormatError)
    covered = 0
    for chunk in meta.chunks:
        offs = as_shape(chunk.offsets, f"{what}: chunk offsets", DCPFormatError)
        sizes = as_shape(chunk.sizes, f"{what}: chunk sizes", DCPFormatError)
        if (
            len(offs) != len(shape)
            or len(sizes) != len(shape)
            or any(o + n > d for o, n, d in zip(offs, sizes, shape))
        ):
            raise DCPFormatError(
                f"{what}: chunk at {list(offs)} of sizes {list(sizes)} does not lie inside its "
                f"shape {list(shape)}"
            )
        covered += math.prod(sizes)
    if covered != math.prod(shape):
        raise DCPFormatError(
            f"{what}: its chunks hold {covered} elements, its shape {list(shape)} "
            f"{math.prod(shape)}; the metadata is damaged"
        )
    return shape


def read_tensor(
    folder: str, md: Any, fqn: str, error: type[UcpError] = DCPFormatError, lead: int | None = None
) -> torch.Tensor:
    """The global tensor `fqn` of a DCP folder, assembled from its chunks; with `lead`, only
    ``tensor[lead]`` (from the chunks that hold it: one layer of a stacked tensor)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta = md.state_dict_metadata[fqn]
    shape = check_tensor(folder, fqn, meta)
    if lead is not None and not (shape and 0 <= lead < shape[0]):
        raise error(f"{folder}: {fqn!r}: index {lead} outside its shape {list(shape)}")
    out = torch.empty(shape if lead is None else shape[1:], dtype=meta.properties.dtype)
    for chunk in meta.chunks:
        offs = tuple(int(o) for o in chunk.offsets)
        sizes = tuple(int(s) for s in chunk.sizes)
        if lead is not None and not offs[0] <= lead < offs[0] + sizes[0]:
            continue
        info = md.storage_data.get(MetadataIndex(fqn, torch.Size(offs)))
        if info is None:
            raise error(f"{folder}/.metadata: {fqn!r}: no storage for chunk {offs}")
        t = read_chunk(folder, info, meta.properties.dtype, sizes, f"{fqn!r} {offs}")
        if lead is not None:
            t, offs, sizes = t[lead - offs[0]], offs[1:], sizes[1:]
        out[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] = t
    return out


def per_row_chunks(md: Any, fqn: str) -> bool:
    """Whether every chunk of tensor `fqn` holds one index of its first axis (one layer)."""
    chunks = md.state_dict_metadata[fqn].chunks
    return bool(chunks) and all(len(c.sizes) > 1 and int(c.sizes[0]) == 1 for c in chunks)


def read_objects(folder: str, md: Any) -> dict[str, Any]:
    """Every bytes entry of the folder (common state, per-bucket maps, ...), unpickled with the
    allow-list, by name without its ``/shard_...`` suffix; plus ``common.pt`` if present."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    out: dict[str, Any] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(meta, BytesStorageMetadata) or "_extra_state" in fqn:
            continue
        info = md.storage_data.get(MetadataIndex(fqn))
        if info is None:
            continue
        value = loads(read_blob(folder, info, repr(fqn)), f"{folder}: {fqn}")
        if isinstance(value, list) and len(value) == 1:  # a ShardedObject of shape (1,)
            value = value[0]
        out.setdefault(fqn.split("/shard_")[0], value)
    common = os.path.join(folder, "common.pt")
    if os.path.isfile(common):
        out["common_state"] = load(common, mmap=False)
    return out
