"""torch.distributed.checkpoint (DCP) folders -> atoms: FSDP2 / DTensor shards, any number of ranks.

A DCP folder holds `.metadata` (a pickle of torch's metadata dataclasses: global shape, dtype and
chunks of every tensor, and where each chunk is stored) and `__<rank>_<n>.distcp` files (each
chunk a `torch.save` blob, or raw bytes). The metadata is read with a restricted unpickler that
resolves only those dataclasses; each chunk is read weights-only and written to its box of the
atom, so no tensor is ever assembled in memory.

Names: model entries (`model.<param>` or `<param>`) become atoms with slot `fp32`; optimizer
entries `optim.state.<param>.<field>` (torch.distributed.checkpoint.state_dict's layout) become
slots of that atom (`exp_avg`, `exp_avg_sq`, `step`, ...). Non-tensor entries (hyperparameters)
are kept in the manifest's source as JSON.
"""

from __future__ import annotations

import enum
import json
import math
import os
import pathlib
import re
from typing import Any

import torch

from ..errors import NotACheckpointError, UcpError
from ..format.paths import open_inside, refuse_symlinks
from .lazy import jsonable
from .limits import as_shape, check_range, ucp_errors
from .progress import Progress
from .unpickle import load_pickle, loads, torch_value_globals
from .writer import AtomWriter, to_numpy

_OPTIM = re.compile(r"^(?:optim|optimizer)\.state\.(?P<param>.+)\.(?P<field>[A-Za-z_][\w]*)$")


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
    if not os.path.isfile(path):
        raise NotACheckpointError(
            f"{folder}: no .metadata file; not a torch.distributed.checkpoint"
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


def _names(fqn: str, params: set[str], prefix: str) -> tuple[str, str]:
    """(atom, slot) of a DCP entry."""
    m = _OPTIM.match(fqn)
    if m and (m["param"] in params or prefix + m["param"] in params):
        p = m["param"]
        atom = p[len(prefix) :] if prefix and p.startswith(prefix) else p
        return atom, m["field"]
    if prefix and fqn.startswith(prefix):
        return fqn[len(prefix) :], "fp32"
    return fqn, "fp32"


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


@ucp_errors(DCPFormatError, "import_dcp")
def import_dcp(
    src: Any,
    dst: Any,
    *,
    model_prefix: str = "model.",
    overwrite: bool = False,
    progress: bool | None = None,
    step: int | None = None,
) -> str:
    """Import a torch.distributed.checkpoint folder (e.g. written by FSDP2) as universal atoms.

    Args:
        src: the DCP folder (with `.metadata`).
        dst: where to write the universal checkpoint.
        model_prefix: prefix of model entries, stripped from atom names ("model." as written by
            `{"model": model_state, "optim": optim_state}`); entries without it keep their name.
        overwrite: replace an existing checkpoint at `dst`.
        progress: show a progress bar (default: when stderr is a terminal).
        step: the training step to record (default: a top-level integer entry `step`, if any).

    Returns:
        The location of the written checkpoint.
    """
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    folder = os.fspath(src)
    md = read_metadata(folder)
    entries = md.state_dict_metadata
    tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
    params = {k for k in tensors if not _OPTIM.match(k)}
    objects: dict[str, Any] = {}
    shapes = {k: check_tensor(folder, k, v) for k, v in tensors.items()}
    total = sum(
        math.prod(shapes[k]) * torch.empty((), dtype=v.properties.dtype).element_size()
        for k, v in tensors.items()
    )
    bar = Progress(progress, total, "ucp import")
    with AtomWriter(dst, overwrite=overwrite) as w:
        try:
            # parameters first, so optimizer slots know their atom's shape
            order = sorted(tensors, key=lambda k: (k not in params, k))
            for fqn in order:
                meta = tensors[fqn]
                atom, slot = _names(fqn, params, model_prefix)
                shape = shapes[fqn]
                if atom not in w.atoms:
                    w.atom(atom, shape)
                own = None if shape == w.atoms[atom]["shape"] else shape
                w.array(atom, slot, to_numpy(torch.empty((), dtype=meta.properties.dtype)).dtype,
                        slot_shape=own)  # fmt: skip
                for chunk in meta.chunks:
                    offs = tuple(int(o) for o in chunk.offsets)
                    sizes = tuple(int(s) for s in chunk.sizes)
                    info = md.storage_data.get(MetadataIndex(fqn, torch.Size(offs)))
                    if info is None:
                        raise DCPFormatError(
                            f"{folder}/.metadata: {fqn!r}: no storage entry for the chunk at {offs}"
                        )
                    t = read_chunk(folder, info, meta.properties.dtype, sizes, f"{fqn!r} {offs}")
                    box = tuple((o, o + s) for o, s in zip(offs, sizes))
                    w.write(atom, slot, box, to_numpy(t.reshape(sizes)), keep=t)
                    bar.advance(t.numel() * t.element_size())
                w.flush()
            for fqn, meta in entries.items():
                if isinstance(meta, BytesStorageMetadata):
                    info = md.storage_data.get(MetadataIndex(fqn))
                    if info is None:
                        continue
                    blob = read_blob(folder, info, repr(fqn))
                    try:
                        objects[fqn] = jsonable(loads(blob, fqn))
                    except UcpError as e:
                        objects[fqn] = f"<not loaded: {e}>"
            if step is None and isinstance(objects.get("step"), int):
                step = objects["step"]
            source = {"framework": "torch.distributed.checkpoint",
                      "dcp": {"path": os.path.abspath(folder), "objects": objects}}  # fmt: skip
            json.dumps(source)
            return w.commit(step=step, source=source)
        finally:
            bar.stop()


__all__ = ["DCPFormatError", "import_dcp", "read_metadata"]
