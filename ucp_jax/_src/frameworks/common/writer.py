"""Writing imported checkpoints: atoms and slots as ordinary `ucp/1` arrays, then manifest + COMMIT.

Importers hand over pieces of atoms as they read them (a box, or a flat range of a possibly
TP-sliced, vocab-padded parameter); nothing is buffered here beyond the writes in flight, which
are bounded in bytes. The arrays go where a save puts them (format version 3 by default: one OCDBT
database, `sink_aggregated`; version 2 with `UCP_LAYOUT=per-array`: `sink_per_array`), with the
library's own store and commit helpers, so `ucp.open`, `ucp.restore` and `ucp verify` read the
result like any saved checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ...errors import MismatchError, UnsafePathError
from ...format import commit, space, store, zarr_json
from ...format.manifest import PARAM_SLOT, AtomInfo, Manifest, SlotInfo, atom_dir, source_header
from ...mapping.boxes import Box, box_shape
from ...mapping.pattern_json import chain_to_json, fused_marks_to_json
from ...mapping.patterns import FusedMark, Pattern
from ...untrusted.paths import check_component
from ...util import config
from ...util.dtypes import dtype_name, zarr_dtype
from . import sink_aggregated
from .sink_aggregated import AggregatedSink
from .sink_per_array import PerArraySink
from .torch_arrays import to_numpy


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


IMPORT_SHARD_BYTES = 32 << 20  # importers write a shard in one go: small shards, bounded memory


def import_chunks(
    shape: Sequence[int], itemsize: int, grid: Sequence[int] | None = None
) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Shard and inner chunk shapes of an imported slot: shards of whole trailing rows, <= 32 MiB.

    Shards split the leading axis first, so a flat range aligned to `flat_block` covers whole
    shards and each shard file is written once (no read-modify-write). `grid`: the source's
    chunk shape; shards are then cut inside its chunks (each written whole from one of them).

    >>> import_chunks((16384, 4096), 4)[0], import_chunks((16384, 4096), 4, (4096, 2048))[0]
    ((2048, 4096), (4096, 2048))
    """
    if not shape:
        return (), None
    outer = [max(int(d), 1) for d in shape]
    if grid is not None and len(grid) == len(shape):
        outer = [max(min(int(g), o), 1) for g, o in zip(grid, outer)]
    for j in range(len(outer)):
        while math.prod(outer) * itemsize > IMPORT_SHARD_BYTES and outer[j] > 1:
            outer[j] = -(-outer[j] // 2)
    _, inner = store.choose_chunks(tuple(outer), itemsize, [set() for _ in outer])
    return tuple(outer), inner


def shard_pieces(
    box: Box, data: np.ndarray, chunks: Sequence[int], axis: int = 0
) -> Iterator[tuple[Box, np.ndarray]]:
    """`box` (holding `data`) cut at shard boundaries, axis by axis, into pieces of at most
    IMPORT_SHARD_BYTES (whole shards where the box holds them); a smaller box stays whole.

    >>> big = np.zeros((4, 1 << 22), np.float32)  # 64 MiB, shards of 2 rows (32 MiB)
    >>> [b for b, _ in shard_pieces(((0, 4), (0, 1 << 22)), big, (2, 1 << 22))]
    [((0, 2), (0, 4194304)), ((2, 4), (0, 4194304))]
    >>> [b for b, _ in shard_pieces(((0, 3), (0, 4)), np.zeros((3, 4)), (2, 2))]  # small: whole
    [((0, 3), (0, 4))]
    """
    if data.nbytes <= IMPORT_SHARD_BYTES or axis >= len(box):
        yield box, data
        return
    (lo, hi), c = box[axis], max(int(chunks[axis]), 1)
    for a, b in itertools.pairwise([lo, *range((lo // c + 1) * c, hi, c), hi]):
        cut = (*box[:axis], (a, b), *box[axis + 1 :])
        yield from shard_pieces(cut, data[(slice(None),) * axis + (slice(a - lo, b - lo),)],
                                chunks, axis + 1)  # fmt: skip


class AtomWriter:
    """One imported checkpoint being written: create slots, write regions, commit.

    It writes the layout `ucp.save` writes (`UCP_LAYOUT`, see `config.save_layout`): by default
    format version 3, every array in one OCDBT database (`sink_aggregated`); `per-array` gives
    format version 2, one file per chunk (`sink_per_array`). Either way the manifest, fingerprint
    tables and COMMIT are those of a save, so `ucp.open`, `ucp.restore` and `ucp verify` read
    the result like any saved checkpoint. Used as a context manager, an error before `commit`
    drops what was written.

    >>> with AtomWriter("/tmp/ucp/imported") as w:  # doctest: +SKIP
    ...     w.write_flat("emb.weight", "fp32", (53, 24), np.float32, flat, start=0)
    ...     w.commit(step=3, source={"library": "deepspeed"})
    """

    def __init__(
        self,
        dst: Any,
        *,
        overwrite: bool = False,
        max_inflight_bytes: int | None = None,
        layout: str | None = None,
        encode_whole_shards: bool = False,
    ) -> None:
        """Prepare the staging area of `dst` (refused if it holds a checkpoint, unless `overwrite`).

        Args:
            dst: where to write (local path, kvstore URL or spec, Location).
            overwrite: replace a committed checkpoint at `dst`.
            max_inflight_bytes: bytes of writes held in memory at once (default:
                `UCP_IMPORT_INFLIGHT_BYTES`).
            layout: 'aggregated' (format version 3) or 'per-array' (version 2); default
                `UCP_LAYOUT`, else 'aggregated'.
            encode_whole_shards: format version 3: encode writes that cover whole shards here
                (hardware CRC32C, on a thread of their own) instead of in TensorStore (see
                `sink_aggregated`). Faster for sources read as flat, contiguous fragments (the
                DeepSpeed import: 0.89x the wall time); slower where the importing thread is
                busy itself (Hugging Face 1.12x, Orbax 1.22x), so importers opt in.
        """
        layout = layout or config.save_layout()
        if layout not in ("aggregated", "per-array"):
            raise ValueError(f"import: layout must be 'aggregated' or 'per-array', not {layout!r}")
        self.loc = store.Location.parse(dst)
        if max_inflight_bytes is None:
            max_inflight_bytes = config.import_inflight_bytes()
        self.budget = max(int(max_inflight_bytes), 1)
        # the writes in flight, and a shard being encoded (or the sink's encoded shards)
        extra = 2 + (sink_aggregated.ENCODE_BUFFERS if encode_whole_shards else 0)
        space.require_memory(self.budget + extra * IMPORT_SHARD_BYTES,
                             f"{self.loc.url}: the import", space.IMPORT_FIX)  # fmt: skip
        self.staging = commit.Staging(self.loc, overwrite=overwrite)
        self.staging.check()
        self.staging.prepare()
        self.layout = layout
        self._sink: AggregatedSink | PerArraySink = (
            AggregatedSink(self.staging.target, self.budget, encode_shards=encode_whole_shards)
            if layout == "aggregated"
            else PerArraySink(self.staging.target, self.budget)
        )
        self.atoms: dict[str, dict[str, Any]] = {}
        self._arrays: dict[tuple[str, str], SlotInfo] = {}  # the created slots
        self._covered: dict[tuple[str, str], int] = {}  # elements written per slot (commit checks)

    # ------------------------------------------------------------------------------- atoms

    def atom(
        self,
        name: str,
        shape: Sequence[int],
        *,
        pattern: Sequence[Pattern] = (),
        fused: Sequence[FusedMark] = (),
        role: str | None = None,
        grid: Sequence[int] | None = None,
    ) -> None:
        """Declare an atom (idempotent; the shape must not change).

        Args:
            name: the atom's name.
            shape: its shape.
            pattern: the chain (atom outward) that maps it to the source's layout, recorded in
                the manifest (e.g. `VocabPadded`, `Partitioned` for TP-sliced sources).
            fused: the sub-param fusions it holds (e.g. q, k, v concatenated).
            role: for an optimizer leaf that mirrors no parameter, e.g. 'ScaleByAdamState.count'.
            grid: the chunk shape of the source array it is read from, when it is read chunk by
                chunk: the slots' shards are cut inside those chunks (see `import_chunks`).

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
                                "fused": fused_marks_to_json(fused), "role": role,
                                "grid": None if grid is None else tuple(grid)}  # fmt: skip
        elif a["shape"] != shape:
            raise MismatchError(
                f"import: parameter {name!r} has shape {a['shape']} in one file and {shape} in "
                "another; the source checkpoint is inconsistent"
            )

    def array(
        self, atom: str, slot: str, dtype: Any, *, slot_shape: Sequence[int] | None = None
    ) -> Any:
        """The TensorStore array of one slot, created on first use (it reads what has landed:
        `flush` first to read back what was written)."""
        return self._sink.array(self._slot(atom, slot, dtype, slot_shape))

    def _slot(
        self, atom: str, slot: str, dtype: Any, slot_shape: Sequence[int] | None = None
    ) -> SlotInfo:
        """The SlotInfo of one slot, created on first use."""
        info = self._arrays.get((atom, slot))
        if info is None:
            self.create_many([(atom, slot, dtype, slot_shape)])
            info = self._arrays[(atom, slot)]
        return info

    def _slot_info(
        self, atom: str, slot: str, dtype: Any, slot_shape: Sequence[int] | None
    ) -> tuple[tuple[int, ...], SlotInfo]:
        """The shape and SlotInfo of one slot (its own shape, or the atom's)."""
        a = self.atoms[atom]
        check_component(slot, f"import: atom {atom!r}: slot")
        shape = a["shape"] if slot_shape is None else tuple(int(d) for d in slot_shape)
        dt = np.dtype(dtype)
        zarr_json.check_storable(zarr_dtype(dt), f"import: atom {atom!r} slot {slot!r}")
        own = None if shape == a["shape"] else shape
        chunks, inner = import_chunks(shape, dt.itemsize, None if own else a.get("grid"))
        return shape, SlotInfo(dtype_name(dt), f"{atom_dir(atom)}/{slot}", chunks, inner, own)

    def create_many(self, slots: Sequence[tuple[str, str, Any, Sequence[int] | None]]) -> None:
        """Create many slots at once, concurrently: (atom, slot, dtype, slot shape or None).

        Creating arrays one by one pays the storage's latency (metadata write + sync) per array;
        importers that know their atoms up front create them all in one go.
        """
        todo: dict[tuple[str, str], tuple[tuple[int, ...], SlotInfo]] = {}
        for atom, slot, dtype, slot_shape in slots:
            if (atom, slot) not in self._arrays and (atom, slot) not in todo:
                todo[(atom, slot)] = self._slot_info(atom, slot, dtype, slot_shape)
        if not todo:
            return
        self._sink.create(list(todo.values()))
        for (atom, slot), (_, info) in todo.items():
            self._arrays[(atom, slot)] = info
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
        """Write `data` into `box` of a slot (created with data's dtype if new).

        A box larger than a shard is handed over shard by shard (TensorStore copies what it
        writes, so memory holds the source and the writes within the budget, not a second copy
        of the whole box). `data` (and `keep`) must stay unchanged until `release_sources` or
        `flush` returns (or the writer commits). Where boxes overlap, the last write wins (a
        write waits for the copy of an earlier write it overlaps: see `write_order`).
        """
        data = np.asarray(data)
        info = self._slot(atom, slot, data.dtype)
        key = (atom, slot)
        self._covered[key] = self._covered.get(key, 0) + math.prod(box_shape(box))
        for piece_box, piece in shard_pieces(box, data.reshape(box_shape(box)), info.chunks):
            self._sink.write(info, piece_box, piece, keep)

    def write_scalar(self, atom: str, slot: str, value: Any) -> None:
        """A scalar slot (e.g. `step`) of an atom of any shape."""
        data = np.asarray(value)
        self._slot(atom, slot, data.dtype, slot_shape=())
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

    def flush(self) -> None:
        """Wait until every write issued so far has landed (and its source may be released)."""
        self._sink.flush()

    def release_sources(self) -> None:
        """Wait until no write issued so far reads from its source: the sources may then be
        freed, reused or unmapped. Cheaper than `flush` with format version 3, where the writes
        land later, in large transactions (a `flush` commits the open one)."""
        self._sink.release_sources()

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
        self._check_covered()
        written = {
            info: store.expected_chunk_keys(a["shape"] if info.shape is None else info.shape, info)
            for a in self.atoms.values()
            for info in a["slots"].values()
        }
        self._sink.finish(written)
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
                            leaves=leaves or {}, version=self._sink.version)  # fmt: skip
        self.staging.commit(manifest)
        return self.loc.url

    def _check_covered(self) -> None:
        """Every slot created was written whole (elements written >= its size), or nothing is
        committed: an importer that skipped a parameter must fail, not commit zeros."""
        for name, a in self.atoms.items():
            for slot, info in a["slots"].items():
                size = math.prod(a["shape"] if info.shape is None else info.shape)
                got = self._covered.get((name, slot), 0)
                if got < size:
                    raise MismatchError(
                        f"import: atom {name!r} slot {slot!r} was written for {got} of its {size} "
                        "elements: the source lacks the rest (a file missing, or a layout this "
                        "importer does not read); nothing was committed"
                    )

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
            self._sink.abort()
        self.staging.abandon()  # its own staging folder only, and the path's lock released


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
