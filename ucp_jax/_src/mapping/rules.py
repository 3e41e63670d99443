"""Rules: `(regex, pattern or tuple of patterns)` pairs that say how leaves map to atoms."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..errors import PatternError
from ..untrusted.regex import compile_untrusted
from .pattern_json import chain_from_json, chain_to_json
from .patterns import PatternChain, as_chain
from .rename import Renamed as Renamed  # registered, so manifests that record it read back

Rule = tuple[str, Any]


class CompiledRules:
    """Rules compiled once; `match` gives the first rule that fully matches a name."""

    def __init__(self, rules: Sequence[Rule], *, untrusted: bool = False) -> None:
        """`untrusted`: regexes read from a checkpoint, matched in bounded time (RE2)."""
        self.rules: list[tuple[str, Any, PatternChain]] = []
        for i, rule in enumerate(rules):
            try:
                regex, pat = rule
            except (TypeError, ValueError):
                raise PatternError(
                    f"rule #{i} {rule!r} is not a (regex, pattern) pair; write (r'name\\.regex', "
                    "ucp.Fused(...)) or (regex, (pattern, pattern, ...))"
                ) from None
            if not isinstance(regex, str):
                raise PatternError(
                    f"rule #{i}: its regex {regex!r} is a {type(regex).__name__}; expected a "
                    "string (r'name\\.regex'; a compiled re.Pattern: pass its .pattern)"
                )
            if untrusted:
                compiled = compile_untrusted(regex, f"rule #{i}")
            else:
                try:
                    compiled = re.compile(regex)
                except re.error as e:
                    raise PatternError(f"rule #{i}: {regex!r} is not a valid regex ({e})") from e
            try:
                chain = as_chain(pat)
            except PatternError as e:
                raise PatternError(f"rule #{i} ({regex!r}): {e}") from None
            self.rules.append((regex, compiled, chain))
        self.used = [False] * len(self.rules)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def match(self, name: str) -> tuple[int | None, Any, PatternChain]:
        """(rule index, regex match, chain) of the first matching rule; (None, None, ()) if none."""
        for i, (_, rx, chain) in enumerate(self.rules):
            m = rx.fullmatch(name)
            if m is not None:
                self.used[i] = True
                return i, m, chain
        return None, None, ()

    def check_all_used(self, names: Sequence[str]) -> None:
        """Raise if a rule matched no leaf: it is almost always a typo in the regex."""
        unused = [self.rules[i][0] for i, u in enumerate(self.used) if not u]
        if unused:
            sample = ", ".join(repr(n) for n in list(names)[:8])
            raise PatternError(
                f"rule(s) {unused} matched no leaf; leaf names look like {sample}, ...; "
                "fix the regex (it is re.fullmatch'ed against the dotted leaf name)"
            )

    def to_json(self) -> list[list[Any]]:
        return [[regex, chain_to_json(chain)] for regex, _, chain in self.rules]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[Any]]) -> CompiledRules:
        rules: list[Rule] = [(regex, chain_from_json(chain)) for regex, chain in data]
        return cls(rules, untrusted=True)
