"""`Renamed`: the leaf is an atom of another name (a renamed module), and nothing else changes."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .pattern_json import register_pattern
from .patterns import LeafContext, Node, Pattern, expand_template


@register_pattern
@dataclasses.dataclass(frozen=True)
class Renamed(Pattern):
    """The leaf is the atom `atom` (a name template expanded with the rule's regex groups, `\\1`).

    What `ucp.plan` suggests when a module was renamed:
    `(r"encoder\\.dense\\.(.*)", ucp.Renamed(r"encoder.linear.\\1"))`.

    >>> Renamed(r"encoder.linear.\\1").to_json()
    {'type': 'Renamed', 'atom': 'encoder.linear.\\\\1'}
    """

    atom: str = ""
    kind: ClassVar[str] = "Renamed"

    def split(self, node: Node, ctx: LeafContext) -> list[Node]:
        return [dataclasses.replace(node, name=expand_template(self.atom, ctx, node.env))]


__all__ = ["Renamed"]
