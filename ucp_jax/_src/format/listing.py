"""The keys of many arrays of one database, from one listing instead of one listing per array.

A restore checks, for every array it reads, that no chunk is missing (a missing chunk would read
as zeros). Listing each array separately costs a walk of the database per array: 24 of the
206 ms of restoring a 274-array tree here. Where most of a checkpoint's arrays are wanted, one
listing of the range that holds them all is cut into each array's keys instead.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import tensorstore as ts

BATCH_MIN_ARRAYS = 8  # fewer arrays are listed one by one


def worth_batching(wanted: int, total: int) -> bool:
    """List `wanted` arrays of a database holding `total` in one go: enough of them, and at
    least half of what the listing would walk.

    >>> worth_batching(700, 732), worth_batching(3, 732), worth_batching(20, 732)
    (True, False, False)
    """
    return wanted >= BATCH_MIN_ARRAYS and 2 * wanted >= total


class BatchListing:
    """One listing of `kv` over the range that holds every array of `paths`, then each array's
    keys (relative to its folder, as listing the array's own kvstore gives them).

    >>> kv = ts.KvStore.open("memory://").result()
    >>> for k in ["a/x/c/0", "a/x/zarr.json", "a/xy/c/0", "b/c/1"]:
    ...     kv[k] = b"."
    >>> got = BatchListing(kv, ["a/x", "a/xy", "b"])
    >>> sorted(got.keys("a/x")), sorted(got.keys("b"))
    (['c/0', 'zarr.json'], ['c/1'])
    """

    def __init__(self, kv: Any, paths: Sequence[str]) -> None:
        lo = min(paths) + "/"
        hi = max(paths) + "0"  # "0" follows "/": past every key under the last folder
        self._future = kv.list(ts.KvStore.KeyRange(inclusive_min=lo, exclusive_max=hi))
        self._sorted: list[str] | None = None

    def keys(self, path: str) -> set[str]:
        """The keys under `path/`, without that prefix (waits for the listing)."""
        if self._sorted is None:
            self._sorted = sorted(k.decode() for k in self._future.result())
        start = path + "/"
        i = bisect.bisect_left(self._sorted, start)
        j = bisect.bisect_left(self._sorted, path + "0")
        return {k[len(start) :] for k in self._sorted[i:j]}
