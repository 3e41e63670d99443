"""Host buffers onto devices, directly or staged through pinned host memory, within a budget.

On a CPU device a host buffer becomes the device buffer (64-byte aligned: no copy). On an
accelerator, a transfer from pageable memory is staged by the runtime through a bounce buffer; a
transfer from pinned memory is one DMA. With staging on (`UCP_STAGING`, see `util.config`), each
array is built in the devices' `pinned_host` memory (one host copy, into pinned pages) and then
moved to device memory asynchronously, so the DMA of one leaf overlaps the reads and copies of the
next; at most `budget` bytes of pinned staging are held, the oldest transfers waited for first.

>>> import numpy as np, jax
>>> from jax.sharding import SingleDeviceSharding
>>> placer = Placer(budget=1 << 20, mode="pinned_host")
>>> a = placer.place((2,), SingleDeviceSharding(jax.devices()[0]), lambda i: np.ones(2), np.float64)
>>> placer.finish(); (a.sharding.memory_kind, float(a.sum()))
('device', 2.0)
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from .util import config

PINNED = "pinned_host"


def staging_memory(sharding: Any, mode: str | None = None) -> str | None:
    """The memory kind to stage a placement onto `sharding` through, or None (place directly).

    Args:
        sharding: the target sharding.
        mode: 'auto', 'pinned_host' or 'none' (default: `UCP_STAGING`).
    """
    mode = config.staging() if mode is None else mode
    if mode == "none" or sharding.memory_kind not in (None, "device"):
        return None  # a host-memory target is placed as it is
    devices = list(sharding.addressable_devices)
    if not devices:
        return None
    if mode == "auto" and devices[0].platform == "cpu":
        return None
    try:
        kinds = {m.kind for m in devices[0].addressable_memories()}
    except Exception:  # a runtime without memory spaces
        return None
    return PINNED if PINNED in kinds else None


def host_staging(device: Any) -> SingleDeviceSharding | None:
    """Where copies of `device`'s data to host go: its pinned host memory where staging is on
    for it (`staging_memory`: one DMA each), else None (a copy to pageable host memory).

    >>> import jax
    >>> host_staging(jax.devices()[0]) is None  # CPU devices, UCP_STAGING=auto
    True
    """
    kind = staging_memory(SingleDeviceSharding(device))
    return None if kind is None else SingleDeviceSharding(device, memory_kind=kind)


class Placer:
    """Places arrays from host buffers, staging through pinned memory within a byte budget.

    Args:
        budget: bytes of pinned staging held at most (at least one array's worth is always let
            through).
        mode: 'auto', 'pinned_host' or 'none' (default: `UCP_STAGING`).
    """

    def __init__(self, budget: int, mode: str | None = None) -> None:
        self.budget = max(int(budget), 1)
        self.mode = config.staging() if mode is None else mode
        self._pending: collections.deque[tuple[jax.Array, int]] = collections.deque()
        self._held = 0
        self.staged_bytes = 0

    def in_place(self, sharding: Any) -> bool:
        """Placing onto `sharding` takes the host buffers as the device buffers (CPU devices, no
        staging): it moves no data, so it may wait until the host buffers are all filled."""
        return staging_memory(sharding, self.mode) is None and all(
            d.platform == "cpu" for d in sharding.addressable_devices
        )

    def place(
        self,
        shape: tuple[int, ...],
        sharding: Any,
        host_of: Callable[[Any], np.ndarray],
        dtype: Any,
    ) -> jax.Array:
        """The global array of `shape` and `dtype` on `sharding`, each shard from
        `host_of(index)` (none where the sharding has no device of this process: a pipeline
        stage's leaf on another process's devices; JAX then needs the dtype)."""
        kind = staging_memory(sharding, self.mode)
        if kind is None:
            return jax.make_array_from_callback(shape, sharding, host_of, dtype=dtype)
        staged = jax.make_array_from_callback(
            shape, sharding.with_memory_kind(kind), host_of, dtype=dtype
        )
        out = jax.device_put(staged, sharding.with_memory_kind("device"))
        nbytes = sum(s.data.nbytes for s in staged.addressable_shards)
        self.staged_bytes += nbytes
        self._pending.append((out, nbytes))
        self._held += nbytes
        while self._held > self.budget and len(self._pending) > 1:
            done, n = self._pending.popleft()
            done.block_until_ready()  # its pinned source is released with it
            self._held -= n
        return out

    def finish(self) -> None:
        """Wait for every staged transfer (their pinned buffers are then released)."""
        while self._pending:
            done, n = self._pending.popleft()
            done.block_until_ready()
            self._held -= n
