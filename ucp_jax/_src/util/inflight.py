"""A bounded window of work in flight, counted in bytes: the one back-pressure of every stream.

Saves, restores, importers and read-ahead all follow one rule: start work, remember it with its
bytes, and once more than `budget` bytes are in flight, retire the oldest until under it again.
`InflightWindow` holds that rule; callers say what starting and retiring mean.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class InflightWindow(Generic[T]):
    """A FIFO of items in flight with their sizes, kept within `budget` bytes.

    `push` adds an item and hands back the oldest items that must now be retired (finished,
    waited on, yielded) to stay within the budget; `drain` hands back all the rest. An item is
    removed before it is handed back, so an error while retiring it never retires it twice.

    >>> w = InflightWindow(10)
    >>> list(w.push("a", 6)), list(w.push("b", 6)), list(w.drain())
    ([], ['a'], ['b'])
    """

    def __init__(self, budget: int) -> None:
        self.budget = max(int(budget), 1)
        self.pending = 0
        self._items: collections.deque[tuple[T, int]] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: T, nbytes: int) -> Iterator[T]:
        """Add `item` (of `nbytes`); yields the oldest items while more than the budget is in flight.

        Consume the iterator: items are retired as it is advanced.
        """
        self._items.append((item, int(nbytes)))
        self.pending += int(nbytes)
        while self._items and self.pending > self.budget:
            yield self._pop()

    def drain(self) -> Iterator[T]:
        """Yield every item still in flight, oldest first."""
        while self._items:
            yield self._pop()

    def _pop(self) -> T:
        item, n = self._items.popleft()
        self.pending -= n
        return item
