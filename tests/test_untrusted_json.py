"""Untrusted JSON (untrusted/json.py): the nesting limit holds at its boundary, whichever way the
depth is found (the bracket count that lets most texts skip the scan, or the scan itself)."""

from __future__ import annotations

import json

import pytest

from ucp_jax._src.errors import NotACheckpointError
from ucp_jax._src.untrusted.json import MAX_JSON_DEPTH, json_depth, read_json


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [1, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH])
def test_depth_up_to_the_limit_is_read(depth: int) -> None:
    assert json_depth(_nested(depth)) == depth
    assert read_json(_nested(depth), "x") == json.loads(_nested(depth))


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000])
def test_deeper_is_refused(depth: int) -> None:
    with pytest.raises(NotACheckpointError, match=f"nests {depth} levels"):
        read_json(_nested(depth), "x")


def test_brackets_inside_strings_do_not_count() -> None:
    """Many brackets, all in strings or side by side: the scan runs and finds the true depth."""
    text = json.dumps({"s": "[" * 500, "a": [[1], [2]] * 100}).encode()
    assert json_depth(text) == 3
    assert read_json(text, "x", expect=dict)["s"] == "[" * 500


def test_a_deep_value_among_many_brackets_is_refused() -> None:
    text = b'{"a": [' + b"[1]," * 200 + _nested(MAX_JSON_DEPTH) + b"]}"
    with pytest.raises(NotACheckpointError, match=f"nests {MAX_JSON_DEPTH + 2} levels"):
        read_json(text, "x")


@pytest.mark.parametrize(
    "data",
    [
        '{"a": 1}'.encode("utf-16-le"),  # json.loads of bytes guessed this and read it
        '{"a": 1}'.encode("utf-32"),
        b'{"a": "\xff"}',  # not UTF-8 at all
    ],
    ids=["utf-16-le", "utf-32", "latin-1"],
)
def test_only_utf8_is_read(data: bytes) -> None:
    # JSON between systems is UTF-8 (RFC 8259), as transformers and safetensors read it
    # (UTF-16 of ASCII is UTF-8 with NULs between: then not JSON)
    with pytest.raises(NotACheckpointError, match=r"^x is not (UTF-8 text|valid JSON) \("):
        read_json(data, "x")
    assert read_json('{"a": "é"}'.encode(), "x") == {"a": "é"}


@pytest.mark.parametrize("text", [b'{"a": 1, "a": 2}', b'[{"k": {"a": 1, "b": 2, "a": 1}}]'])
def test_a_key_named_twice_in_one_object_is_refused(text: bytes) -> None:
    """Readers disagree on which of two equal keys counts (Python keeps the last), so a file
    naming one twice is refused: it could mean one thing to its author's tools, another here."""
    with pytest.raises(NotACheckpointError, match="names the key 'a' twice"):
        read_json(text, "x")
    assert read_json(b'{"a": {"a": 1}, "b": [{"a": 2}]}', "x") == {"a": {"a": 1}, "b": [{"a": 2}]}
