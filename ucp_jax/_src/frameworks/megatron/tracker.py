"""Megatron-LM's checkpoint folder: ``<save>/iter_XXXXXXX/`` and the tracker file beside them.

Megatron-LM's ``--load DIR`` reads ``DIR/latest_checkpointed_iteration.txt`` (the iteration, or
``release``) and loads ``DIR/iter_<iteration, 7 digits>`` (or ``DIR/release``); without the
tracker it starts from random weights, with a warning only. The importer takes either folder; the
exporter writes the tracker when its destination is such an iteration folder.
"""

from __future__ import annotations

import os
import re

from ...errors import NotACheckpointError
from ...untrusted.paths import open_regular
from .common import BACKEND_FILE, MegatronFormatError

TRACKER = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"iter_(\d{7})")


def iteration_folder(folder: str) -> str:
    """The checkpoint folder to read: `folder`, or the iteration its tracker file names.

    Raises:
        NotACheckpointError: `folder` does not exist.
        MegatronFormatError: a tracker that names no iteration, or one whose folder is missing.
    """
    if not os.path.exists(folder):
        raise NotACheckpointError(f"{folder}: does not exist")
    tracker = os.path.join(folder, TRACKER)
    if os.path.exists(os.path.join(folder, BACKEND_FILE)) or not os.path.isfile(tracker):
        return folder
    with open_regular(tracker, "Megatron-LM's tracker file") as f:
        text = f.read(64).decode("ascii", "replace").strip()
    if text == "release":
        name = "release"
    elif text.isdecimal() and len(text) <= 12:
        name = f"iter_{int(text):07d}"
    else:
        raise MegatronFormatError(
            f"{tracker}: holds {text[:40]!r}; Megatron-LM writes an iteration number or 'release'"
        )
    chosen = os.path.join(folder, name)
    if not os.path.isdir(chosen):
        there = sorted(n for n in os.listdir(folder) if ITER_RE.fullmatch(n) or n == "release")
        raise MegatronFormatError(
            f"{tracker}: names iteration {text}, but {chosen} is missing (iteration folders "
            f"there: {there[:8] or 'none'}); pass the iteration folder to read"
        )
    return chosen


def write_tracker(dst: str) -> str | None:
    """Beside an export into ``<save>/iter_XXXXXXX``, point ``<save>``'s tracker file at it (so
    Megatron-LM's ``--load <save>`` loads it); returns the tracker's path, or None for another
    folder name (``dist_checkpointing.load`` reads any folder)."""
    m = ITER_RE.fullmatch(os.path.basename(os.path.normpath(dst)))
    if m is None:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(dst)), TRACKER)
    tmp = f"{path}.ucp-tmp"
    with open(tmp, "w") as f:
        f.write(str(int(m.group(1))))
    os.replace(tmp, path)
    return path
