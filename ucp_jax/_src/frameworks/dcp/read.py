"""torch.distributed.checkpoint (DCP) folders -> atoms: FSDP2 / DTensor shards, any number of ranks.

A DCP folder holds `.metadata` (a pickle of torch's metadata dataclasses: global shape, dtype and
chunks of every tensor, and where each chunk is stored) and `__<rank>_<n>.distcp` files (each
chunk a `torch.save` blob, or raw bytes). The metadata is read with a restricted unpickler that
resolves only those dataclasses; each chunk is read weights-only and written to its box of the
atom, so no tensor is ever assembled in memory.

Names: model entries (`model.<param>` or `<param>`) become atoms with slot `fp32`; optimizer
entries `optim.state.<param>.<field>` (torch.distributed.checkpoint.state_dict's layout) become
slots of that atom (`exp_avg`, `exp_avg_sq`, `step`, ...). Non-tensor entries (hyperparameters,
a data loader's bytes) are kept in the manifest's source as JSON, and as the bytes they were read
as (base64, up to 64 MiB in all), which `export_dcp` writes back unchanged; tensors outside the
model prefix (`step`, a tensor `lr`, an RNG state) are atoms under their own names, written back
under them.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
from typing import Any

import torch

from ...errors import UcpError
from ...untrusted.lazy import jsonable
from ...untrusted.limits import ucp_errors
from ...untrusted.unpickle import loads
from ..common.dcp_files import (
    DCPFormatError,
    check_tensor,
    read_blob,
    read_chunk,
    read_metadata,
    read_tensor,
)
from ..common.progress import Progress
from ..common.torch_arrays import to_numpy
from ..common.writer import AtomWriter

log = logging.getLogger("ucp_jax")

# optimizer state under `optim.` / `optimizer.`, at the top or under a key of the user's own
# (torch's tutorial: {"app": {"model": ..., "optim": ...}} -> app.optim.state.<param>.<field>)
_OPTIM = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*?(?:optim|optimizer)\.state\.(?P<param>.+)\.(?P<field>[A-Za-z_]\w*)$"
)


MAX_BLOB_BYTES = 64 << 20  # non-tensor entries kept as their bytes (base64 in the manifest)


def _names(fqn: str, params: set[str], prefix: str) -> tuple[str, str]:
    """(atom, slot) of a DCP entry.

    Optimizer state is keyed by the model's own parameter name (``get_state_dict``), the model's
    entries by ``prefix`` + that name, so a parameter whose own name starts with the prefix (every
    Hugging Face ``*ForCausalLM``: ``model.layers...``) keeps it:

    >>> _names("optim.state.model.w.exp_avg", {"model.model.w"}, "model.")
    ('model.w', 'exp_avg')
    >>> _names("model.model.w", {"model.model.w"}, "model.")
    ('model.w', 'fp32')
    """
    m = _OPTIM.match(fqn)
    if m and prefix + m["param"] in params:
        return m["param"], m["field"]
    if m and m["param"] in params:  # keyed by the entry's full name
        p = m["param"]
        return (p[len(prefix) :] if prefix and p.startswith(prefix) else p), m["field"]
    if prefix and fqn.startswith(prefix):
        return fqn[len(prefix) :], "fp32"
    return fqn, "fp32"


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
    unprefixed: list[str] = []  # tensors outside the model (under no prefix): written back as such
    blobs: dict[str, str] = {}
    kept = 0  # bytes of them
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
                    if atom == fqn and slot == "fp32" and model_prefix:
                        unprefixed.append(fqn)
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
                w.release_sources()
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
                    if kept + len(blob) <= MAX_BLOB_BYTES:  # written back as they were
                        blobs[fqn] = base64.b64encode(blob).decode("ascii")
                        kept += len(blob)
                    else:
                        log.warning("%s: entry %r (%d bytes) not kept as it was (beyond %d MiB of "
                                    "non-tensor entries): an export writes its JSON form", folder,
                                    fqn, len(blob), MAX_BLOB_BYTES >> 20)  # fmt: skip
            if step is None and isinstance(objects.get("step"), int):
                step = objects["step"]
            if step is None and "step" in tensors and shapes["step"] == ():  # a tensor step
                value = float(read_tensor(folder, md, "step", DCPFormatError).item())
                step = int(value) if value.is_integer() and 0 <= value < 2**63 else None
            source = {"framework": "torch.distributed.checkpoint",
                      "dcp": {"path": os.path.abspath(folder), "objects": objects,
                              "blobs": blobs, "model_prefix": model_prefix,
                              "unprefixed": unprefixed}}  # fmt: skip
            json.dumps(source)
            return w.commit(step=step, source=source)
        finally:
            bar.stop()


__all__ = ["DCPFormatError", "import_dcp", "read_metadata"]
