"""The versioned manifest of a universal checkpoint: atoms, slots, shapes, dtypes, patterns, source."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import Any

from ..errors import ChecksumError, FormatVersionError, NotACheckpointError
from ..mapping.slot_names import PARAM_SLOT as PARAM_SLOT
from ..mapping.slot_names import SLOT_ALIASES as SLOT_ALIASES
from ..mapping.slot_names import STEP_SLOT as STEP_SLOT
from ..mapping.slot_names import VALUE_SLOT as VALUE_SLOT
from ..untrusted.json import read_json
from ..untrusted.limits import MAX_MANIFEST_BYTES
from ..untrusted.paths import atom_dir as atom_dir
from .validate import check_consistent, check_manifest
from .version import __version__

FORMAT = "ucp/1"
# 1: arrays, manifest, COMMIT. 2 (written now): + the sha256 of manifest.json in COMMIT, of each
# zarr.json in the manifest, and a fingerprint table per array (see integrity.py). Both are read.
FORMAT_VERSION = 3  # the newest this ucp_jax reads and writes (3: the aggregated layout)
PER_ARRAY_VERSION = 2  # one folder per array, one file per chunk (importers; older saves)
MANIFEST = "manifest.json"
COMMIT = "COMMIT"


def source_header(**fields: Any) -> dict[str, Any]:
    """The manifest's `source` record of a checkpoint this library writes (saves and imports).

    `fields` (the writer's own: jax version, process count, the source framework, ...) come
    between the library's name and version and the time of writing.

    >>> list(source_header(jax="0.10"))
    ['library', 'version', 'jax', 'time']
    """
    return {
        "library": "ucp_jax",
        "version": __version__,
        **fields,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """One stored array: a slot (fp32, exp_avg, ...) of an atom.

    `shape` is None when the slot has the atom's shape (always, for slots saved from JAX); a slot
    imported from DeepSpeed may differ, e.g. `step`, a scalar per atom.
    """

    dtype: str
    path: str
    chunks: tuple[int, ...]
    inner_chunks: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    meta_sha256: str | None = None  # of its zarr.json, recorded at commit (format version 2)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dtype": self.dtype,
            "path": self.path,
            "chunks": list(self.chunks),
            "inner_chunks": None if self.inner_chunks is None else list(self.inner_chunks),
        }
        if self.shape is not None:
            out["shape"] = list(self.shape)
        if self.meta_sha256 is not None:
            out["meta_sha256"] = self.meta_sha256
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SlotInfo:
        inner = d.get("inner_chunks")
        shape = d.get("shape")
        return cls(
            d["dtype"],
            d["path"],
            tuple(d["chunks"]),
            None if inner is None else tuple(inner),
            None if shape is None else tuple(shape),
            d.get("meta_sha256"),
        )


@dataclasses.dataclass(frozen=True)
class AtomInfo:
    """An atom: a parameter (or optimizer leaf) as the unsharded model holds it.

    Attributes:
        shape: the atom's shape (padding stripped).
        dtype: dtype of its main slot (`fp32` for parameters, else the first slot).
        slots: slot name -> SlotInfo.
        pattern: the pattern chain (JSON) of the leaf that produced it, atom outward.
        leaf: name of the leaf that produced it.
        fused: sub-param fusions recorded for it: [{"sizes": [...], "axis": a}].
        role: for optimizer leaves that mirror no parameter, e.g. 'ScaleByAdamState.count'.
    """

    shape: tuple[int, ...]
    dtype: str
    slots: dict[str, SlotInfo]
    pattern: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    leaf: str = ""
    fused: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    role: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of all slots together."""
        import numpy as np

        from ..util.dtypes import np_dtype

        return sum(
            int(np.prod(self.slot_shape(k), dtype=np.int64)) * np_dtype(s.dtype).itemsize
            for k, s in self.slots.items()
        )

    def slot_shape(self, slot: str) -> tuple[int, ...]:
        """Shape of one stored slot: the atom's shape unless the slot records its own."""
        own = self.slots[slot].shape
        return tuple(self.shape) if own is None else tuple(own)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "slots": {k: v.to_json() for k, v in self.slots.items()},
            "pattern": self.pattern,
            "leaf": self.leaf,
            "fused": self.fused,
        }
        if self.role is not None:
            out["role"] = self.role
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AtomInfo:
        return cls(
            shape=tuple(d["shape"]),
            dtype=d["dtype"],
            slots={k: SlotInfo.from_json(v) for k, v in d["slots"].items()},
            pattern=list(d.get("pattern", [])),
            leaf=d.get("leaf", ""),
            fused=list(d.get("fused", [])),
            role=d.get("role"),
        )


@dataclasses.dataclass
class Manifest:
    """The whole manifest: what a reader needs to find, check and map every stored array."""

    step: int | None
    atoms: dict[str, AtomInfo]
    leaves: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    rules: list[list[Any]] = dataclasses.field(default_factory=list)
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: Any = None
    format: str = FORMAT
    version: int = PER_ARRAY_VERSION
    # The sha256 of every fingerprint table beside it (key relative to the data root -> sha256),
    # recorded at commit (`commit.seal`): it ties the data to this manifest (see integrity.py).
    # None in manifests written before it was recorded (they are still read, without that tie).
    tables: dict[str, str] | None = None
    # The COMMIT it was read with (not part of the manifest): a reader compares it with the COMMIT
    # there now to tell a checkpoint replaced under it (restore.py) from a damaged one.
    marker: bytes | None = dataclasses.field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "format_version": self.version,
            "step": self.step,
            "atoms": {k: v.to_json() for k, v in self.atoms.items()},
            "leaves": self.leaves,
            "rules": self.rules,
            "source": self.source,
            "extra": self.extra,
            **({} if self.tables is None else {"tables": self.tables}),
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=False).encode()

    @classmethod
    def loads(cls, data: bytes, where: str, marker: bytes | None = None) -> Manifest:
        """Parse a manifest, refusing newer format versions and foreign files.

        `marker`: the checkpoint's COMMIT, compared (`check_commit`) after the manifest's
        structure is checked and before whether it contradicts itself, so that an edited
        manifest is reported as such.

        Raises:
            NotACheckpointError: the file is not a ucp manifest, or contradicts itself.
            FormatVersionError: written by a newer ucp_jax.
            ChecksumError: not the manifest COMMIT records.
        """
        d = read_json(data, f"{where}: manifest.json", max_bytes=MAX_MANIFEST_BYTES)
        fmt = d.get("format", "") if isinstance(d, dict) else ""
        if not isinstance(fmt, str) or not fmt.startswith("ucp/"):
            raise NotACheckpointError(
                f"{where}: manifest format is {fmt!r}, expected 'ucp/<version>'; "
                "this is not a universal checkpoint"
            )
        version = _format_version(d, fmt, where)
        if version > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: checkpoint format version {version} is newer than this ucp_jax reads "
                f"(<= {FORMAT_VERSION}); upgrade ucp_jax (pip install -U ucp_jax)"
            )
        check_manifest(d, where)
        if marker is not None:
            check_commit(marker, data, version, where)
        check_consistent(d, where, version)
        try:
            return cls(
                step=d.get("step"),
                atoms={k: AtomInfo.from_json(v) for k, v in d["atoms"].items()},
                leaves=d.get("leaves", {}),
                rules=d.get("rules", []),
                source=d.get("source", {}),
                extra=d.get("extra"),
                format=fmt,
                version=version,
                tables=d.get("tables"),
                marker=marker,
            )
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise NotACheckpointError(
                f"{where}: manifest.json is malformed ({type(e).__name__}: {e}); the checkpoint "
                "is damaged: restore an earlier checkpoint"
            ) from e


def _format_version(d: Mapping[str, Any], fmt: str, where: str) -> int:
    """The manifest's format version: an int from 1 up (from the `format` string when absent)."""
    raw: Any = d.get("format_version") if "format_version" in d else fmt.split("/")[1]
    if isinstance(raw, str) and "format_version" not in d and raw.isdecimal():
        raw = int(raw)
    if type(raw) is not int or raw < 1:
        raise NotACheckpointError(
            f"{where}: manifest.json has an unreadable format version ({raw!r}; expected an int "
            f"from 1 to {FORMAT_VERSION}); the manifest was edited or damaged: restore an earlier "
            "checkpoint"
        )
    return raw


def commit_marker(manifest_bytes: bytes) -> bytes:
    """The bytes of `COMMIT` for a manifest: the format, and the manifest's sha256.

    >>> commit_marker(b"{}").splitlines()[0]
    b'ucp/1'
    """
    import hashlib

    return f"{FORMAT}\nmanifest-sha256 {hashlib.sha256(manifest_bytes).hexdigest()}\n".encode()


def check_commit(marker: bytes, manifest_bytes: bytes, version: int, where: str) -> None:
    """Refuse a manifest that is not the one committed (format version 2 and later).

    Raises:
        ChecksumError: COMMIT records another sha256 (the manifest was edited or damaged), or
            none although the manifest says it should.
    """
    if version < 2:
        return  # version 1 committed no checksum: nothing to compare
    if marker != commit_marker(manifest_bytes):
        raise ChecksumError(
            f"{where}: manifest.json is not the manifest that was committed (its sha256 differs "
            "from the one in COMMIT): it was edited or damaged; restore an earlier checkpoint"
        )
