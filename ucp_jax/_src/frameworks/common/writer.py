"""Writing imported checkpoints: atoms and slots as ordinary `ucp/1` arrays, then manifest + COMMIT.

Importers hand over pieces of atoms as they read them (a box, or a flat range of a possibly
TP-sliced, vocab-padded parameter); nothing is buffered here beyond the writes in flight, which
are bounded in bytes. Uses the library's own store helpers, so `ucp.open`, `ucp.restore` and
`ucp verify` read the result like any saved checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import tensorstore as ts

from ...errors import MismatchError, UnsafePathError
from ...format import commit, integrity, space, store
from ...format.manifest import PARAM_SLOT, AtomInfo, Manifest, SlotInfo, atom_dir, source_header
from ...mapping.boxes import Box, box_shape, to_slices
from ...mapping.patterns import FusedMark, Pattern, chain_to_json, fused_marks_to_json
from ...untrusted.paths import check_component
from ...util import config
from ...util.dtypes import dtype_name
from ...util.inflight import InflightWindow


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int]]:
    """Boxes covering the C-order flat range [start, stop) of an array of `shape`.

    Returns (box, offset of the box's first element from `start`), in flat order; at most
    2 * ndim - 1 boxes.

    >>> flat_boxes((3, 4), 2, 9)
    [(((0, 1), (2, 4)), 0), (((1, 2), (0, 4)), 2), (((2, 3), (0, 1)), 6)]
    """
    shape = tuple(int(d) for d in shape)
    if stop <= start:
        return []
    if not shape:
        return [((), 0)]
    row = math.prod(shape[1:])
    if row == 0:
        return []
    out: list[tuple[Box, int]] = []
    i0, r0 = divmod(start, row)
    i1, r1 = divmod(stop, row)
    if i0 == i1:
        return [(((i0, i0 + 1), *b), off) for b, off in flat_boxes(shape[1:], r0, r1)]
    pos = 0
    if r0:
        out += [(((i0, i0 + 1), *b), off) for b, off in flat_boxes(shape[1:], r0, row)]
        pos = row - r0
        i0 += 1
    if i1 > i0:
        out.append((((i0, i1), *((0, d) for d in shape[1:])), pos))
        pos += (i1 - i0) * row
    if r1:
        out += [(((i1, i1 + 1), *b), pos + off) for b, off in flat_boxes(shape[1:], 0, r1)]
    return out


SETTLE_LAG = 8  # files written whose pages stay cached before they are settled (see _settle)
IMPORT_SHARD_BYTES = 32 << 20  # importers write a shard in one go: small shards, bounded memory


def import_chunks(
    shape: Sequence[int], itemsize: int
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Shard and inner chunk shapes of an imported slot: shards of whole trailing rows, <= 32 MiB.

    Shards split the leading axis first, so a flat range aligned to `flat_block` covers whole
    shards and each shard file is written once (no read-modify-write).
    """
    if not shape:
        return (), None
    outer = [max(int(d), 1) for d in shape]
    for j in range(len(outer)):
        while math.prod(outer) * itemsize > IMPORT_SHARD_BYTES and outer[j] > 1:
            outer[j] = -(-outer[j] // 2)
    _, inner = store.choose_chunks(tuple(outer), itemsize, [set() for _ in outer])
    return tuple(outer), inner


class AtomWriter:
    """One imported checkpoint being written: create slots, write regions, commit.

    Used as a context manager, an error before `commit` drops what was written.

    >>> with AtomWriter("/tmp/ucp/imported") as w:  # doctest: +SKIP
    ...     w.write_flat("emb.weight", "fp32", (53, 24), np.float32, flat, start=0)
    ...     w.commit(step=3, source={"library": "deepspeed"})
    """

    def __init__(
        self, dst: Any, *, overwrite: bool = False, max_inflight_bytes: int | None = None
    ) -> None:
        self.loc = store.Location.parse(dst)
        if max_inflight_bytes is None:
            max_inflight_bytes = config.import_inflight_bytes()
        self.budget = max(int(max_inflight_bytes), 1)
        # the writes in flight, and a shard being encoded
        space.require_memory(self.budget + 2 * IMPORT_SHARD_BYTES, f"{self.loc.url}: the import",
                             space.IMPORT_FIX)  # fmt: skip
        self.staging = commit.Staging(self.loc, overwrite=overwrite)
        self.staging.check()
        self.staging.prepare()
        # Local files: written without a sync each, their writeback started as each completes,
        # all fsynced once before COMMIT (see store.sync_tree): durable, without a blocking
        # fsync per file.
        self._local = self.staging.target.local_path
        self._context = store.CONTEXT if self._local is None else store.DEFERRED_SYNC_CONTEXT
        self._written: collections.deque[tuple[str, SlotInfo]] = collections.deque()  # writeback on
        # array path -> chunk key -> fingerprint taken before its pages were dropped (see commit)
        self._known: dict[str, dict[str, tuple[str, int, int, int]]] = {}
        self._settler: ThreadPoolExecutor | None = None
        self._settling: list[Future[None]] = []
        self.atoms: dict[str, dict[str, Any]] = {}
        self._arrays: dict[tuple[str, str], Any] = {}
        # (write future, what must stay alive until it lands, (atom, slot, box))
        self._inflight: InflightWindow[tuple[Any, Any, Any]] = InflightWindow(self.budget)

    # ------------------------------------------------------------------------------- atoms

    def atom(
        self,
        name: str,
        shape: Sequence[int],
        *,
        pattern: Sequence[Pattern] = (),
        fused: Sequence[FusedMark] = (),
        role: str | None = None,
    ) -> None:
        """Declare an atom (idempotent; the shape must not change).

        Args:
            name: the atom's name.
            shape: its shape.
            pattern: the chain (atom outward) that maps it to the source's layout, recorded in
                the manifest (e.g. `VocabPadded`, `Partitioned` for TP-sliced sources).
            fused: the sub-param fusions it holds (e.g. q, k, v concatenated).
            role: for an optimizer leaf that mirrors no parameter, e.g. 'ScaleByAdamState.count'.

        Raises:
            UnsafePathError: the name cannot be an atom folder (not a string, empty, `.`, `..`,
                or too long once quoted).
        """
        shape = tuple(int(d) for d in shape)
        a = self.atoms.get(name)
        if a is None:
            if not isinstance(name, str):
                raise UnsafePathError(f"import: tensor name {name!r} is not a string")
            atom_dir(name)  # refuses names that cannot be a folder
            self.atoms[name] = {"shape": shape, "slots": {}, "pattern": chain_to_json(pattern),
                                "fused": fused_marks_to_json(fused), "role": role}  # fmt: skip
        elif a["shape"] != shape:
            raise MismatchError(
                f"import: parameter {name!r} has shape {a['shape']} in one file and {shape} in "
                "another; the source checkpoint is inconsistent"
            )

    def array(
        self, atom: str, slot: str, dtype: Any, *, slot_shape: Sequence[int] | None = None
    ) -> Any:
        """The TensorStore array of one slot, created on first use."""
        if (atom, slot) not in self._arrays:
            self.create_many([(atom, slot, dtype, slot_shape)])
        return self._arrays[(atom, slot)]

    def _slot_spec(
        self, atom: str, slot: str, dtype: Any, slot_shape: Sequence[int] | None
    ) -> tuple[SlotInfo, dict[str, Any]]:
        """The SlotInfo and TensorStore spec of one slot (its own shape, or the atom's)."""
        a = self.atoms[atom]
        check_component(slot, f"import: atom {atom!r}: slot")
        shape = a["shape"] if slot_shape is None else tuple(int(d) for d in slot_shape)
        dt = np.dtype(dtype)
        chunks, inner = import_chunks(shape, dt.itemsize)
        own = None if shape == a["shape"] else shape
        info = SlotInfo(dtype_name(dt), f"{atom_dir(atom)}/{slot}", chunks, inner, own)
        return info, store.array_spec(self.staging.target, shape, info)

    def create_many(self, slots: Sequence[tuple[str, str, Any, Sequence[int] | None]]) -> None:
        """Create many slots at once, concurrently: (atom, slot, dtype, slot shape or None).

        Creating arrays one by one pays the storage's latency (metadata write + sync) per array;
        importers that know their atoms up front create them all in one go.
        """
        futs = []
        for atom, slot, dtype, slot_shape in slots:
            if (atom, slot) in self._arrays:
                continue
            info, spec = self._slot_spec(atom, slot, dtype, slot_shape)
            futs.append((atom, slot, info, ts.open(spec, create=True, context=self._context)))
        for atom, slot, info, fut in futs:
            self._arrays[(atom, slot)] = fut.result()
            self.atoms[atom]["slots"][slot] = info

    def flat_block(self, atom: str, slot: str) -> int | None:
        """Elements per shard when shards are whole row blocks (flat-contiguous), else None."""
        a = self.atoms.get(atom)
        info = a["slots"].get(slot) if a is not None else None
        if a is None or not info or not a["shape"] or info.shape is not None:
            return None
        chunks, shape = info.chunks, a["shape"]
        if tuple(chunks[1:]) != tuple(shape[1:]):
            return None
        return math.prod(chunks)

    def has(self, atom: str, slot: str) -> bool:
        return (atom, slot) in self._arrays

    # ------------------------------------------------------------------------------ writing

    def write(self, atom: str, slot: str, box: Box, data: np.ndarray, *, keep: Any = None) -> None:
        """Write `data` into `box` of a slot (created with data's dtype if new)."""
        arr = self.array(atom, slot, data.dtype)
        data = np.asarray(data).reshape(box_shape(box))
        rows = self.atoms[atom]["slots"][slot].chunks[0] if box else 0
        if data.nbytes <= IMPORT_SHARD_BYTES or not rows:
            pieces = [(box, data)]
        else:  # shard by shard through the in-flight window: TensorStore copies what it writes
            (lo, hi), rest = box[0], tuple(box[1:])
            cuts = [lo, *range((lo // rows + 1) * rows, hi, rows), hi]
            pieces = [(((a, b), *rest), data[a - lo : b - lo]) for a, b in itertools.pairwise(cuts)]
        for piece_box, piece in pieces:
            fut = arr[to_slices(piece_box)].write(piece)
            item = (fut, (piece, keep), (atom, slot, piece_box))
            for done in self._inflight.push(item, piece.nbytes):
                self._retire(done)

    def write_scalar(self, atom: str, slot: str, value: Any) -> None:
        """A scalar slot (e.g. `step`) of an atom of any shape."""
        data = np.asarray(value)
        self.array(atom, slot, data.dtype, slot_shape=())
        self.write(atom, slot, (), data)

    def write_flat(
        self,
        atom: str,
        slot: str,
        flat: np.ndarray,
        start: int,
        *,
        sub_shape: Sequence[int] | None = None,
        origin: Sequence[int] | None = None,
        keep: Any = None,
    ) -> None:
        """Write a flat range of a (sub-)array into an atom slot.

        `flat` holds elements [start, start + len) of a C-order array of `sub_shape` (default:
        the atom's shape) that sits at `origin` inside the atom; parts outside the atom (vocab
        padding) are dropped.
        """
        shape = self.atoms[atom]["shape"]
        sub = tuple(shape if sub_shape is None else sub_shape)
        org = tuple(origin or (0,) * len(sub))
        flat = np.asarray(flat).reshape(-1)
        for box, off in flat_boxes(sub, start, start + flat.size):
            n = math.prod(box_shape(box))
            piece = flat[off : off + n].reshape(box_shape(box))
            target, cut = [], []
            for (a, b), o, d in zip(box, org, shape):
                lo, hi = max(a + o, 0), min(b + o, d)
                target.append((lo, hi))
                cut.append(slice(lo - (a + o), hi - (a + o)))
            if any(lo >= hi for lo, hi in target):
                continue
            self.write(atom, slot, tuple(target), piece[tuple(cut)], keep=keep)

    def _retire(self, item: tuple[Any, Any, Any]) -> None:
        fut, _, (atom, slot, box) = item
        fut.commit.result()
        if self._local is not None:
            info = self.atoms[atom]["slots"][slot]
            for path in self._shard_files(atom, slot, box):
                store.start_writeback(path)
                self._written.append((path, info))
            self._settle(SETTLE_LAG)

    def _settle(self, lag: int) -> None:
        """Wait for the writeback of all but the newest `lag` files and drop their pages, on a
        background thread (see store.settle_file)."""
        while len(self._written) > lag:
            if self._settler is None:
                self._settler = ThreadPoolExecutor(1, thread_name_prefix="ucp-settle")
            path, info = self._written.popleft()
            self._settling.append(self._settler.submit(self._fingerprint_and_settle, path, info))
        done = [f for f in self._settling if f.done()]
        for f in done:
            f.result()
            self._settling.remove(f)

    def _fingerprint_and_settle(self, path: str, info: SlotInfo) -> None:
        """Background: fingerprint a written file while its pages are hot, then settle it."""
        found = integrity.local_fingerprint(path, info)
        if found is not None and self._local is not None:
            key = os.path.relpath(path, os.path.join(self._local, info.path))
            self._known.setdefault(info.path, {})[key] = found
        store.settle_file(path)

    def _stop_settling(self) -> None:
        try:
            for f in self._settling:
                f.result()
        finally:
            self._settling.clear()
            if self._settler is not None:
                self._settler.shutdown(wait=True)
                self._settler = None

    def _shard_files(self, atom: str, slot: str, box: Box) -> list[str]:
        """The local shard files a write of `box` into a slot touched."""
        info = self.atoms[atom]["slots"][slot]
        assert self._local is not None
        ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(box, info.chunks)]
        return [
            os.path.join(self._local, info.path, store.chunk_key(idx))
            for idx in itertools.product(*ranges)
        ]

    def flush(self) -> None:
        """Wait until every write issued so far is durable (and its source may be released)."""
        for item in self._inflight.drain():
            self._retire(item)

    # ------------------------------------------------------------------------------- commit

    def commit(
        self,
        *,
        step: int | None,
        source: dict[str, Any],
        extra: Any = None,
        rules: list[list[Any]] | None = None,
        leaves: dict[str, dict[str, Any]] | None = None,
    ) -> str:
        """Write the manifest and COMMIT; returns the checkpoint's location.

        `rules` / `leaves`: the manifest's rules and leaf records, when the importer mapped the
        source's leaves with rules (restore uses them when it is given none).
        """
        self.flush()
        if self._local is not None:
            self._settle(0)
            self._stop_settling()
        written = {
            info: store.expected_chunk_keys(a["shape"] if info.shape is None else info.shape, info)
            for a in self.atoms.values()
            for info in a["slots"].values()
        }
        commit.record_fingerprints(
            self.staging.target, written, "p0", self._known, deferred_sync=self._local is not None
        )  # sync_tree follows
        if self._local is not None:
            store.sync_tree(self._local)
        atoms = {}
        for name, a in self.atoms.items():
            if not a["slots"]:
                continue
            main = a["slots"].get(PARAM_SLOT) or next(iter(a["slots"].values()))
            atoms[name] = AtomInfo(
                shape=a["shape"], dtype=main.dtype, slots=a["slots"], pattern=a["pattern"],
                leaf=name, fused=a["fused"], role=a.get("role"),
            )  # fmt: skip
        src = {**source_header(), **source}
        manifest = Manifest(step=step, atoms=atoms, source=src, extra=extra, rules=rules or [],
                            leaves=leaves or {})  # fmt: skip
        self.staging.commit(manifest)
        return self.loc.url

    def __enter__(self) -> AtomWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """On an error (KeyboardInterrupt too) drop what was written; the error goes on (a full
        disk as a `StorageFullError` that says so)."""
        if exc_type is not None:
            kept = "the source and earlier checkpoints are intact"
            full: BaseException | None = space.full_error(
                exc, self.loc, "the imported checkpoint", kept
            ) or space.memory_error(exc, f"{self.loc.url}: the import", space.IMPORT_FIX)
            self.abort()
            if full is not None:
                raise full from exc

    def abort(self) -> None:
        """Drop what was written (the destination is left as it was)."""
        with contextlib.suppress(Exception):
            self.flush()
        with contextlib.suppress(Exception):
            self._stop_settling()
        self.staging.abandon()  # its own staging folder only, and the path's lock released


def to_numpy(t: Any) -> np.ndarray:
    """A CPU torch tensor as a numpy array without copying (bfloat16 via ml_dtypes)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def write_rows(w: AtomWriter, name: str, slot: str, m: Any) -> None:
    """Write torch tensor `m` (often a transposed view) into a slot in whole-shard row blocks: one
    block is copied contiguous at a time, so memory holds the source and one shard, not a copy."""
    import torch

    w.array(name, slot, to_numpy(torch.empty((), dtype=m.dtype)).dtype)
    shape = tuple(m.shape)
    fb = w.flat_block(name, slot)
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    step = max(1, fb // inner) if fb and len(shape) > 1 else max(1, shape[0] if shape else 1)
    for r0 in range(0, shape[0] if shape else 1, step):
        block = (m[r0 : r0 + step] if shape else m).contiguous()
        box = ((r0, r0 + block.shape[0]), *((0, d) for d in shape[1:])) if shape else ()
        w.write(name, slot, box, to_numpy(block), keep=block)
