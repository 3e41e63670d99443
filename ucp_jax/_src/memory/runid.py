"""A job's names in shared memory: its namespace (from the persist folder) and its run id."""

from __future__ import annotations

import os
import struct
import time
import zlib
from typing import Any

import jax
import numpy as np


def default_namespace(directory: Any) -> str:
    """The namespace of a job persisting to `directory`: its base name and a hash of its path."""
    if directory is None:
        return "default"
    text = os.path.abspath(os.fspath(directory)) if "://" not in str(directory) else str(directory)
    stem = "".join(c if c.isalnum() or c in "-_" else "-" for c in os.path.basename(text))[:32]
    return f"{stem or 'ckpt'}-{zlib.crc32(text.encode()):08x}"


def agree_run_id() -> int:
    """A new run id, the same on every process (process 0's clock)."""
    run = time.time_ns()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        raw = np.frombuffer(struct.pack("<q", run), np.uint8)
        raw = np.asarray(multihost_utils.broadcast_one_to_all(raw), np.uint8)
        run = struct.unpack("<q", raw.tobytes())[0]
    return run


__all__ = ["agree_run_id", "default_namespace"]
