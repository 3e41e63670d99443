"""The `ucp` command's text: sizes, paths, and names from a checkpoint printed safely."""

from __future__ import annotations

import contextlib
from typing import Any

from ..format import store


def mib(n: int) -> str:
    """Bytes as MiB with two decimals.

    >>> mib(3 << 19)
    '1.50'
    """
    return f"{n / 2**20:.2f}"


def printable(text: str) -> str:
    r"""`text` with every character that is not printable (control characters such as ESC, BEL,
    NUL and newline, bidi overrides, line separators) escaped as repr() shows it (`\x1b`, `\n`,
    `\u202e`); printable unicode stays as it is.

    Names read from a checkpoint (atoms, slots, patterns, sources, keys of an object store) are
    untrusted: printed raw, a crafted one could retitle, clear or rewrite the terminal.

    >>> printable("w\x1b]0;title\x07"), printable("größe.kernel")
    ('w\\x1b]0;title\\x07', 'größe.kernel')
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def path_forms(path: Any) -> tuple[str, ...]:
    """The ways a message may name `path`: as given, and as a location (a local one absolute)."""
    forms = [str(path)]
    with contextlib.suppress(Exception):  # an unparsable path: as given only
        forms.append(store.Location.parse(path).url)
    return tuple(forms)
