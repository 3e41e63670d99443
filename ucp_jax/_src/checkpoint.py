"""A committed universal checkpoint, opened for inspection and region reads (no JAX needed).

`ucp.open` returns one; `ucp.restore` and the CLI (`ucp inspect`, `ucp verify`, the converters'
summaries) read through it, so that tools that only touch files never import JAX.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .errors import ChecksumError, MismatchError, NotACheckpointError, UcpError
from .format import (
    aggregate,
    direct,
    index,
    integrity,
    listing,
    ocdbt_index,
    process_tables,
    store,
)
from .format.folders import metadata_bytes
from .format.manifest import AtomInfo, Manifest
from .format.zarr_json import check_zarr_json
from .mapping.boxes import basic_index
from .untrusted import paths
from .util.dtypes import np_dtype


class Checkpoint:
    """A committed universal checkpoint, opened for inspection and region reads.

    Attributes:
        path: where it lives.
        manifest: the parsed manifest.
        step: the training step it was saved at (or None).
        atoms: {name: AtomInfo(shape, dtype, slots, pattern)}.
        extra: the user data saved with it.
    """

    def __init__(self, path: Any) -> None:
        self.loc = store.Location.parse(path)
        self.path = self.loc.url
        self.manifest: Manifest = store.load_manifest(self.loc)
        # Where the arrays are: the checkpoint folder (format version 2), or the root OCDBT
        # database in it (version 3, see format/aggregate.py).
        self.data = self.loc
        self._all_tables: dict[str, dict[str, str]] | None = None
        if self.loc.local_path is not None:
            self._check_layout(self.loc.local_path)
        if self.manifest.version >= aggregate.AGGREGATED_VERSION:
            if self.loc.local_path is not None:
                paths.check_tree(self.loc.local_path, "checkpoint folder", metadata_bytes)
            self.data = aggregate.root_db(self.loc)
        self._arrays: dict[tuple[str, str], Any] = {}  # opened in TensorStore
        # checked (listing, zarr.json, table) but opened in TensorStore only when first read
        # through it: a restore that reads every shard directly never opens them
        self._checked_slots: set[tuple[str, str]] = set()
        self._opening = threading.Lock()
        self._tables: dict[tuple[str, str], dict[str, str]] = {}  # fingerprints (version 2)
        self._checked: dict[tuple[str, str], set[str]] = {}  # chunk files found in place
        self._sized: dict[tuple[str, str], set[str]] = {}  # chunk files of the right size
        # where version-3 shards lie (direct reads)
        self._ocdbt: ocdbt_index.OcdbtIndex | None = None
        # (file, offset) -> fingerprint of the shards read directly (taken as they were read)
        self.fingerprints_seen: direct.Fingerprints = {}

    def _check_layout(self, folder: str) -> None:
        """The folder holds the layout the manifest's format_version says (local checkpoints)."""
        v3 = self.manifest.version >= aggregate.AGGREGATED_VERSION
        has_db = os.path.isfile(os.path.join(folder, "manifest.ocdbt"))
        has_atoms = os.path.isdir(os.path.join(folder, "atoms"))
        if self.atoms and (has_atoms and not has_db if v3 else has_db and not has_atoms):
            raise NotACheckpointError(
                f"{self.path}: manifest.json says format_version {self.manifest.version}, but "
                f"the folder holds the layout of format version {2 if v3 else 3} "
                f"({'atoms/, one folder per array' if v3 else 'manifest.ocdbt, one database'}): "
                "its format_version was edited; restore an earlier checkpoint"
            )

    @contextlib.contextmanager
    def _diagnosed(self) -> Iterator[None]:
        """A read that fails on a version-3 checkpoint whose databases are not all there says so
        (the bytes it did read are then no evidence of damage: they were never there)."""
        try:
            yield
        except ChecksumError as e:
            if self.manifest.version < aggregate.AGGREGATED_VERSION:
                raise
            gone = aggregate.missing_databases(self.loc, self.manifest.source.get("process_count"))
            if not gone:
                raise
            raise ChecksumError(
                f"{self.path}: the checkpoint's database is incomplete: {', '.join(gone)} "
                f"{'is' if len(gone) == 1 else 'are'} missing (deleted, or not copied with the "
                "rest); copy the checkpoint again whole or restore an earlier one"
            ) from e

    @property
    def step(self) -> int | None:
        return self.manifest.step

    @property
    def atoms(self) -> dict[str, AtomInfo]:
        return self.manifest.atoms

    @property
    def extra(self) -> Any:
        return self.manifest.extra

    def __repr__(self) -> str:
        n = sum(a.nbytes for a in self.atoms.values())
        return f"Checkpoint({self.path!r}, step={self.step}, atoms={len(self.atoms)}, {n / 2**20:.1f} MiB)"

    def atom(self, name: str, *, leaf: str | None = None) -> AtomInfo:
        """The AtomInfo of `name`, or a MismatchError naming close matches."""
        if name in self.atoms:
            return self.atoms[name]
        if not isinstance(name, str):
            raise TypeError(
                f"{self.path}: an atom name is a string, not a {type(name).__name__} ({name!r:.40})"
                f"; the checkpoint's are in .atoms (e.g. {next(iter(self.atoms), None)!r})"
            )
        close = difflib.get_close_matches(name, list(self.atoms), n=3)
        who = f"leaf {leaf!r} needs atom" if leaf else "atom"
        fix = ("add a rule mapping the leaf to its atom, or restore a matching tree" if leaf else
               f"pass one of its {len(self.atoms)} atoms (.atoms; `ucp inspect` lists them)")  # fmt: skip
        raise MismatchError(
            f"{self.path}: {who} {name!r}, which the checkpoint does not have"
            + (f" (close: {close})" if close else "")
            + f"; {fix}",
            leaf=leaf,
            kind="missing",
        )

    def array(self, name: str, slot: str, *, leaf: str | None = None) -> Any:
        """The TensorStore array of one atom slot (checked and opened once)."""
        key = (name, slot)
        if key in self._arrays:
            return self._arrays[key]
        self.open_arrays([key], leaf=leaf)
        with self._opening, self._diagnosed():  # reader threads open what they fall back to
            if key not in self._arrays:
                info = self.atoms[name]
                try:
                    self._arrays[key] = store.open_array(
                        self.data, info.slot_shape(slot), info.slots[slot]
                    )
                except ValueError as e:
                    if isinstance(e, UcpError):
                        raise
                    where = f"{self.path}: atom {name!r} slot {slot!r}"
                    raise store.wrap_io_error(e, where) from e
        return self._arrays[key]

    def stored(self, name: str, slot: str, *, leaf: str | None = None) -> tuple[Any, np.dtype]:
        """(shape, numpy dtype) of one atom slot, checked as `open_arrays` does, without opening
        it in TensorStore (its zarr.json agrees with the manifest, or that check raised)."""
        self.open_arrays([(name, slot)], leaf=leaf)
        info = self.atoms[name]
        return info.slot_shape(slot), np_dtype(info.slots[slot].dtype)

    def open_arrays(self, keys: Sequence[tuple[str, str]], *, leaf: str | None = None) -> None:
        """Check many atom slots at once: their listings and metadata reads run concurrently.

        Each slot is checked for missing chunk files (which would silently read as zeros) and
        for a zarr.json that disagrees with the manifest; `array` then opens it in TensorStore.

        Raises:
            MismatchError: no such atom or slot.
            ChecksumError: a chunk file is missing or the stored bytes are corrupt.
        """
        keys = [k for k in keys if k not in self._checked_slots]
        if keys:  # (checked ones cost nothing: a restore asks again per piece and per table)
            with self._diagnosed():
                self._open_arrays(keys, leaf)

    def _open_arrays(self, keys: Sequence[tuple[str, str]], leaf: str | None) -> None:
        """`open_arrays` of slots not checked yet."""
        todo = []
        for name, slot in dict.fromkeys(keys):
            info = self.atom(name, leaf=leaf)
            if slot not in info.slots:
                who = f"leaf {leaf!r} needs" if leaf else "wanted"
                fix = ("restore without that optimizer state or save it" if leaf else
                       "pass one of those as the slot")  # fmt: skip
                raise MismatchError(
                    f"{self.path}: {who} slot {slot!r} of atom {name!r}, but it has slots "
                    f"{sorted(info.slots)}; {fix}",
                    leaf=leaf,
                    kind="slot",
                )
            shape, si = info.slot_shape(slot), info.slots[slot]
            todo.append((name, slot, shape, si))
        started: list[tuple[Any, Any, Any]] = []  # (kvstore, its listing or None, zarr.json)
        batch = root = None  # version 3, most arrays wanted: one listing of the database for
        # all, and its one kvstore for every zarr.json read
        if todo and self.manifest.version >= aggregate.AGGREGATED_VERSION:
            total = sum(len(a.slots) for a in self.atoms.values())
            if listing.worth_batching(len(todo), total):
                root = self.data.kv()
                batch = listing.BatchListing(root, [si.path for *_, si in todo])
        for _name, _slot, _shape, si in todo:
            if self.data.local_path is not None:
                folder = paths.refuse_symlinks(self.data.local_path, si.path, "array folder")
                if os.path.isdir(folder):  # else: no chunk file, no zarr.json, said below
                    paths.check_tree(folder, "array folder", metadata_bytes)
            if root is not None:
                started.append((root, None, root.read(f"{si.path}/zarr.json")))
                continue
            kv = self.data.child(si.path).kv()
            started.append((kv, kv.list(), kv.read("zarr.json")))
        for (name, slot, shape, si), (kv, listed, meta) in zip(todo, started):
            where = f"{self.path}: atom {name!r} slot {slot!r}"
            try:
                if listed is None:
                    assert batch is not None
                    present = batch.keys(si.path)
                else:
                    present = {k.decode() for k in listed.result()}
                check_zarr_json(meta.result(), shape, si, where)
                missing = sorted(store.expected_chunk_keys(shape, si) - present)
                if missing:
                    raise ChecksumError(
                        f"{where} is missing {len(missing)} chunk file(s) (e.g. {missing[0]!r}); "
                        "the checkpoint is incomplete: copy it again or restore an earlier one"
                    )
                if self.manifest.version >= aggregate.AGGREGATED_VERSION:
                    self._tables[(name, slot)] = self._process_tables().get(si.path, {})
                elif self.manifest.version >= 2:
                    self._tables[(name, slot)] = integrity.read_table(
                        kv, si, present, where, self.manifest.tables
                    )
                self._checked_slots.add((name, slot))
            except ValueError as e:
                if isinstance(e, UcpError):
                    raise
                raise store.wrap_io_error(e, where) from e

    def direct_reads(self) -> bool:
        """Shards of this checkpoint can be read directly (a local folder, see format/direct.py)."""
        return self.loc.local_path is not None and direct.available()

    def locate_shards(self, regions: Sequence[tuple[str, str, Any]]) -> None:
        """Find where the shards holding these regions lie (version 3: one walk of the B-tree
        nodes that lead to them), before they are read directly.

        Args:
            regions: (atom, slot, box) with box a sequence of (start, stop) per axis.
        """
        if not self.direct_reads() or self.manifest.version < aggregate.AGGREGATED_VERSION:
            return
        assert self.loc.local_path is not None
        if self._ocdbt is None:
            self._ocdbt = ocdbt_index.OcdbtIndex(self.loc.local_path)
        keys = [
            f"{self.atoms[name].slots[slot].path}/{store.chunk_key(index)}".encode()
            for name, slot, box in regions
            for index in direct.shards_in(box, self.atoms[name].slots[slot].chunks)
        ]
        try:
            self._ocdbt.locate(keys)
        except ValueError:
            self._ocdbt = None  # TensorStore reads them all, and says what is wrong

    def shard_extent(
        self, name: str, slot: str, index: tuple[int, ...]
    ) -> ocdbt_index.Extent | None:
        """Where the shard at grid `index` of an atom slot lies in a local folder (None: read it
        through TensorStore)."""
        return self.shard_extent_of_key(self.atoms[name].slots[slot].path, store.chunk_key(index))

    def shard_extent_of_key(self, array: str, key: str) -> ocdbt_index.Extent | None:
        """`shard_extent` by the array's path and the chunk key in it ('c/0/1')."""
        full = f"{array}/{key}"
        if self.manifest.version >= aggregate.AGGREGATED_VERSION:
            return None if self._ocdbt is None else self._ocdbt.found.get(full.encode())
        if self.data.local_path is None or not direct.available():
            return None
        path = os.path.join(self.data.local_path, full)
        try:
            return ocdbt_index.Extent(path, 0, os.stat(path).st_size)
        except OSError:
            return None

    def _process_tables(self) -> dict[str, dict[str, str]]:
        """Format version 3: every process's fingerprint table (read once)."""
        if self._all_tables is None:
            self._all_tables = process_tables.read_process_tables(
                self.data.kv(), self.path, self.manifest.tables
            )
        return self._all_tables

    def check_sizes(self, regions: Sequence[tuple[str, str, Any]]) -> None:
        """Before reading: the chunk files holding these regions have the sizes they need.

        Local stores only (object stores list no sizes). It keeps a damaged or hostile file from
        being decoded into a huge buffer.

        Args:
            regions: (atom, slot, box) with box a sequence of (start, stop) per axis.

        Raises:
            ChecksumError: a chunk file is truncated, padded or of another array.
        """
        if self.data.local_path is None:
            return
        for (name, slot), keys in self._todo(regions, self._sized).items():
            si = self.atoms[name].slots[slot]
            where = f"{self.path}: atom {name!r} slot {slot!r}"
            folder = os.path.join(self.data.local_path, si.path)
            _check_file_sizes(folder, si, sorted(keys), where)
            self._sized[(name, slot)].update(keys)

    def check_fingerprints(self, regions: Sequence[tuple[str, str, Any]]) -> None:
        """The chunk files holding these regions are the ones written there (format version 2).

        Call it after reading them: its few small reads per file then hit the page cache (on a
        cold cache, reading them first costs a disk seek per inner chunk).

        Args:
            regions: (atom, slot, box) with box a sequence of (start, stop) per axis.

        Raises:
            ChecksumError: a chunk file was swapped, replaced or has no recorded fingerprint.
        """
        if self.manifest.version < 2:
            return  # version 1 recorded no fingerprints
        todo = self._todo(regions, self._checked)
        self.open_arrays(list(todo))  # checked, so their tables are loaded
        plans = []
        for (name, slot), keys in todo.items():
            si = self.atoms[name].slots[slot]
            extents: dict[str, tuple[str, int, int]] = {}
            for k in keys:
                ext = self.shard_extent_of_key(si.path, k)
                if ext is not None and ext.inline is None:
                    extents[k] = (ext.path, ext.offset, ext.length)
            seen = self.fingerprints_seen
            known = {k: seen[(e[0], e[1])] for k, e in extents.items() if (e[0], e[1]) in seen}
            plans.append((name, slot, si, keys, extents, known))
        if self.data.local_path is None:
            self._fingerprint_together(plans)
        for name, slot, si, keys, extents, known in plans:
            where = f"{self.path}: atom {name!r} slot {slot!r}"
            kv = lambda path=si.path: self.data.child(path).kv()  # noqa: E731 (only if needed)
            integrity.check(kv, si, sorted(keys), self._tables[(name, slot)], where, extents, known)
            self._checked[(name, slot)].update(keys)

    def _fingerprint_together(self, plans: Sequence[tuple[Any, ...]]) -> None:
        """Fingerprint the chunks of many arrays of an object store in one batch of reads per
        round, into each plan's `known`: a batch per array asked a version-3 checkpoint's
        `manifest.ocdbt` again each time (26 of 30 such requests of a 16-array restore), and
        every process of a job asks the same object."""
        got = integrity.array_fingerprints(self.data.kv(), [
            (si, sorted(k for k in keys if k not in known and k not in extents))
            for _n, _s, si, keys, extents, known in plans
        ])  # fmt: skip
        for _n, _s, si, _keys, _extents, known in plans:
            known.update(got.get(si.path, {}))

    def _todo(
        self, regions: Sequence[tuple[str, str, Any]], done: dict[tuple[str, str], set[str]]
    ) -> dict[tuple[str, str], set[str]]:
        """Chunk keys of `regions` not in `done`, per (atom, slot)."""
        todo: dict[tuple[str, str], set[str]] = {}
        for name, slot, box in regions:
            si = self.atoms[name].slots[slot]
            seen = done.setdefault((name, slot), set())
            keys = set(integrity.keys_in_box(list(box), si.chunks if box else ())) - seen
            if keys:
                todo.setdefault((name, slot), set()).update(keys)
        return todo

    def read(self, name: str, slot: str = "fp32", index: Any = ...) -> np.ndarray:
        """Read any slice of one atom slot; only that region is read from storage.

        Args:
            name: atom name, e.g. 'blocks.0.attn.qkv.weight'.
            slot: 'fp32', 'exp_avg', 'exp_avg_sq', 'step', another optax field, or 'value'.
            index: numpy basic index (ints, negative ones too, slices of any step, ``...``,
                ``None``), with numpy's meaning; only the box it spans is read.

        Raises:
            MismatchError: no such atom or slot.
            IndexError: an index out of range, or not a basic one (the checkpoint is fine).
            ChecksumError: the stored bytes are corrupt.

        >>> ckpt = ucp.open("/tmp/ckpt/step_10")  # doctest: +SKIP
        >>> ckpt.read("layers.0.kernel", "exp_avg", np.s_[:4])  # doctest: +SKIP
        """
        arr = self.array(name, slot)
        shape = tuple(arr.shape)
        box, local = basic_index(index, shape, f"{self.path}: atom {name!r} slot {slot!r}")
        with self._diagnosed():
            try:
                region = arr[tuple(slice(a, b) for a, b in box)] if shape else arr
                where = [(name, slot, box)]
                self.check_sizes(where)
                out = np.asarray(region.read().result())
                self.check_fingerprints(where)
            except ValueError as e:
                if isinstance(e, UcpError):
                    raise
                raise store.wrap_io_error(e, f"{self.path}: atom {name!r} slot {slot!r}") from e
        return out[local]


def _check_file_sizes(folder: str, si: Any, keys: Sequence[str], where: str) -> None:
    """Local arrays: each chunk file has the size its chunk needs (checked before it is read)."""
    from .util.dtypes import np_dtype

    itemsize = np_dtype(si.dtype).itemsize
    n = integrity.inner_per_shard(si)
    for key in keys:
        size = os.stat(os.path.join(folder, key)).st_size
        if si.inner_chunks is None:
            ok, want = size == math.prod(si.chunks) * itemsize + 4, "exactly"
            limit = math.prod(si.chunks) * itemsize + 4
        else:
            limit = n * (math.prod(si.inner_chunks) * itemsize + 4) + 16 * n + 4
            ok, want = 16 * n + 4 <= size <= limit, "at most"
        if not ok:
            raise ChecksumError(
                f"{where}: chunk file {key!r} is {size} bytes, expected {want} {limit}: "
                "truncated, padded or not of this array; the checkpoint is damaged"
            )


def open_checkpoint(path: Any) -> Checkpoint:
    """Open a committed universal checkpoint.

    Raises:
        NotACheckpointError: nothing committed there.
        FormatVersionError: written by a newer format version.

    >>> ckpt = ucp.open("/tmp/ckpt/step_10")  # doctest: +SKIP
    >>> ckpt.step, sorted(ckpt.atoms)[:2]  # doctest: +SKIP
    """
    return Checkpoint(path)


def list_checkpoints(directory: Any) -> list[Any]:
    """Committed checkpoints directly under `directory`; partial or killed saves are never listed.

    Paths for a path or URL; `ucp.Location`s for a kvstore spec (dict) or a Location.

    >>> ucp.list_checkpoints("/tmp/ckpt")  # doctest: +SKIP
    ['/tmp/ckpt/step_10', '/tmp/ckpt/step_20']
    """
    return index.list_checkpoints(directory)
