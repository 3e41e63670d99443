"""Where an exporter writes: a local folder, never a URL taken for one."""

from __future__ import annotations

from typing import Any

from ...errors import ArgumentError


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
    if isinstance(dst, dict) or (isinstance(dst, str) and "://" in dst
                                 and not dst.startswith("file://")):  # fmt: skip
        raise ArgumentError(
            f"{str(dst)[:200]}: {what} is written to a local folder (it is written through the "
            "filesystem, as the trainer reads it); write it locally and copy it to the store "
            "(universal checkpoints themselves go to s3:// and gs:// directly)"
        )
    if isinstance(dst, str) and dst.startswith("file://"):
        return dst[len("file://") :]
    return dst
