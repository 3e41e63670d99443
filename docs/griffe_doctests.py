"""A griffe extension for the API reference: doctest blocks in docstrings rendered as code.

The library's docstrings carry their examples as plain doctest blocks (``>>> ...`` lines, run by
``pytest --doctest-modules``), mostly outside an ``Examples:`` section. Markdown would read those
lines as text (``x["a"]["b"]`` even as a reference link), so each block that starts at the left
margin is wrapped in a ``pycon`` fence before the docstring is parsed. Blocks inside a section
(indented) are left to griffe's own Examples parsing. Only the rendered documentation changes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_FLAGS = re.compile(r"\s*#\s*doctest:.*$")  # `# doctest: +SKIP` says how to test, not what to do


def fence_doctests(text: str) -> str:
    """Wrap every unindented doctest block (up to the next blank line) in a pycon fence.

    Doctest directives (``# doctest: +SKIP``) are dropped from the rendered lines.

    >>> fence_doctests("Text.\\n>>> 1 + 1  # doctest: +SKIP\\n2").splitlines()
    ['Text.', '', '```pycon', '>>> 1 + 1', '2', '```']
    """
    out: list[str] = []
    in_fence = in_block = False
    for line in text.split("\n"):
        if in_block and not line.strip():
            out.append("```")
            in_block = False
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and not in_block and line.startswith(">>>"):
            if out and out[-1].strip():
                out.append("")
            out.append("```pycon")
            in_block = True
        out.append(_FLAGS.sub("", line) if in_block else line)
    if in_block:
        out.append("```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the doctest blocks of every docstring griffe loads."""

    def on_object(self, *, obj: Any, **kwargs: Any) -> None:
        """Rewrite the object's docstring before mkdocstrings parses it."""
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        """The same for the package itself (`on_object` visits its members, not the root)."""
        self.on_object(obj=pkg)
