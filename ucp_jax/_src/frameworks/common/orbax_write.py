"""Writing a pytree of host arrays as an Orbax checkpoint, with Orbax itself (any layout it reads).

Three layouts, each exactly as Orbax writes it (OCDBT + zarr3, Orbax's defaults):

- ``item``: one item folder, as ``ocp.StandardCheckpointer().save(dst, tree)`` writes it;
- ``manager``: a ``CheckpointManager`` root with ``<dst>/<step>/<item>`` (``ocp.CheckpointManager``);
- ``v1``: an Orbax v1 ``training.Checkpointer`` root with ``<dst>/<step>/<item>`` and the step's
  custom metadata (what MaxText 0.2 writes and reads).

Orbax writes the whole tree in one save, so the arrays are on the host together: memory is the
size of the tree.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

from ...errors import DestinationExistsError
from .orbax_source import local_folder

LAYOUTS = ("item", "manager", "v1")


def _clear(path: str, overwrite: bool, what: str) -> None:
    if os.path.lexists(path):
        if not overwrite:
            raise DestinationExistsError(
                f"{path} exists ({what}); pass overwrite=True (--overwrite)"
            )
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def save_tree(
    tree: Any,
    dst: Any,
    *,
    layout: str = "item",
    step: int | None = None,
    item: str = "default",
    custom_metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> str:
    """Save ``tree`` (numpy arrays, scalars, None) with Orbax; returns the folder Orbax wrote.

    Args:
        tree: nested dicts / lists of arrays.
        dst: the item folder (``item``), or the manager's root (``manager``, ``v1``).
        layout: ``item``, ``manager`` or ``v1`` (see the module).
        step: the step folder of ``manager`` / ``v1``.
        item: the item (checkpointable) name of ``manager`` / ``v1``.
        custom_metadata: the step's custom metadata (``manager``, ``v1``).
        overwrite: replace an existing item folder / step folder.

    Returns:
        The item folder (``item``) or the step folder.
    """
    import orbax.checkpoint as ocp

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    root = local_folder(dst, "the Orbax checkpoint to write")
    if layout == "item":
        _clear(root, overwrite, "an Orbax item folder")
        os.makedirs(os.path.dirname(root), exist_ok=True)
        with ocp.StandardCheckpointer() as ck:
            ck.save(root, tree)
        return root
    if step is None or int(step) < 0:
        raise ValueError(f"a {layout} layout needs a step folder number, got {step!r}")
    step = int(step)
    _clear(os.path.join(root, str(step)), overwrite, f"step {step} of {root}")
    os.makedirs(root, exist_ok=True)
    meta = dict(custom_metadata or {})
    if layout == "manager":
        with ocp.CheckpointManager(root, item_names=(item,)) as mgr:
            args = ocp.args.Composite(**{item: ocp.args.StandardSave(tree)})
            mgr.save(step, args=args, custom_metadata=meta)
            mgr.wait_until_finished()
    else:
        with ocp.v1.training.Checkpointer(root) as ck:
            ck.save_checkpointables(step, {item: tree}, force=True, custom_metadata=meta)
    return os.path.join(root, str(step))


__all__ = ["LAYOUTS", "save_tree"]
