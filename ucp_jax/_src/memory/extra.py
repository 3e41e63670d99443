"""Non-tensor state of a snapshot (a data loader's position, metrics, ...), kept per process.

`SnapshotManager.snapshot(step, params, opt_state, extra=...)` takes JSON-able data or bytes
(e.g. grain's `get_state()`; also nested in JSON data), which may differ per process. Each node
keeps its own in its snapshot's `index.json` (committed with it, so it always belongs to that
step), and, as its redundancy scheme says, what it takes to rebuild its peers' (`extra_kept`:
replica keeps the previous node's, xor the parity of its group's; exchanged through the
coordination service in the background); a persisted universal checkpoint gathers every
process's into its manifest's `extra` (`{"source": "ucp.memory", "process_extra": [per
process]}`). A restore gives each process its own back as `mgr.restored.extra`: from its node's
snapshot, rebuilt from its peers' when its node was lost, or from the persisted checkpoint.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

_BYTES = "__ucp_bytes__"


def encode(extra: Any) -> Any:
    """`extra` as plain JSON data (bytes, also nested, as base64), checked to serialise.

    >>> encode(b"\\x00\\x01"), encode({"epoch": 1, "loader": b"\\x02"})
    ({'__ucp_bytes__': 'AAE='}, {'epoch': 1, 'loader': {'__ucp_bytes__': 'Ag=='}})
    """
    if extra is None:
        return None
    _refuse_marker(extra, set())
    try:
        return json.loads(json.dumps(extra, default=_bytes))  # plain: str keys, lists
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"snapshot: extra must be JSON-serialisable or bytes ({e}); pass plain data, or "
            "the bytes of a data loader's state"
        ) from e


def _refuse_marker(obj: Any, seen: set[int]) -> None:
    """A dict of the user's keyed by the bytes marker would come back as bytes (or not at all):
    refused, with the key named."""
    if id(obj) in seen or not isinstance(obj, dict | list | tuple):
        return
    seen.add(id(obj))  # (a structure that holds itself: json.dumps says so below)
    if isinstance(obj, dict):
        if _BYTES in obj:
            raise TypeError(
                f"snapshot: extra holds a dict with the key {_BYTES!r}, which marks bytes in a "
                "snapshot's extra; rename that key"
            )
        obj = list(obj.values())
    for v in obj:
        _refuse_marker(v, seen)


def _bytes(obj: Any) -> Any:
    if isinstance(obj, bytes | bytearray | memoryview):
        return {_BYTES: base64.b64encode(bytes(obj)).decode()}
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def decode(obj: Any) -> Any:
    """The inverse of `encode`.

    >>> decode(encode(b"state")), decode(encode({"pos": [1, b"x"]}))
    (b'state', {'pos': [1, b'x']})
    """
    if isinstance(obj, dict):
        if set(obj) == {_BYTES}:
            return base64.b64decode(obj[_BYTES])
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj


def serial(encoded: Any) -> bytes:
    """The bytes an encoded extra travels (and is rebuilt) as: canonical JSON."""
    return json.dumps(encoded, sort_keys=True, separators=(",", ":")).encode()


def _record(path: Path) -> dict[str, Any] | None:
    """A committed snapshot's extra and what it keeps of its peers' (None: unreadable)."""
    from .shm import INDEX

    try:
        d = json.loads((path / INDEX).read_bytes())
    except (OSError, ValueError):
        return None
    return {"extra": d.get("extra"), "kept": d.get("extra_kept")} if isinstance(d, dict) else None


def seen(cand: Any) -> dict[str, Any]:
    """The extras records (own and kept) of the candidate's snapshots this process sees, for the
    other processes (JSON: node -> record)."""
    return {str(n): r for n, e in cand.entries.items() if (r := _record(e.path)) is not None}


def restored(cand: Any, tag: str, gathered: list[Any] | None = None) -> Any:
    """This process's extra of the step a restore chose (a collective when some process cannot
    see its node's snapshot: every process sends the records it sees, unless the caller gathered
    every process's `seen` already, in `gathered`).

    Its node's own when its snapshot is seen, else rebuilt by the layout's redundancy scheme from
    the others' records (`extra_kept` and their own extras); None when the node gave none, or
    this process has no node in that step.
    """
    import jax

    from .exchange import allgather_json

    lay = cand.layout
    me, nprocs = jax.process_index(), jax.process_count()
    mine = seen(cand)
    records = {int(n): r for n, r in mine.items()}
    unseen = [p for p in range(min(nprocs, lay.nodes)) if p not in cand.present.get(p, [])]
    if nprocs > 1 and unseen:  # every process computes the same `unseen` from the inventory
        if gathered is None:
            gathered = allgather_json(mine, f"{tag}/extras")
        for got in gathered:
            for n, r in got.items():
                records.setdefault(int(n), r)
    if me >= lay.nodes:
        return None
    if me in records:
        return decode(records[me]["extra"])
    if lay.scheme is None:
        return None
    raw = lay.scheme.rebuild_extra(
        lay, me, {n: r["kept"] for n, r in records.items()},
        {n: serial(r["extra"]) for n, r in records.items()},
    )  # fmt: skip
    return None if raw is None else decode(json.loads(raw))


class PeerExchange:
    """Moves each process's serialised extra, per snapshot, to the nodes that keep redundancy for
    it (the coordination service's key-value store; a few hundred bytes per process), and the
    digests of the nodes' bytes that their schemes keep (`seal`; rs2: a few words per node).

    A snapshot's keys are named by its `snap`, ``"<n>.<step>"``: `n` counts the snapshots this
    manager started, the same on every process, since every process starts the same snapshots
    (the redundancy exchange is a collective), and the step keeps a process whose count went
    astray from ever reading another step's extra as its own. `publish` and `kept` run in the
    background before the snapshot commits (`kept` waits for its sources to publish the same
    snapshot). A process whose snapshot failed before it committed publishes a failure in its
    keys instead (`fail`), so that the processes waiting for them stop at once, naming it, rather
    than at the barrier timeout. A process deletes its own keys once they are `LAG` snapshots
    old (its readers, one collective step behind at most, have read them).
    """

    LAG = 4
    FAILED = "!"  # a failure published in a key (JSON, an extra's or a digest's, never starts so)

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._mine: list[str] = []

    @staticmethod
    def active(layout: Any) -> bool:
        """Whether snapshots of `layout` exchange extras (a scheme, several processes)."""
        import jax

        return layout.scheme is not None and jax.process_count() == layout.nodes > 1

    def publish(self, layout: Any, node: int, snap: str, encoded: Any) -> bool:
        """Publish this node's extra of snapshot `snap`; whether the exchange is active."""
        if not self.active(layout):
            return False
        self._set(f"{self.prefix}/{snap}/{node}", serial(encoded).decode())
        return True

    def fail(self, layout: Any, node: int, snap: str, why: str) -> None:
        """This node's snapshot `snap` failed before it committed: say so where its peers wait
        (its extra and its digest), so that they stop too."""
        if self.active(layout):
            for key in (f"{self.prefix}/{snap}/{node}", f"{self.prefix}/{snap}/{node}/digest"):
                self._set(key, self.FAILED + why)

    def _set(self, key: str, value: str) -> None:
        from ..util.sync import coordination_client

        client = coordination_client()
        client.key_value_set(key, value, allow_overwrite=True)
        self._mine.append(key)
        while len(self._mine) > 2 * self.LAG:  # (an extra and a digest per snapshot)
            client.key_value_delete(self._mine.pop(0))

    def _get(self, snap: str, source: int, suffix: str = "") -> str:
        """A source's key of snapshot `snap` (waits for it); raises where it says it failed."""
        from ..errors import AnotherProcessFailedError
        from ..util import config
        from ..util.sync import coordination_client

        timeout_ms = int(config.barrier_timeout_s() * 1000)
        raw: str = coordination_client().blocking_key_value_get(
            f"{self.prefix}/{snap}/{source}{suffix}", timeout_ms
        )
        if raw.startswith(self.FAILED):
            step = snap.partition(".")[2]
            raise AnotherProcessFailedError(
                f"process {source}'s snapshot of step {step} failed, so this process, which keeps "
                f"redundancy for it, did not commit that step either: {raw[len(self.FAILED) :]}"
            )
        return raw

    def kept(self, layout: Any, node: int, snap: str) -> Any:
        """What `node` keeps of its sources' extras of snapshot `snap` (waits for them)."""
        raws = {s: self._get(snap, s).encode() for s in layout.scheme.extra_sources(layout, node)}
        return layout.scheme.keep_extras(layout, node, raws)

    def seal(self, layout: Any, node: int, snap: str, blob: Any) -> None:
        """Before snapshot `snap` commits: publish the digest of this node's filled blob that its
        scheme asks for, wait for its sources' of the same snapshot, and write what it keeps of
        them into its blob (`RedundancyScheme.digest`, `keep_digests`; nothing for most schemes).
        """
        scheme = layout.scheme
        sources = scheme.digest_sources(layout, node)
        if not sources:
            return
        self._set(f"{self.prefix}/{snap}/{node}/digest",
                  json.dumps(scheme.digest(layout, node, blob)))  # fmt: skip
        got = {s: json.loads(self._get(snap, s, "/digest")) for s in sources}
        scheme.keep_digests(layout, node, blob, got)


def manifest_extra(encoded: list[Any]) -> dict[str, Any]:
    """The persisted manifest's `extra`, from every process's encoded extra."""
    out: dict[str, Any] = {"source": "ucp.memory"}
    if any(e is not None for e in encoded):
        out["process_extra"] = encoded
    return out


def from_manifest(extra: Any, node: int) -> Any:
    """Process `node`'s extra from a persisted checkpoint's manifest `extra`."""
    per = extra.get("process_extra") if isinstance(extra, dict) else None
    if not isinstance(per, list) or node >= len(per):
        return None
    return decode(per[node])


__all__ = [
    "PeerExchange",
    "decode",
    "encode",
    "from_manifest",
    "manifest_extra",
    "restored",
    "serial",
]
