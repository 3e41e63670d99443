"""The one reader of untrusted JSON: size, nesting depth and syntax checked before anything is used.

Manifests, safetensors headers and indexes, Hugging Face ``config.json``, Megatron's
``metadata.json`` and the ``zarr.json`` of stored arrays all come from files a checkpoint's
author controls. Each is read here, so that every one of them is bounded the same way: at most
``max_bytes`` bytes are read, the nesting depth is measured on the bytes *before* parsing (a
deeply nested text cannot exhaust Python's recursion), and a syntax error, a wrong top-level
type or an oversized text is an error of the caller's class naming the file.

>>> read_json(b'{"a": [1, 2]}', "example")
{'a': [1, 2]}
>>> read_json(b"[" * 100 + b"]" * 100, "example")
Traceback (most recent call last):
...
ucp_jax._src.errors.NotACheckpointError: example nests 100 levels deep, more than the 64 accepted; the file is damaged or hostile
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from ..errors import NotACheckpointError, UcpError, UnsafePathError
from .paths import open_regular

MAX_JSON_DEPTH = 64
MAX_JSON_BYTES = 1 << 30

_KIND = {dict: "object", list: "array", str: "string", int: "number", float: "number",
         bool: "boolean", type(None): "null"}  # fmt: skip
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")  # deleted before counting
_STEP = np.zeros(256, np.int64)  # +1 opens a level, -1 closes one
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(data: bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest (strings skipped), without parsing.

    >>> json_depth(b'{"a": [1, {"b": "[[["}]}')
    3
    """
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_STEP[np.frombuffer(brackets, np.uint8)]).max(initial=0))


class _DuplicateKey(Exception):
    """A JSON object names one key twice (args: the key)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict, refusing a repeated key: Python keeps the last, other
    readers the first or refuse (the safetensors library, by its offsets check), so a crafted
    file could mean one tensor to them and another to us."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def read_json(
    data: bytes | str,
    what: str,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    expect: type | None = None,
    error: type[UcpError] = NotACheckpointError,
) -> Any:
    """Parse an untrusted JSON text.

    Args:
        data: the text (bytes as read from a file, or str).
        what: names the file or field in errors (e.g. its path).
        max_bytes: the largest text accepted.
        max_depth: the deepest nesting of arrays and objects accepted.
        expect: the type the top-level value must have (e.g. `dict`), or None for any.
        error: the error class raised.

    Returns:
        The parsed value.

    Raises:
        UcpError: of class `error`: too large, nested too deep, not JSON, an object naming a
            key twice, or not an `expect`.
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise error(f"{what} is {len(raw)} bytes, more than the {max_bytes} accepted")
    # nesting is at most the count of opening brackets: most texts (a zarr.json) have fewer than
    # the limit, and need no scan that skips strings
    opening = raw.count(b"[") + raw.count(b"{")
    depth = json_depth(raw) if opening > max_depth else 0
    if depth > max_depth:
        raise error(
            f"{what} nests {depth} levels deep, more than the {max_depth} accepted; the file is "
            "damaged or hostile"
        )
    try:  # UTF-8, as JSON between systems must be (json.loads of bytes guesses UTF-16 or 32)
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not UTF-8 text ({e}); the file is damaged") from None
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise error(
            f"{what} names the key {e.args[0]!r:.80} twice in one object; readers disagree on "
            "which one counts (the file is damaged or crafted)"
        ) from None
    except (ValueError, RecursionError) as e:
        raise error(f"{what} is not valid JSON ({e}); the file is damaged") from e
    if expect is not None and not isinstance(value, expect):
        raise error(
            f"{what} is a JSON {_KIND.get(type(value), type(value).__name__)}, expected a JSON "
            f"{_KIND.get(expect, expect.__name__)}; the file is damaged"
        )
    return value


def read_json_file(
    path: str | os.PathLike[str],
    what: str,
    *,
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    expect: type | None = None,
    error: type[UcpError] = NotACheckpointError,
) -> Any:
    """`read_json` of a file, reading at most `max_bytes + 1` bytes (symbolic links refused).

    Raises:
        UcpError: of class `error`: unreadable, a symbolic link, or as `read_json`.
    """
    path = os.fspath(path)
    if os.path.islink(path):
        raise error(f"{path}: {what} is a symbolic link; a checkpoint's files must be its own")
    try:
        with open_regular(path, f"the {what}") as f:
            raw = f.read(max_bytes + 1)
    except UnsafePathError as e:
        raise error(str(e)) from e
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror or e})") from e
    return read_json(
        raw, f"{path} ({what})", max_bytes=max_bytes, max_depth=max_depth, expect=expect,
        error=error,
    )  # fmt: skip
