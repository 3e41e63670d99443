"""A committed universal checkpoint, opened for inspection and region reads (no JAX needed).

`ucp.open` returns one; `ucp.restore` and the CLI (`ucp inspect`, `ucp verify`, the converters'
summaries) read through it, so that tools that only touch files never import JAX.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import ChecksumError, MismatchError
from .format import store
from .format.manifest import AtomInfo, Manifest


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
        self._arrays: dict[tuple[str, str], Any] = {}

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
        close = difflib.get_close_matches(name, list(self.atoms), n=3)
        who = f"leaf {leaf!r} needs atom" if leaf else "atom"
        raise MismatchError(
            f"{self.path}: {who} {name!r}, which the checkpoint does not have"
            + (f" (close: {close})" if close else "")
            + "; add a rule mapping the leaf to its atom, or restore a matching tree"
        )

    def array(self, name: str, slot: str, *, leaf: str | None = None) -> Any:
        """The TensorStore array of one atom slot (opened once)."""
        key = (name, slot)
        if key not in self._arrays:
            self.open_arrays([key], leaf=leaf)
        return self._arrays[key]

    def open_arrays(self, keys: Sequence[tuple[str, str]], *, leaf: str | None = None) -> None:
        """Open many atom slots at once: their listings and metadata reads run concurrently.

        Each slot is checked for missing chunk files (which would silently read as zeros).

        Raises:
            MismatchError: no such atom or slot.
            ChecksumError: a chunk file is missing or the stored bytes are corrupt.
        """
        todo = []
        for name, slot in dict.fromkeys(keys):
            if (name, slot) in self._arrays:
                continue
            info = self.atom(name, leaf=leaf)
            if slot not in info.slots:
                who = f"leaf {leaf!r} needs" if leaf else "wanted"
                raise MismatchError(
                    f"{self.path}: {who} slot {slot!r} of atom {name!r}, but it has slots "
                    f"{sorted(info.slots)}; restore without that optimizer state or save it"
                )
            shape, si = info.slot_shape(slot), info.slots[slot]
            todo.append((name, slot, shape, si))
        started = []
        for name, slot, shape, si in todo:
            try:
                started.append(
                    (
                        store.list_chunks_async(self.loc, si),
                        store.open_array_async(self.loc, shape, si),
                    )
                )
            except ValueError as e:
                raise store.wrap_io_error(e, f"{self.path}: atom {name!r} slot {slot!r}") from e
        for (name, slot, shape, si), (listing, opening) in zip(todo, started):
            try:
                missing = store.missing_of(listing, shape, si)
                if missing:
                    raise ChecksumError(
                        f"{self.path}: atom {name!r} slot {slot!r} is missing {len(missing)} chunk "
                        f"file(s) (e.g. {missing[0]!r}); the checkpoint is incomplete: copy it "
                        "again or restore an earlier one"
                    )
                self._arrays[(name, slot)] = opening.result()
            except ValueError as e:
                raise store.wrap_io_error(e, f"{self.path}: atom {name!r} slot {slot!r}") from e

    def read(self, name: str, slot: str = "fp32", index: Any = ...) -> np.ndarray:
        """Read any slice of one atom slot; only that region is read from storage.

        Args:
            name: atom name, e.g. 'blocks.0.attn.qkv.weight'.
            slot: 'fp32', 'exp_avg', 'exp_avg_sq', 'step', another optax field, or 'value'.
            index: numpy-style basic index (ints, slices, Ellipsis).

        Raises:
            MismatchError: no such atom or slot.
            ChecksumError: the stored bytes are corrupt.

        >>> ckpt = ucp.open("/tmp/ckpt/step_10")  # doctest: +SKIP
        >>> ckpt.read("layers.0.kernel", "exp_avg", np.s_[:4])  # doctest: +SKIP
        """
        arr = self.array(name, slot)
        try:
            return np.asarray(arr[index].read().result())
        except ValueError as e:
            raise store.wrap_io_error(e, f"{self.path}: atom {name!r} slot {slot!r}") from e


def open_checkpoint(path: Any) -> Checkpoint:
    """Open a committed universal checkpoint.

    Raises:
        NotACheckpointError: nothing committed there.
        FormatVersionError: written by a newer format version.

    >>> ckpt = ucp.open("/tmp/ckpt/step_10")  # doctest: +SKIP
    >>> ckpt.step, sorted(ckpt.atoms)[:2]  # doctest: +SKIP
    """
    return Checkpoint(path)


def list_checkpoints(directory: Any) -> list[str]:
    """Committed checkpoints directly under `directory`; partial or killed saves are never listed.

    >>> ucp.list_checkpoints("/tmp/ckpt")  # doctest: +SKIP
    ['/tmp/ckpt/step_10', '/tmp/ckpt/step_20']
    """
    return store.list_checkpoints(directory)
