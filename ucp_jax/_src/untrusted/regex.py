"""Regexes from a checkpoint (its manifest's rules), matched in time that grows with the names.

A rule recorded by a save is a Python regex the user wrote; read back from a checkpoint of
unknown origin it is untrusted, and Python's backtracking `re` takes exponential time on some
(`(a+)+$`) and high polynomial time on others (`(.*)(.*)(.*)x`) against a name the same
manifest chose: an open that never ends. Such regexes are compiled with RE2 (google-re2), whose
matching is linear in the name. A regex RE2 does not take (lookaround, backreferences) is used
with Python's `re` only when its shape cannot backtrack badly (`safe_shape`); otherwise it is
refused, naming the rule.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import PatternError

MAX_REGEX_CHARS = 2000

try:  # google-re2: linear-time matching
    import re2 as _re2

    _OPTIONS = _re2.Options()
    _OPTIONS.log_errors = False  # a regex it cannot take falls back below, quietly
except ImportError:  # pragma: no cover - a dependency; the shape check alone then
    _re2 = None


def compile_untrusted(regex: str, what: str) -> Any:
    """A compiled regex whose `fullmatch` (and the match's `expand`) runs in bounded time.

    Raises:
        PatternError: too long, not a valid regex, or one RE2 cannot take whose shape may
            backtrack without bound.

    >>> compile_untrusted(r"layers\\.(.*)", "rule").fullmatch("layers.w").expand(r"b.\\1")
    'b.w'
    >>> compile_untrusted(r"(a+)+$", "rule").fullmatch("a" * 5000 + "!") is None
    True
    """
    if not isinstance(regex, str) or len(regex) > MAX_REGEX_CHARS:
        raise PatternError(f"{what}: {regex!r:.80} is not a regex of at most {MAX_REGEX_CHARS} "
                           "characters")  # fmt: skip
    if _re2 is not None:
        try:
            return _re2.compile(regex, options=_OPTIONS)
        except Exception:  # RE2's own error type: Python's re decides below
            pass
    try:
        compiled = re.compile(regex)
    except re.error as e:
        raise PatternError(f"{what}: {regex!r} is not a valid regex ({e})") from e
    why = safe_shape(regex)
    if why is not None:
        raise PatternError(
            f"{what}: {regex!r} has {why}, which can take without bound to match a name this "
            "checkpoint chose; pass the rules yourself (rules=[...]) to restore it"
        )
    return compiled


_SINGLE = {"LITERAL", "NOT_LITERAL", "ANY", "IN", "CATEGORY"}
_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}


def safe_shape(regex: str) -> str | None:
    """Why a regex may backtrack without bound under Python's `re`, or None: a repeat of
    anything but one character class (`(a+)+`, `(a|ab)*`), a backreference, or more than two
    unbounded repeats (`(.*)(.*)(.*)x` is cubic in the name's length).

    >>> safe_shape(r"(.*)\\.layers\\.(\\d+)"), safe_shape(r"(?!x)(ab|a)+")
    (None, 'a repeat of a group')
    """
    from re import _parser  # type: ignore[attr-defined]  # re's own parser (Python >= 3.11)

    unbounded = 0

    def walk(seq: Any) -> str | None:
        nonlocal unbounded
        for op, av in seq:
            name = str(op)
            if name in _REPEATS:
                _, hi, body = av
                if hi <= 1:  # an optional part: what it holds counts
                    if r := walk(body):
                        return r
                    continue
                unbounded += 1
                items = list(body)
                if len(items) == 1 and str(items[0][0]) == "SUBPATTERN":
                    items = list(items[0][1][-1])
                if not all(str(o) in _SINGLE for o, _ in items):
                    return "a repeat of a group"
            elif name == "SUBPATTERN":
                if r := walk(av[-1]):
                    return r
            elif name == "BRANCH":
                for branch in av[1]:
                    if r := walk(branch):
                        return r
            elif name in ("ASSERT", "ASSERT_NOT"):
                if r := walk(av[1]):
                    return r
            elif name in ("GROUPREF", "GROUPREF_EXISTS"):
                return "a backreference"
        return None

    why = walk(_parser.parse(regex))
    if why is None and unbounded > 2:
        why = f"{unbounded} unbounded repeats"
    return why
