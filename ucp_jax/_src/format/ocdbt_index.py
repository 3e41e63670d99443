"""Where the values of a local OCDBT database lie: key -> (data file, offset, length).

Format version 3 keeps every chunk (shard) of a checkpoint as a value of an OCDBT database, a
byte range of one of its data files. Readers that read those ranges themselves (format/direct.py)
and writers that fingerprint them (save.py, process tables) locate them here, by walking only the
B-tree nodes on the way to the wanted keys (`tensorstore.ocdbt.dump`, each node read once).
A value reference that is not a plain range of a file inside the folder is not located (None):
the caller reads that key through TensorStore.
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

import tensorstore as ts

_SAFE_PATH = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*/?$")


@dataclasses.dataclass(frozen=True)
class Extent:
    """The bytes of one stored shard: `length` bytes at `offset` of the file at `path`, or the
    bytes themselves (`inline`: a small value kept in an OCDBT B-tree node)."""

    path: str
    offset: int
    length: int
    inline: bytes | None = None


def _ocdbt_value(ref: str, folder: str) -> Extent | None:
    """'value:<base>:<file>:<offset>:<length>' -> the Extent (None: not a plain local range)."""
    parts = ref.split(":")
    if (
        len(parts) != 5
        or parts[0] != "value"
        or not parts[3].isdecimal()
        or not parts[4].isdecimal()
    ):
        return None
    rel = parts[1] + parts[2]
    if not _SAFE_PATH.match(rel) or ".." in rel.split("/"):
        return None
    return Extent(os.path.join(folder, rel), int(parts[3]), int(parts[4]))


class OcdbtIndex:
    """Keys of a local OCDBT database (format version 3) -> where their values lie.

    Only the B-tree nodes on the way to the wanted keys are read (each once).
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._base = ts.KvStore.open({"driver": "file", "path": folder.rstrip("/") + "/"}).result()
        self._root: tuple[str | None] | None = None
        self.found: dict[bytes, Extent | None] = {}

    def _root_location(self) -> str | None:
        if self._root is None:
            manifest = ts.ocdbt.dump(self._base).result()
            versions = manifest.get("versions") or []
            latest: dict[str, Any] = max(
                versions, key=lambda v: v.get("generation_number", 0), default={}
            )
            self._root = (latest.get("root", {}).get("location"),)
        return self._root[0]

    def locate(self, keys: Sequence[bytes]) -> None:
        """Find where the values of `keys` lie (`found[key]`: an Extent, one carrying the bytes
        of a value kept inline in its B-tree node, or None for an absent key)."""
        todo = sorted(k for k in set(keys) if k not in self.found)
        if not todo:
            return
        for k in todo:
            self.found[k] = None
        root = self._root_location()
        if root is not None:
            self._walk(root, b"", todo)

    def _walk(self, location: str, prefix: bytes, wanted: list[bytes]) -> None:
        node = ts.ocdbt.dump(self._base, location).result()
        entries = node.get("entries") or []
        if node.get("height", 0) == 0:
            for e in entries:
                key = prefix + bytes(e["key"])
                if key not in self.found:
                    continue
                ref, value = e.get("indirect_value"), e.get("inline_value")
                if isinstance(ref, str):
                    self.found[key] = _ocdbt_value(ref, self.folder)
                elif isinstance(value, bytes):
                    self.found[key] = Extent("", 0, len(value), value)
            return
        lows = [prefix + bytes(e["key"]) for e in entries]
        for i, e in enumerate(entries):
            lo = bisect.bisect_left(wanted, lows[i])
            hi = bisect.bisect_left(wanted, lows[i + 1]) if i + 1 < len(entries) else len(wanted)
            if lo < hi:
                sub = prefix + bytes(e.get("subtree_common_prefix", b""))
                self._walk(e["location"], sub, wanted[lo:hi])
