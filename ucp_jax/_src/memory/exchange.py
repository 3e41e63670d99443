"""Restores across machines: agree on what every process sees, and move blob bytes between them.

On a cluster each machine sees only its own shared memory: a restarted process finds the node
folders of the processes that ran on its machine, and a replacement machine finds none. A
restore therefore

1. gathers every process's *inventory* (the committed snapshots it can see) and publishes the
   layouts it holds, through the coordination service's key-value store (small JSON, no
   compile), so that every process picks the same step from the union of what all of them see;
2. plans, per process, the byte ranges of node blobs it needs but cannot see, each to be served
   by the lowest process that sees that node (ranges of one node merged when adjacent);
3. gathers every process's requests, and moves the bytes with one `lax.ppermute` per ring shift
   that carries any (one device per process, uint8 buffers padded to the shift's largest send).

When every process sees every blob it needs (one machine, or a restart on the same machines)
nothing is requested and no collective runs.
"""

from __future__ import annotations

import base64
import bisect
import functools
import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..util import config
from ..util.sync import barrier, coordination_client

Request = tuple[int, int, int, int]  # (node, serving process, blob offset, nbytes)


def allgather_json(obj: Any, tag: str) -> list[Any]:
    """Every process's `obj`, through the coordination service's key-value store (no compile).

    Each process publishes its own, waits at a barrier, then reads all of them in one request
    (a directory read of `tag/`): three round trips per process whatever the job's size, not one
    per process (at 2k processes, 2k round trips each).
    """
    n = jax.process_count()
    if n == 1:
        return [obj]
    publish_text(f"{tag}/{jax.process_index()}", json.dumps(obj))
    barrier(f"{tag}/published")
    found = dict(coordination_client().key_value_dir_get(f"{tag}/"))
    return [
        json.loads(_decode(found[k]) if (k := f"{tag}/{i}") in found else get_text(k))
        for i in range(n)
    ]


def publish_text(key: str, text: str) -> None:
    """Put `text` under `key` for the other processes (no-op in a single-process job).

    Compressed: layouts of large models run to megabytes of JSON, more than a coordination
    service message should carry.
    """
    if jax.process_count() > 1:
        coordination_client().key_value_set(
            key, base64.b64encode(zlib.compress(text.encode(), 6)).decode()
        )


def get_text(key: str, timeout_s: float | None = None) -> str:
    """The text another process published under `key` with `publish_text` (waits for it, up to
    `timeout_s`, default `UCP_BARRIER_TIMEOUT_S`; then the coordination client raises)."""
    timeout_ms = max(
        1, int((config.barrier_timeout_s() if timeout_s is None else timeout_s) * 1000)
    )
    return _decode(coordination_client().blocking_key_value_get(key, timeout_ms))


def _decode(raw: str) -> str:
    return zlib.decompress(base64.b64decode(raw)).decode()


def merge(ranges: Sequence[tuple[int, int, int, int]]) -> list[Request]:
    """Sort requests and merge those of one node and server that touch or overlap."""
    out: list[list[int]] = []
    for node, src, off, n in sorted(set(ranges)):
        last = out[-1] if out else None
        if last and last[0] == node and last[1] == src and off <= last[2] + last[3]:
            last[3] = max(last[3], off + n - last[2])
        else:
            out.append([node, src, off, n])
    return [(a, b, c, d) for a, b, c, d in out]


class Fetched:
    """Byte ranges of one node's blob received from another process; `view` like a Blob."""

    def __init__(self, node: int) -> None:
        self.node = node
        self._starts: list[int] = []
        self._data: list[np.ndarray] = []

    def add(self, offset: int, data: np.ndarray) -> None:
        i = bisect.bisect(self._starts, offset)
        self._starts.insert(i, offset)
        self._data.insert(i, data)

    def covers(self, offset: int, nbytes: int) -> bool:
        i = bisect.bisect(self._starts, offset) - 1
        return i >= 0 and offset + nbytes <= self._starts[i] + self._data[i].size

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """Bytes [offset, offset + nbytes) (no copy); they must lie in one received range."""
        i = bisect.bisect(self._starts, offset) - 1
        if i < 0 or not self.covers(offset, nbytes):
            raise RuntimeError(
                f"ucp.memory restore: bytes [{offset}, {offset + nbytes}) of node {self.node} "
                "were not fetched (an internal planning error; please report it)"
            )
        a = offset - self._starts[i]
        return self._data[i][a : a + nbytes]

    @property
    def nbytes(self) -> int:
        return sum(d.size for d in self._data)


def fetch(
    mine: Sequence[Request],
    read_local: Callable[[int, int, int], np.ndarray],
    tag: str,
    everyone: Sequence[Sequence[Sequence[int]]] | None = None,
) -> dict[int, Fetched]:
    """Exchange blob bytes: receive `mine`, serve what the others asked of this process.

    A collective: every process calls it, with its own requests (possibly none).

    Args:
        mine: this process's requests (node, serving process, offset, nbytes), merged.
        read_local: (node, offset, nbytes) -> those bytes of a blob this process sees.
        tag: a name for this exchange, the same on every process and unique in the job.
        everyone: every process's requests when the caller gathered them already (with other
            things, in one round); else they are gathered here.

    Returns:
        node -> the ranges received for it.
    """
    mine = [(int(a), int(b), int(c), int(d)) for a, b, c, d in mine]
    if everyone is None:
        everyone = allgather_json(mine, f"{tag}/requests")
    everyone = [[tuple(r) for r in rs] for rs in everyone]
    out: dict[int, Fetched] = {}
    if not any(everyone):
        return out
    nprocs, me = jax.process_count(), jax.process_index()
    for shift in range(1, nprocs):
        sizes = [sum(r[3] for r in everyone[(p + shift) % nprocs] if r[1] == p) for p in range(nprocs)]  # fmt: skip
        size = max(sizes)
        if not size:
            continue
        send = np.zeros(size, np.uint8)
        pos = 0
        for node, src, off, n in everyone[(me + shift) % nprocs]:
            if src == me:
                send[pos : pos + n] = read_local(node, off, n)
                pos += n
        recv = _ppermute(send, shift)
        pos, src_proc = 0, (me - shift) % nprocs
        for node, src, off, n in mine:
            if src == src_proc:
                out.setdefault(node, Fetched(node)).add(off, recv[pos : pos + n])
                pos += n
    return out


def _process_devices() -> tuple[Any, ...]:
    """One device per process (its first), in process order."""
    first: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        first.setdefault(d.process_index, d)
    return tuple(first[p] for p in sorted(first))


@functools.lru_cache(maxsize=16)
def _shift_fn(devices: tuple[Any, ...], shift: int) -> tuple[Any, NamedSharding]:
    mesh = jax.sharding.Mesh(np.array(devices), ("ucp_procs",))
    n = len(devices)
    perm = [(i, (i + shift) % n) for i in range(n)]

    def body(x: jax.Array) -> jax.Array:
        return jax.lax.ppermute(x, "ucp_procs", perm)

    spec = P("ucp_procs")
    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(fn), NamedSharding(mesh, spec)


def _ppermute(send: np.ndarray, shift: int) -> np.ndarray:
    """Send `send` to the process `shift` further; returns what the one `shift` before sent."""
    devices = _process_devices()
    fn, sharding = _shift_fn(devices, shift)
    mine = devices[jax.process_index()]
    local = jax.device_put(send, mine)
    glob = jax.make_array_from_single_device_arrays((len(devices) * send.size,), sharding, [local])
    out = fn(glob)
    return np.array(out.addressable_shards[0].data)  # a private copy of the received bytes
