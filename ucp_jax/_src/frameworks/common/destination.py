"""Where an exporter writes: a local folder, never a URL taken for one."""

from __future__ import annotations

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
