"""Writing a torch.distributed.checkpoint (DCP) folder one tensor at a time (bounded memory).

torch's own writer (``dcp.save``, ``FileSystemWriter``, one process) plans from the state dict's
tensor metadata and asks the planner for each tensor's data only when it writes it, one at a time:
the state dict holds ``meta`` tensors (shape and dtype, no storage) and the planner reads each from
the universal checkpoint in ``resolve_data``. Memory is one tensor, whatever the model size. The
folder is written as ``<dst>.ucp-tmp`` and renamed into place: an error leaves nothing behind.
Every tensor is stored whole (its global shape): ``dcp.load`` reshards it to any world size.
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...errors import DestinationExistsError
from .progress import Progress


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """A tensor written when DCP asks for it: its shape, dtype and how to read it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True)
class RawBlob:
    """A non-tensor entry written back as the bytes it was read as (DCP stores such an entry as a
    `torch.save` blob): its value round-trips exactly, and nothing of it is unpickled here."""

    data: bytes


def write_dcp(
    dst: Any,
    entries: Mapping[str, Any],
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    what: str = "ucp export dcp",
) -> str:
    """Write ``entries`` (flat name -> :class:`LazyTensor`, tensor, :class:`RawBlob`, or a
    picklable object) as a DCP folder ``dst``; returns ``dst``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst) and not overwrite:
        raise DestinationExistsError(
            f"{dst} exists; pass overwrite=True (--overwrite) to replace it"
        )
    lazy = {k: v for k, v in entries.items() if isinstance(v, LazyTensor)}
    bar = Progress(progress, sum(v.nbytes for v in lazy.values()), what)

    raw = {k: v for k, v in entries.items() if isinstance(v, RawBlob)}

    class _Planner(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            if write_item.index.fqn in raw:
                return io.BytesIO(raw[write_item.index.fqn].data)
            item = lazy.get(write_item.index.fqn)
            if item is None:
                return super().resolve_data(write_item)
            t = item.load()
            if tuple(t.shape) != tuple(item.shape) or t.dtype != item.dtype:
                raise ValueError(
                    f"{what}: {write_item.index.fqn!r} read as {tuple(t.shape)} {t.dtype}, "
                    f"planned as {item.shape} {item.dtype}"
                )
            bar.advance(item.nbytes)
            return t.contiguous()

    sd = {k: (torch.empty(v.shape, dtype=v.dtype, device="meta") if isinstance(v, LazyTensor)
              else v) for k, v in entries.items()}  # fmt: skip
    tmp = dst + ".ucp-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1),
                 planner=_Planner(flatten_state_dict=False), no_dist=True)  # fmt: skip
        if os.path.exists(dst):
            shutil.rmtree(dst)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.stop()
    return dst
