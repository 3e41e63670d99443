"""What a local folder at a checkpoint's path holds: a checkpoint's own entries, or an Orbax one's.

A save refuses a folder with anything else (someone's data); ``load_manifest`` says what a
folder without ``COMMIT`` is. ``metadata_bytes`` bounds the files TensorStore reads whole.
"""

from __future__ import annotations

import os
import re

from ..untrusted.json import MAX_JSON_BYTES
from .integrity import DIGEST_DIR
from .manifest import COMMIT, MANIFEST

PROCESS_PREFIX = "ocdbt.p"  # format version 3: each writing process's database, `ocdbt.p<k>/`
# the entries a save writes at a checkpoint's top: format version 3 (`d/`, `manifest.ocdbt`,
# `ocdbt.p<k>/`) and version 2 (`atoms/`), with either's digests
_OWN = frozenset({MANIFEST, COMMIT, "manifest.ocdbt", "d", "atoms", DIGEST_DIR})
_PROCESS_DB = re.compile(re.escape(PROCESS_PREFIX) + r"\d+")  # not Orbax's `ocdbt.process_0`
# Orbax's own files (its OCDBT `manifest.ocdbt` and `d/` are a version-3 checkpoint's names too)
# A Checkpointer writes `ORBAX_CHECKPOINT_METADATA` into the folder it saves: a manager's step
# folder, or an item saved alone (`ocp.Checkpointer(handler).save(path)`)
ORBAX_CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
_ORBAX_MARKS = (ORBAX_CHECKPOINT_METADATA, "_METADATA", "commit_success.txt")
MAX_ZARR_JSON_BYTES = 1 << 20  # an array's zarr.json (a few hundred bytes when ucp_jax writes it)
MAX_OCDBT_MANIFEST_BYTES = 64 << 20  # the root of a version-3 checkpoint's database


def checkpoint_entry(name: str) -> bool:
    """Whether a save writes an entry of this name at a checkpoint's top.

    >>> [checkpoint_entry(n) for n in ("ocdbt.p3", "atoms", "notes.txt", "ocdbt.process_0")]
    [True, True, False, False]
    """
    return name in _OWN or _PROCESS_DB.fullmatch(name) is not None


def orbax_mark(names: list[str]) -> str | None:
    """The entry that marks a folder's listing as an Orbax checkpoint (item or step), if any."""
    if MANIFEST in names:
        return None
    return next((m for m in _ORBAX_MARKS if m in names), None)


def listdir(path: str) -> list[str]:
    """The entries of a folder ([] when it cannot be listed)."""
    try:
        return os.listdir(path)
    except OSError:
        return []


def metadata_bytes(name: str) -> int | None:
    """The most a checkpoint file named `name` may hold when TensorStore reads it whole before
    any check of ours (an array's zarr.json, a fingerprint table, the OCDBT manifest); None for
    data files. A larger one is refused before TensorStore allocates it.

    >>> metadata_bytes("zarr.json"), metadata_bytes("0.0")
    (1048576, None)
    """
    if name == "zarr.json":
        return MAX_ZARR_JSON_BYTES
    if name == "manifest.ocdbt":
        return MAX_OCDBT_MANIFEST_BYTES
    return MAX_JSON_BYTES if name.endswith(".json") else None
