"""Where an exporter writes: a local folder, never a URL taken for one."""

from __future__ import annotations

import os
from typing import Any

from ...errors import ArgumentError


def not_local(path: Any) -> bool:
    """Whether `path` names a store, not a local folder: a URL other than ``file://``, or a
    kvstore spec.

    >>> not_local("gs://b/x"), not_local("file:///x"), not_local("/x")
    (True, False, False)
    """
    return isinstance(path, dict) or (isinstance(path, str) and "://" in path
                                      and not path.startswith("file://"))  # fmt: skip


def local_destination(dst: Any, what: str) -> Any:
    """`dst` as the local folder an exporter writes (``file://`` taken off).

    Exporters write through the filesystem (the trainer that loads the folder reads it so): an
    ``s3://`` or ``gs://`` URL given to one would become a local folder named ``s3:``, and the
    export would report success with nothing in the bucket.

    Raises:
        ArgumentError: a URL of another scheme, or a kvstore spec.

    >>> local_destination("file:///tmp/hf", "the model folder")
    '/tmp/hf'
    >>> local_destination("s3://bucket/hf", "the model folder")
    Traceback (most recent call last):
    ...
    ucp_jax._src.errors.ArgumentError: s3://bucket/hf: the model folder is written to a local folder (it is written through the filesystem, as the trainer reads it); write it locally and copy it to the store (universal checkpoints themselves go to s3:// and gs:// directly)
    """
    if not_local(dst):
        raise ArgumentError(
            f"{str(dst)[:200]}: {what} is written to a local folder (it is written through the "
            "filesystem, as the trainer reads it); write it locally and copy it to the store "
            "(universal checkpoints themselves go to s3:// and gs:// directly)"
        )
    if isinstance(dst, str) and dst.startswith("file://"):
        return dst[len("file://") :]
    return dst


def not_over_source(dst: Any, source: str | None, what: str) -> None:
    """Refuse an export into the folder of the checkpoint it reads, into a folder that holds
    it, or into one inside it: an export replaces its folder (``overwrite``), which would delete
    the checkpoint, or puts files into it that no save wrote.

    Args:
        dst: the export's destination (a local path; URLs and specs are not checked here).
        source: the local folder of the checkpoint read (None: not local).
        what: names the export's folder in the message.

    Raises:
        ArgumentError: they overlap.

    >>> not_over_source("/runs/exports/hf", "/runs/ckpt/step_2", "the model folder")
    >>> not_over_source("/runs/ckpt", "/runs/ckpt/step_2", "the model folder")
    Traceback (most recent call last):
    ...
    ucp_jax._src.errors.ArgumentError: /runs/ckpt: the model folder would hold the checkpoint it is exported from (/runs/ckpt/step_2), which writing it replaces; export to a folder outside it
    """
    if source is None or not_local(dst):
        return
    out = os.path.realpath(os.fspath(local_destination(dst, what)))  # (file:// taken off)
    here = os.path.realpath(source)
    if out == here or here.startswith(out + os.sep):
        how = "be" if out == here else "hold"
        raise ArgumentError(
            f"{dst}: {what} would {how} the checkpoint it is exported from ({source}), which "
            "writing it replaces; export to a folder outside it"
        )
    if out.startswith(here + os.sep):
        raise ArgumentError(
            f"{dst}: {what} would lie inside the checkpoint it is exported from ({source}); "
            "export to a folder outside it"
        )
