"""Non-tensor state of a snapshot (a data loader's position, metrics, ...), kept per process.

`SnapshotManager.snapshot(step, params, opt_state, extra=...)` takes JSON-able data or bytes
(e.g. grain's `get_state()`), which may differ per process. Each node keeps its own in its
snapshot's `index.json` (committed with it, so it always belongs to that step); a persisted
universal checkpoint gathers every process's into its manifest's `extra`
(`{"source": "ucp.memory", "process_extra": [per process]}`). A restore gives each process
its own back as `mgr.restored.extra`, from memory or from the persisted checkpoint.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

_BYTES = "__ucp_bytes__"


def encode(extra: Any) -> Any:
    """`extra` as JSON data (bytes as base64), checked to serialise.

    >>> encode(b"\\x00\\x01"), encode({"epoch": 1})
    ({'__ucp_bytes__': 'AAE='}, {'epoch': 1})
    """
    if isinstance(extra, bytes | bytearray | memoryview):
        return {_BYTES: base64.b64encode(bytes(extra)).decode()}
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"snapshot: extra must be JSON-serialisable or bytes ({e}); pass plain data, or "
            "the bytes of a data loader's state"
        ) from e
    return extra


def decode(obj: Any) -> Any:
    """The inverse of `encode`.

    >>> decode(encode(b"state"))
    b'state'
    """
    if isinstance(obj, dict) and set(obj) == {_BYTES}:
        return base64.b64decode(obj[_BYTES])
    return obj


def from_snapshot(path: Path | None) -> Any:
    """This node's extra of a committed snapshot folder (None when it has none)."""
    if path is None:
        return None
    from .shm import INDEX

    try:
        return decode(json.loads((path / INDEX).read_bytes()).get("extra"))
    except (OSError, ValueError, AttributeError):
        return None


def manifest_extra(encoded: list[Any]) -> dict[str, Any]:
    """The persisted manifest's `extra`, from every process's encoded extra."""
    out: dict[str, Any] = {"source": "ucp.memory"}
    if any(e is not None for e in encoded):
        out["process_extra"] = encoded
    return out


def from_manifest(extra: Any, node: int) -> Any:
    """Process `node`'s extra from a persisted checkpoint's manifest `extra`."""
    per = extra.get("process_extra") if isinstance(extra, dict) else None
    if not isinstance(per, list) or node >= len(per):
        return None
    return decode(per[node])


__all__ = ["decode", "encode", "from_manifest", "from_snapshot", "manifest_extra"]
