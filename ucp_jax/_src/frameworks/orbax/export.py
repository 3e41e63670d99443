"""Universal checkpoint -> a plain Orbax checkpoint: `ucp export orbax SRC DST` / `export_orbax`.

The result needs nothing but Orbax to restore, onto any sharding:
`ocp.StandardCheckpointer().restore(dst, target)` (or `CheckpointManager.restore` with
`--manager`), where `target` holds `jax.ShapeDtypeStruct`s with the shardings wanted.

What tree is written:

- with targets (`params_target`, `opt_state_target`, as for `ucp.restore`, and `rules` when the
  layout changed): the state `ucp.restore` gives for them, `{"params", "opt_state", "step"}`:
  the training program's own layout, so its own Orbax restore code reads it;
- without (the CLI): the atoms as a tree of their dotted names, `{"params": <each atom's value>,
  "opt_state": {<slot>: <the atoms' moments>, ...} plus the optax counts under their names,
  "step": <step>}`; `StandardCheckpointer().metadata(dst)` shows it.

Orbax writes the tree in one save: the arrays are on the host together (memory: the state).

>>> ucp.orbax.export_orbax("/tmp/ucp/step_10", "/tmp/orbax/step_10")  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...checkpoint import Checkpoint
from ...errors import ArgumentError, MismatchError
from ...format.manifest import PARAM_SLOT
from ...mapping.rules import Rule
from ..common.destination import not_over_source
from ..common.orbax_write import save_tree


def _put(tree: dict[str, Any], name: str, value: Any, where: str) -> None:
    keys = name.split(".")
    node = tree
    for i, k in enumerate(keys[:-1]):
        nxt = node.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise MismatchError(
                f"{where}: {'.'.join(keys[: i + 1])!r} is both an array and a prefix of "
                f"{name!r}; export with targets (export_orbax(params_target=...)) instead"
            )
        node = nxt
    if keys[-1] in node:
        raise MismatchError(f"{where}: two arrays named {name!r}; export with targets instead")
    node[keys[-1]] = value


def atoms_tree(ck: Checkpoint) -> dict[str, Any]:
    """The checkpoint's atoms as one tree of numpy arrays (see the module's docstring)."""
    tree: dict[str, Any] = {}
    params: dict[str, Any] = {}
    opt: dict[str, Any] = {}
    where = ck.path
    for name in sorted(ck.atoms):
        info = ck.atoms[name]
        if info.role is not None:
            for slot in info.slots:
                _put(tree, name, np.asarray(ck.read(name, slot)), where)
            continue
        for slot in info.slots:
            data = np.asarray(ck.read(name, slot))
            if slot == PARAM_SLOT:
                _put(params, name, data, where)
            elif PARAM_SLOT in info.slots:
                _put(opt.setdefault(slot, {}), name, data, where)
            else:
                _put(tree, name if len(info.slots) == 1 else f"{name}.{slot}", data, where)
    if params:
        _put(tree, "params", params, where)
    if opt:
        base = tree.setdefault("opt_state", {})
        for slot, sub in opt.items():
            if slot in base:
                raise MismatchError(f"{where}: opt_state.{slot} is both a slot and an atom")
            base[slot] = sub
    if ck.step is not None:
        tree["step"] = np.asarray(ck.step, np.int64)
    return tree


def export_orbax(
    src: Any,
    dst: Any,
    *,
    params_target: Any = None,
    opt_state_target: Any = None,
    rules: Sequence[Rule] = (),
    manager: bool = False,
    item: str = "default",
    step: int | None = None,
    overwrite: bool = False,
    step_leaf: bool | None = None,
) -> str:
    """Write a universal checkpoint as a plain Orbax checkpoint.

    Args:
        src: the universal checkpoint (path or an open `ucp.Checkpoint`).
        dst: the item folder to write (`StandardCheckpointer`), or with `manager` the
            `CheckpointManager` root.
        params_target: write the state in this layout (as `ucp.restore` takes it); default:
            the atoms' tree.
        opt_state_target: the optax state's target, with `params_target`.
        rules: `ucp.restore` rules for the targets' layout.
        manager: write `<dst>/<step>/<item>` with a `CheckpointManager` instead.
        item: the item name with `manager`.
        step: the step folder with `manager` (default: the checkpoint's step).
        overwrite: replace an existing item / step folder.
        step_leaf: add the checkpoint's step as a leaf `"step"` of the tree. Default: without
            targets yes; with targets no, so that the tree is `{"params", "opt_state"}` alone,
            what the training program's own restore target holds.

    Returns:
        The item folder, or with `manager` the step folder.

    Raises:
        MismatchError: the atoms' names do not make a tree (then pass targets).
        FileExistsError: `dst` (or the step folder) exists and `overwrite` is not set.
    """
    if step is not None and not manager:
        raise ArgumentError(
            f"export_orbax: step={step} names a CheckpointManager step folder; pass manager=True "
            "(--manager) with it, or leave it out (an item folder has no step folder)"
        )
    ck = src if isinstance(src, Checkpoint) else Checkpoint(src)
    not_over_source(dst, ck.loc.local_path, "the Orbax checkpoint")
    if params_target is None:
        tree = atoms_tree(ck)
        if step_leaf is False:
            tree.pop("step", None)
    else:
        import jax

        from ...restore import restore

        p, o = restore(ck.path, params_target, opt_state_target, rules=rules)
        tree = {"params": jax.device_get(p)}
        if opt_state_target is not None:
            tree["opt_state"] = jax.device_get(o)
        if step_leaf and ck.step is not None:
            tree["step"] = np.asarray(ck.step, np.int64)
    if not manager:
        return save_tree(tree, dst, layout="item", overwrite=overwrite)
    step = ck.step if step is None else step
    if step is None:
        raise MismatchError(f"{ck.path}: records no step; pass step= (--step) for the folder")
    return save_tree(tree, dst, layout="manager", step=step, item=item, overwrite=overwrite)


def export_main(args: Any) -> int:
    """`ucp export orbax SRC DST [--manager [--item I] [--step N]]`: prints one line."""
    t0 = time.perf_counter()
    out = export_orbax(
        args.src, args.dst, manager=args.manager, item=args.item, step=args.step,
        overwrite=args.overwrite,
    )  # fmt: skip
    how = "CheckpointManager.restore" if args.manager else "StandardCheckpointer().restore"
    print(f"wrote {out} in {time.perf_counter() - t0:.2f} s ({how} reads it)")
    return 0


__all__ = ["atoms_tree", "export_main", "export_orbax"]
