"""Reading an Orbax checkpoint as a tree of lazily readable arrays, through Orbax's own readers.

What Orbax writes, and what is accepted as `src`:

- an item folder (`_METADATA` + OCDBT `manifest.ocdbt`/`d/`, or one zarr folder per array; zarr2
  or zarr3): what `StandardCheckpointer` / `PyTreeCheckpointer` write, and each PyTree item of a
  `CheckpointManager` step;
- a `CheckpointManager` step folder (`<root>/<step>/`, one sub-folder per item: `default`, or the
  `Composite` keys such as `state`, `params`, `opt_state`);
- a `CheckpointManager` root: its latest finalized step (or `step=`).

The tree comes from `PyTreeCheckpointHandler.metadata` (shapes, dtypes, array names; no array is
read), each array is opened with the TensorStore spec Orbax itself reads it with
(`type_handlers.get_json_tspec_read`), so OCDBT, zarr2/zarr3 and multi-process checkpoints read
as Orbax reads them. Nothing is read here beyond metadata.

>>> src = open_orbax("/ckpt/1000")  # doctest: +SKIP
>>> src.tree["params"]["dense"]["kernel"]  # a ShapeDtypeStruct; src.leaves[id(...)] reads it  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ...errors import ArgumentError, NotACheckpointError, UcpError
from ...format.manifest import COMMIT
from ...format.store import committed_below
from ...untrusted.paths import check_component, refuse_symlinks
from .destination import not_local

METADATA = "_METADATA"  # an Orbax PyTree item's tree metadata
STEP_METADATA = "_CHECKPOINT_METADATA"  # an Orbax step folder's metadata
_TMP = ".orbax-checkpoint-tmp"


class OrbaxImportError(UcpError, ValueError):
    """An Orbax checkpoint is damaged, or holds something this importer cannot read."""


@dataclasses.dataclass(frozen=True)
class OrbaxArray:
    """One array of an Orbax item: where Orbax stored it and how to open it.

    Attributes:
        item: the item's folder.
        name: Orbax's name of the array inside the item (its dotted key path).
        keys: its key path in the item's tree.
        use_zarr3: stored as zarr3 (else zarr2).
        ocdbt: stored in the item's OCDBT database (else one folder per array).
    """

    item: str
    name: str
    keys: tuple[str, ...]
    use_zarr3: bool
    ocdbt: bool

    def spec(self, context: Any) -> dict[str, Any]:
        """The TensorStore spec Orbax reads this array with."""
        import orbax.checkpoint as ocp
        from etils import epath

        info = ocp.type_handlers.ParamInfo(
            name=self.name, parent_dir=epath.Path(self.item), use_zarr3=self.use_zarr3,
            ts_context=context,
        )  # fmt: skip
        return ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self.ocdbt)


@dataclasses.dataclass
class OrbaxSource:
    """An Orbax checkpoint opened for import.

    Attributes:
        path: what was opened.
        items: item name -> item folder.
        tree: the checkpoint as one tree of `jax.ShapeDtypeStruct` (several items: a dict by
            item name; one item: its tree). NNX `{"value": x}` wrappers are unwrapped; dicts
            with the fields of an optax state become that state.
        leaves: id(ShapeDtypeStruct in `tree`) -> its OrbaxArray.
        step: the step folder's number, when there is one.
        skipped: names of leaves that hold no array (strings, None, empty nodes).
    """

    path: str
    items: dict[str, str]
    tree: Any
    leaves: dict[int, OrbaxArray]
    step: int | None
    skipped: list[str]


def _is_item(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, METADATA))


def _subdirs(folder: str) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(folder) if e.is_dir(follow_symlinks=False))
    except OSError as e:
        raise NotACheckpointError(f"{folder}: cannot list the folder ({e.strerror or e})") from e


def _steps(root: str) -> dict[int, str]:
    """Finalized steps of a CheckpointManager root: number -> folder (`<n>` or `<prefix>_<n>`)."""
    out = {}
    for name in _subdirs(root):
        m = re.fullmatch(r"(?:.*_)?(\d+)", name)
        if m and _TMP not in name and os.path.isfile(os.path.join(root, name, STEP_METADATA)):
            out[int(m.group(1))] = os.path.join(root, name)
    return out


def local_folder(path: Any, what: str) -> str:
    """The local folder of an Orbax checkpoint read or written through Orbax's own API here.

    Raises:
        ArgumentError: a URL (``s3://``, ``gs://``) or a kvstore spec: such a path is not
            turned into a local folder of that name.
    """
    if not_local(path):
        raise ArgumentError(
            f"{str(path)[:200]}: {what} is a local folder here (Orbax's own readers and writers "
            "are used); copy it from the store first, or write it locally and copy it there "
            "(universal checkpoints themselves go to s3:// and gs:// directly)"
        )
    s = os.fspath(path)
    return os.path.abspath(s[len("file://") :] if s.startswith("file://") else s)


def locate(src: Any, *, item: str | None = None, step: int | None = None) -> tuple[
    dict[str, str], int | None
]:  # fmt: skip
    """The PyTree item folders to import, and the step folder's number.

    Raises:
        NotACheckpointError: `src` is no Orbax item, step folder or CheckpointManager root, or
            `item` / `step` is not in it.
    """
    path = local_folder(src, "an Orbax checkpoint to import")
    if not os.path.isdir(path):
        raise NotACheckpointError(f"{path}: no such folder (expected an Orbax checkpoint)")
    if _is_item(path):
        if item is not None:
            raise NotACheckpointError(
                f"{path}: is a single Orbax item, so item={item!r} does not apply; drop it"
            )
        m = re.fullmatch(r"(?:.*_)?(\d+)", os.path.basename(os.path.dirname(path)))
        return {os.path.basename(path): path}, int(m.group(1)) if m else None
    steps = _steps(path)
    if steps and not any(_is_item(os.path.join(path, d)) for d in _subdirs(path)):
        if step is None:
            step = max(steps)
        if step not in steps:
            raise NotACheckpointError(
                f"{path}: a CheckpointManager root without step {step}; it has {sorted(steps)}"
            )
        path = steps[step]
    elif step is not None:
        m = re.fullmatch(r"(?:.*_)?(\d+)", os.path.basename(path))
        if not m or int(m.group(1)) != step:
            raise NotACheckpointError(f"{path}: not step {step}; pass the CheckpointManager root")
    items = {d: os.path.join(path, d) for d in _subdirs(path) if _is_item(os.path.join(path, d))}
    if not items:
        universal = committed_below(path, _subdirs(path), depth=1)
        if os.path.isfile(os.path.join(path, COMMIT)) or universal:
            what = universal[0] if universal else path
            raise NotACheckpointError(
                f"{path}: not an Orbax checkpoint: {what} is a universal checkpoint already (saved "
                "through ucp's UniversalSave handler); open or restore it as it is, no conversion"
            )
        raise NotACheckpointError(
            f"{path}: not an Orbax checkpoint: no {METADATA} here, no item folder holding one, "
            "and no finalized step folders; pass an item folder (StandardCheckpointer), a "
            "CheckpointManager step folder or its root"
        )
    if item is not None:
        check_component(item, f"{path}: item")
        if item not in items:
            raise NotACheckpointError(
                f"{path}: has no PyTree item {item!r}; its items: {sorted(items)}"
            )
        items = {item: items[item]}
    for name in items:
        refuse_symlinks(path, name, "Orbax item folder")
    m = re.fullmatch(r"(?:.*_)?(\d+)", os.path.basename(path))
    return items, int(m.group(1)) if m else None


def _optax_states() -> dict[frozenset[str], type]:
    """Field set -> optax NamedTuple state class, for field sets one class has (or Adam's).

    AdaBelief's state has Adam's fields; such a dict is taken as Adam's (the common case).
    """
    try:
        import optax
    except ImportError:  # pragma: no cover - optax is a dependency of the tests only
        return {}
    seen: dict[frozenset[str], list[type]] = {}
    for mod in (optax, getattr(optax, "contrib", None)):
        for name in dir(mod or ()):
            cls = getattr(mod, name, None)
            fields = getattr(cls, "_fields", None)
            if isinstance(cls, type) and name.endswith("State") and fields:
                seen.setdefault(frozenset(fields), []).append(cls)
    out = {}
    for k, classes in seen.items():
        names = {c.__name__ for c in classes}
        if len(names) == 1 or "ScaleByAdamState" in names:
            out[k] = next(c for c in classes if len(names) == 1 or c.__name__ == "ScaleByAdamState")
    return out


def _read_tree_metadata(item: str) -> Any:
    """The item's tree metadata, as Orbax reads it."""
    import orbax.checkpoint as ocp
    from etils import epath

    try:
        return ocp.PyTreeCheckpointHandler().metadata(epath.Path(item))
    except UcpError:
        raise
    except Exception as e:  # Orbax raises anything from json, zarr or tensorstore here
        raise OrbaxImportError(
            f"{item}: Orbax cannot read the item's metadata ({type(e).__name__}: "
            f"{str(e)[:300]}); the checkpoint is damaged or incomplete (was it copied whole?)"
        ) from e


class _Builder:
    """Turns Orbax metadata trees into one tree of ShapeDtypeStructs (+ where each is stored)."""

    def __init__(self) -> None:
        self.leaves: dict[int, OrbaxArray] = {}
        self.skipped: list[str] = []
        self.optax = _optax_states()

    def item(self, name: str, folder: str) -> Any:
        md = _read_tree_metadata(folder)
        tree = getattr(md, "tree", md)
        use_zarr3 = bool(getattr(md, "use_zarr3", False))
        ocdbt = os.path.isfile(os.path.join(folder, "manifest.ocdbt"))
        return self.node(tree, (), folder, use_zarr3, ocdbt)

    def node(self, x: Any, keys: tuple[str, ...], item: str, zarr3: bool, ocdbt: bool) -> Any:
        where = ".".join(keys) or "<root>"
        if isinstance(x, Mapping):
            if list(x.keys()) == ["value"] and not isinstance(x["value"], Mapping | list | tuple):
                return self.node(x["value"], keys, item, zarr3, ocdbt)  # an NNX Variable
            out = {}
            for k, v in x.items():
                if not isinstance(k, str | int):
                    raise OrbaxImportError(f"{item}: key {k!r} under {where!r} is not a name")
                child = self.node(v, (*keys, str(k)), item, zarr3, ocdbt)
                if child is not None:
                    out[str(k)] = child
            cls = self.optax.get(frozenset(out))
            if cls is not None and set(out) == set(x.keys()):
                return cls(**out)
            return out or None
        if isinstance(x, list | tuple):
            children = [self.node(v, (*keys, str(i)), item, zarr3, ocdbt) for i, v in enumerate(x)]
            return children if any(c is not None for c in children) else None
        shape, dtype, name = getattr(x, "shape", None), getattr(x, "dtype", None), None
        name = getattr(x, "name", None)
        if x is None or shape is None or dtype is None or type(x).__name__ == "StringMetadata":
            if x is not None:
                self.skipped.append(where)
            return None
        try:
            dt = np.dtype(dtype)
            shp = tuple(int(d) for d in shape)
        except (TypeError, ValueError) as e:
            raise OrbaxImportError(
                f"{item}: leaf {where!r} has shape {shape!r} / dtype {dtype!r}, expected a "
                f"tuple of sizes and a numpy dtype ({e}); the metadata is damaged"
            ) from e
        if not isinstance(name, str) or not name:
            raise OrbaxImportError(f"{item}: leaf {where!r} has no array name in the metadata")
        if not ocdbt:  # the array is a folder of that name inside the item
            check_component(name, f"{item}: array name of leaf {where!r}")
        leaf = jax.ShapeDtypeStruct(shp, dt)
        self.leaves[id(leaf)] = OrbaxArray(item, name, keys, zarr3, ocdbt)
        return leaf


def open_orbax(src: Any, *, item: str | None = None, step: int | None = None) -> OrbaxSource:
    """Open an Orbax checkpoint's metadata (no array is read).

    Args:
        src: an Orbax item folder, a CheckpointManager step folder, or its root.
        item: the only item to take from a step folder (default: every PyTree item).
        step: the step to take from a CheckpointManager root (default: the latest).

    Returns:
        The OrbaxSource.

    Raises:
        NotACheckpointError: `src` is not an Orbax checkpoint (see `locate`).
        OrbaxImportError: its metadata is damaged or unreadable.

    >>> open_orbax("/ckpt", step=1000).items  # doctest: +SKIP
    {'params': '/ckpt/1000/params', 'opt_state': '/ckpt/1000/opt_state'}
    """
    items, found_step = locate(src, item=item, step=step)
    b = _Builder()
    trees = {name: b.item(name, folder) for name, folder in items.items()}
    trees = {k: v for k, v in trees.items() if v is not None}
    if not trees:
        raise OrbaxImportError(f"{os.fspath(src)}: the checkpoint holds no arrays")
    tree = next(iter(trees.values())) if len(trees) == 1 else trees
    return OrbaxSource(os.fspath(src), items, tree, b.leaves, found_step, b.skipped)


def array_names(src: OrbaxSource) -> Sequence[str]:
    """Orbax's names of every array, for messages."""
    return [a.name for a in src.leaves.values()]


OCDBT_CACHE_BYTES = 16 << 20  # the OCDBT B-tree node cache of a reader (Orbax's default: 100 MB)


class ArrayReader:
    """Opens arrays of an OrbaxSource with the TensorStore spec Orbax reads them with.

    One TensorStore context (a small OCDBT node cache) for all of them; each array is opened
    once, checked against the item's metadata, and read by boxes (`read(leaf, index)` returns
    a future of the numpy data).
    """

    def __init__(self, src: OrbaxSource) -> None:
        import tensorstore as ts

        self.src = src
        self.ctx = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": OCDBT_CACHE_BYTES}})
        self._open: dict[int, Any] = {}

    def array(self, leaf: Any) -> Any:
        """The opened TensorStore array of a ShapeDtypeStruct of `src.tree`."""
        import tensorstore as ts

        got = self._open.get(id(leaf))
        if got is not None:
            return got
        a = self.src.leaves[id(leaf)]
        try:
            arr = ts.open(a.spec(self.ctx), open=True, read=True, context=self.ctx).result()
        except ValueError as e:
            raise OrbaxImportError(
                f"{a.item}: cannot open array {a.name!r} as Orbax wrote it ({str(e)[:300]}); "
                "the checkpoint is damaged or incomplete"
            ) from e
        found = (tuple(arr.shape), arr.dtype.numpy_dtype)
        if found != (tuple(leaf.shape), np.dtype(leaf.dtype)):
            raise OrbaxImportError(
                f"{a.item}: array {a.name!r} is stored with shape {found[0]} / {found[1]}, but "
                f"the item's metadata says {tuple(leaf.shape)} / {leaf.dtype}; damaged"
            )
        self._open[id(leaf)] = arr
        return arr

    def read(self, leaf: Any, index: Any = ()) -> Any:
        """A future of `array(leaf)[index]` as numpy data (`result(leaf, future)` waits)."""
        return self.array(leaf)[index].read()

    def result(self, leaf: Any, fut: Any) -> np.ndarray:
        try:
            return np.asarray(fut.result())
        except ValueError as e:
            a = self.src.leaves[id(leaf)]
            raise OrbaxImportError(
                f"{a.item}: reading array {a.name!r} failed ({str(e)[:300]}); its data files "
                "are missing or damaged"
            ) from e

    def whole(self, leaf: Any) -> np.ndarray:
        """A (small) array read whole."""
        return self.result(leaf, self.read(leaf))
