"""Orbax checkpoint -> universal checkpoint: `ucp convert orbax SRC DST` / `ucp.import_orbax`.

The Orbax tree is bound to atoms exactly as `ucp.save` binds a train state, so a converted
checkpoint is the one `ucp.save(params, opt_state)` would have written from the restored state:

- the tree's `params` (a `TrainState`'s field, or a `params` item of a `CheckpointManager`) are
  the parameters; a tree without `params` is all parameters (e.g. `nnx.state(model)`);
- `opt_state` is an optax state: subtrees with the parameters' names and shapes are moments,
  stored as slots of their parameter's atom (Adam's `mu`/`nu` -> `exp_avg`/`exp_avg_sq`); dicts
  with the fields of an optax state class are recognized as that class (so `count` keeps its
  role, `ScaleByAdamState.count`);
- `step` becomes the manifest's step (else the step folder's number);
- anything else at the top (`batch_stats`, ...) becomes atoms of its own dotted name.

Names follow `mapping.names`: NNX `{"value": x}` wrappers and a lone Linen `params` collection
are not part of atom names. `rules` map leaves to atoms as in `ucp.save` (e.g. `ucp.Stacked` to
import a scanned `[layers, ...]` leaf as per-layer atoms).

Streaming: each array is read by TensorStore (through the spec Orbax reads it with) chunk by
chunk (Orbax's chunks, each decoded once; blocks of at most 32 MiB for a leaf with a pattern or
huge chunks), half the budget ahead, and each block goes straight into the atoms' arrays
(`AtomWriter`: digests, integrity tables, COMMIT), whose shards are cut inside Orbax's chunks so
that each is written whole, once. Peak host memory is about `2 * max_inflight_bytes` plus a few
blocks, whatever the checkpoint's size.

>>> ucp.import_orbax("/ckpt/1000", "/tmp/ucp/step_1000")  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ...errors import LimitError, MismatchError, PatternError, UcpError
from ...mapping.binding import LeafBinding, bind_state, describe_leaf
from ...mapping.boxes import Box, full_box, relative_slices, to_slices
from ...mapping.rules import CompiledRules, Rule
from ...util import config
from ..common.orbax_source import OrbaxArray, OrbaxImportError, OrbaxSource, open_orbax
from ..common.writer import AtomWriter, import_chunks

OCDBT_CACHE_BYTES = 16 << 20
MAX_CHUNK_BLOCK = 128 << 20  # source chunks up to this big are read whole, one at a time
MAX_ELEMENTS = 1 << 48  # of one array; more is a damaged or hostile shape
F = TypeVar("F", bound=Callable[..., Any])


def _wrap_errors(fn: F) -> F:
    """Raw errors from bad input become OrbaxImportError naming `src`; UcpErrors pass."""

    @functools.wraps(fn)
    def wrapper(src: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(src, *args, **kwargs)
        except (UcpError, FileExistsError, KeyboardInterrupt):
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
            raise OrbaxImportError(
                f"{os.fspath(src)}: import_orbax failed on unexpected content "
                f"({type(e).__name__}: {str(e)[:300]}); the checkpoint is damaged or not one "
                "Orbax's PyTree handler wrote"
            ) from e

    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------------------------- the tree


def split_state(tree: Any) -> tuple[Any, Any, Any, Any]:
    """(params, opt_state, other top-level entries, step leaf) of an imported tree.

    >>> import numpy as np
    >>> split_state({"params": 1, "opt_state": 2, "step": np.int32(3), "batch_stats": 4})
    (1, 2, {'batch_stats': 4}, np.int32(3))
    >>> split_state({"dense": 1})
    ({'dense': 1}, None, None, None)
    """
    if not isinstance(tree, Mapping) or "params" not in tree or len(tree) == 1:
        return tree, None, None, None
    rest = {k: v for k, v in tree.items() if k not in ("params", "opt_state", "step")}
    step = tree.get("step")
    if step is not None and getattr(step, "shape", None) != ():
        rest["step"] = step  # not a step counter: import it as an atom
        step = None
    return tree["params"], tree.get("opt_state"), rest or None, step


def leaf_blocks(shape: Sequence[int], itemsize: int) -> list[Box]:
    """Boxes tiling an array in C order, each at most one import shard (32 MiB).

    They are the shards `AtomWriter` gives an atom of this shape, so a leaf mapped to an atom
    as it is writes each shard file once, whole.

    >>> leaf_blocks((4, 3), 4)
    [((0, 4), (0, 3))]
    """
    if not shape:
        return [()]
    if any(int(d) == 0 for d in shape):
        return []
    outer, _ = import_chunks(shape, itemsize)
    grids = [range(0, int(d), int(c)) for d, c in zip(shape, outer)]
    out: list[Box] = [()]
    for g, d, c in zip(grids, shape, outer):
        out = [(*b, (lo, min(lo + int(c), int(d)))) for b in out for lo in g]
    return out


# --------------------------------------------------------------------------------- streaming


class _Reader:
    """Opens the source arrays (concurrently) and reads blocks of them ahead, within a budget."""

    def __init__(self, src: OrbaxSource, bindings: Sequence[LeafBinding]) -> None:
        import tensorstore as ts

        # the resource Orbax's OCDBT specs name, with a small B-tree node cache: Orbax's
        # default (100 MB) would be most of this importer's memory
        self.ctx = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": OCDBT_CACHE_BYTES}})
        self.where: dict[str, OrbaxArray] = {}
        futs = []
        for b in bindings:
            a = src.leaves[id(b.value)]
            self.where[b.name] = a
            futs.append((b, a, ts.open(a.spec(self.ctx), open=True, read=True, context=self.ctx)))
        self.arrays: dict[str, Any] = {}
        for b, a, fut in futs:
            try:
                arr = fut.result()
            except ValueError as e:
                raise OrbaxImportError(
                    f"{a.item}: cannot open array {a.name!r} (leaf {b.name!r}) as Orbax wrote it "
                    f"({str(e)[:300]}); the checkpoint is damaged or incomplete"
                ) from e
            found = (tuple(arr.shape), arr.dtype.numpy_dtype)
            if found != (b.shape, b.dtype):
                raise OrbaxImportError(
                    f"{a.item}: array {a.name!r} (leaf {b.name!r}) is stored with shape "
                    f"{found[0]} / {found[1]}, but the item's metadata says {b.shape} / "
                    f"{b.dtype}; the checkpoint is damaged"
                )
            self.arrays[b.name] = arr

    def scalar(self, src: OrbaxSource, leaf: Any) -> int:
        """The value of a scalar leaf (the step), read once."""
        import tensorstore as ts

        a = src.leaves[id(leaf)]
        try:
            return int(ts.open(a.spec(self.ctx), open=True, read=True, context=self.ctx)
                       .result().read().result())  # fmt: skip
        except (ValueError, TypeError) as e:
            raise OrbaxImportError(
                f"{a.item}: cannot read the step ({a.name!r}): {str(e)[:300]}; damaged"
            ) from e

    def grid(self, b: LeafBinding) -> tuple[int, ...] | None:
        """The source's chunk shape of a leaf imported as it is (one atom, no pattern), when its
        chunks are small enough to be read whole: blocks are then whole chunks, each decoded once
        (a compressed chunk is decoded whole for any part of it), and the atom's shards are cut
        inside them; else None (blocks of the atom's own shards)."""
        if b.chain or not b.shape:
            return None
        shape = self.arrays[b.name].chunk_layout.write_chunk.shape
        if shape is None or len(shape) != len(b.shape):
            return None
        grid = tuple(max(1, min(int(c), int(d))) for c, d in zip(shape, b.shape))
        if int(np.prod(grid, dtype=np.int64)) * b.dtype.itemsize > MAX_CHUNK_BLOCK:
            return None
        return grid

    def blocks(self, b: LeafBinding) -> list[Box]:
        """The boxes a leaf is read in: its source chunks (see `grid`), or import shards."""
        grid = self.grid(b)
        if grid is None:
            return leaf_blocks(b.shape, b.dtype.itemsize)
        out: list[Box] = [()]
        for d, c in zip(b.shape, grid):
            out = [(*x, (lo, min(lo + c, int(d)))) for x in out for lo in range(0, int(d), c)]
        return out

    def read(self, b: LeafBinding, box: Box) -> Any:
        return self.arrays[b.name][to_slices(box)].read()

    def result(self, b: LeafBinding, fut: Any) -> np.ndarray:
        try:
            return np.asarray(fut.result())
        except ValueError as e:
            a = self.where[b.name]
            raise OrbaxImportError(
                f"{a.item}: reading array {a.name!r} (leaf {b.name!r}) failed ({str(e)[:300]}); "
                "its data files are missing or damaged"
            ) from e

    def stream(
        self, bindings: Sequence[LeafBinding], budget: int
    ) -> Iterator[tuple[LeafBinding, Box, np.ndarray]]:
        """(leaf, block, data) for every block of every leaf, reading ahead up to `budget` bytes."""
        window: collections.deque[tuple[LeafBinding, Box, Any, int]] = collections.deque()
        ahead = 0
        for b in bindings:
            for box in self.blocks(b):
                n = int(np.prod([hi - lo for lo, hi in box], dtype=np.int64)) * b.dtype.itemsize
                while window and ahead + n > budget:
                    b0, box0, fut0, n0 = window.popleft()
                    ahead -= n0
                    yield b0, box0, self.result(b0, fut0)
                window.append((b, box, self.read(b, box), n))
                ahead += n
        while window:
            b0, box0, fut0, _ = window.popleft()
            yield b0, box0, self.result(b0, fut0)


def _declare(w: AtomWriter, b: LeafBinding, grid: tuple[int, ...] | None) -> None:
    """Declare the atoms of a leaf, as `ucp.save` records them (shards inside `grid`)."""
    for atom, (shape, fused) in b.atoms().items():
        fresh = atom not in w.atoms
        w.atom(atom, shape, pattern=tuple(b.chain), fused=fused, role=b.role, grid=grid)
        if not fresh and w.has(atom, b.slot):
            raise MismatchError(
                f"import_orbax: leaves map twice to atom {atom!r} slot {b.slot!r} (the second: "
                f"{b.name!r}); fix the rules so that every atom slot comes from one leaf"
            )
        w.create_many([(atom, b.slot, b.dtype, None)])


def _check_size(src: OrbaxSource, b: LeafBinding) -> None:
    n = int(np.prod(b.shape, dtype=object))
    if n > MAX_ELEMENTS:
        a = src.leaves[id(b.value)]
        raise LimitError(
            f"{a.item}: array {a.name!r} (leaf {b.name!r}) claims shape {b.shape} ({n} elements, "
            f"at most {MAX_ELEMENTS} accepted); the metadata is damaged or hostile"
        )


# ------------------------------------------------------------------------------------ import


@_wrap_errors
def import_orbax(
    src: Any,
    dst: Any,
    *,
    item: str | None = None,
    rules: Sequence[Rule] = (),
    step: int | None = None,
    overwrite: bool = False,
    max_inflight_bytes: int | None = None,
) -> str:
    """Convert an Orbax checkpoint into a universal checkpoint, array by array.

    Args:
        src: an Orbax item folder (`StandardCheckpointer`, `PyTreeCheckpointer`), a
            `CheckpointManager` step folder (all its PyTree items), or a manager's root (its
            latest step, or `step`). OCDBT or not, zarr2 or zarr3, written by any number of
            processes.
        dst: where to write the universal checkpoint.
        item: import only this item of a step folder (e.g. 'state').
        rules: (regex, pattern) pairs mapping leaf names to atoms, as for `ucp.save` (e.g.
            `(r"blocks\\.(.*)", ucp.Stacked("blocks.{i}.\\1"))` for scanned layers); recorded
            in the manifest, so a restore into the same layout needs none.
        step: the step to take from a CheckpointManager root (default: the latest).
        overwrite: replace an existing checkpoint at `dst`.
        max_inflight_bytes: bytes of writes in flight; half of it is read ahead.

    Returns:
        The location of the written checkpoint.

    Raises:
        NotACheckpointError: `src` is not an Orbax checkpoint.
        OrbaxImportError: its metadata or data are damaged or unreadable.
        PatternError, MismatchError: the rules do not fit the leaves.
        FileExistsError: `dst` exists and `overwrite` is False.

    Nothing is left at `dst` after an error.

    >>> ucp.import_orbax("/ckpt", "/tmp/ucp/latest", item="state")  # doctest: +SKIP
    '/tmp/ucp/latest'
    """
    t0 = time.perf_counter()
    source = open_orbax(src, item=item, step=step)
    params, opt_state, extras, step_leaf = split_state(source.tree)
    compiled = CompiledRules(rules)
    try:
        pbind, obind = bind_state(params, opt_state, compiled)
        ebind = bind_state(extras, None, compiled)[0] if extras is not None else []
    except ValueError as e:
        if isinstance(e, UcpError):
            raise
        raise OrbaxImportError(f"{os.fspath(src)}: {e}") from e
    bindings = pbind + obind + ebind
    names = [b.name for b in bindings]
    if rules:
        compiled.check_all_used(names)
    for b in bindings:
        _check_size(source, b)
        try:
            b.atoms()
        except (ValueError, IndexError) as e:
            if isinstance(e, UcpError):
                raise
            raise PatternError(f"import_orbax: leaf {b.name!r}: its rule cannot apply ({e})") from e
    if max_inflight_bytes is None:
        max_inflight_bytes = config.import_inflight_bytes()
    budget = max(int(max_inflight_bytes), 1)
    reader = _Reader(source, bindings)
    step_value = source.step if step_leaf is None else reader.scalar(source, step_leaf)
    with AtomWriter(dst, overwrite=overwrite, max_inflight_bytes=budget) as w:
        for b in bindings:
            _declare(w, b, reader.grid(b))
        # half the budget read ahead: a block costs about three times its size while it is read
        # (the compressed chunk, the decoded one, the block copied out of it)
        for b, box, data in reader.stream(bindings, max(budget // 2, 1)):
            whole = True
            for p in b.pieces(box):
                if p.atom is None:
                    continue  # padding of the leaf (VocabPadded): no atom holds it
                part = data[relative_slices(p.leaf_box, box)]
                w.write(p.atom, b.slot, p.atom_box, p.leaf_to_atom(part), keep=data)
                whole = whole and p.atom_box == full_box(p.atom_shape)
            if b.chain and not whole and w.layout == "per-array":
                w.flush()  # version 2: blocks that share a shard file, one after the other
        source_info = {
            "framework": "orbax",
            "orbax": {
                "path": os.path.abspath(os.fspath(src)),
                "items": sorted(source.items),
                "arrays": len(bindings),
                "skipped": source.skipped,
                "seconds": round(time.perf_counter() - t0, 3),
            },
        }
        return w.commit(
            step=step_value,
            source=source_info,
            rules=compiled.to_json(),
            leaves={b.name: describe_leaf(b) for b in bindings},
        )


def convert_main(args: Any) -> int:
    """`ucp convert orbax SRC DST [--item I] [--step N] [--overwrite]`: prints one line."""
    from ...checkpoint import Checkpoint

    if config.cli_caps_malloc_arenas():  # bounded memory: see util.libc.limit_malloc_arenas
        from ...util.libc import limit_malloc_arenas

        limit_malloc_arenas(2)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # freed chunk buffers go back at once
        from ...util.libc import release_large_buffers

        release_large_buffers()
    t0 = time.perf_counter()
    import_orbax(args.src, args.dst, item=args.item, step=args.step, overwrite=args.overwrite)
    ck = Checkpoint(args.dst)  # DST, not the returned path: a kvstore spec keeps its endpoint
    total = sum(a.nbytes for a in ck.atoms.values())
    print(
        f"wrote {ck.path}: {len(ck.atoms)} atoms, {total / 2**20:.2f} MiB, step {ck.step}, "
        f"in {time.perf_counter() - t0:.2f} s"
    )
    return 0


__all__ = ["OrbaxImportError", "import_orbax", "leaf_blocks", "split_state"]
