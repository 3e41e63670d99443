"""A save's plan: which regions this process writes, and every atom slot's chunk grid.

Computed identically on every process (`SaveJob` builds one); its cost per leaf follows this
process's own shards and the shards per axis, not the device count (`mapping/grid.py`,
`mapping/chain_cuts.py`), patterned leaves included. `benchmarks/scale.py` times it on simulated
meshes of up to 16k devices through the `mesh_info` hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .errors import MismatchError, UnsafePathError
from .format import encode, store
from .format.manifest import AtomInfo, SlotInfo, atom_dir
from .mapping.binding import LeafBinding, WriteTask, plan_writes
from .mapping.merge import MERGE_BYTES, MergedWrite, merge_plan
from .mapping.pattern_json import chain_to_json, fused_marks_to_json
from .util.dtypes import dtype_name


class SavePlan:
    """The atoms, slots and write tasks of a save, leaf by leaf.

    Attributes:
        atoms: per atom, its shape, slots, pattern, leaf, fused marks and role (manifest fields).
        tasks: this process's write tasks, in leaf order.
        merged: id(task) -> the merged write it is part of (small regions written as one box).
        slots: (atom, slot) -> (atom shape, its SlotInfo).
    """

    def __init__(
        self,
        budget: int,
        mesh_info: Callable[[Any], Any] | None = None,
        max_shard_bytes: int = store.AGGREGATED_SHARD_BYTES,
        whole_shards_apart: bool = False,
    ) -> None:
        """A plan with no leaves yet.

        Args:
            budget: the in-flight byte budget (merged writes hold at most a quarter of it).
            mesh_info: the `grid.MeshInfo` of this process for a leaf's mesh; None: from the
                concrete mesh (a simulated mesh passes its own).
            max_shard_bytes: the most bytes of one stored shard (`store.choose_chunks`; the
                default is that of format version 3, the default layout).
            whole_shards_apart: the save encodes and writes each region that covers whole
                stored shards on its own (format version 3, `encode.available()`): a leaf whose
                regions all do is not merged (the merge would only copy it once more, into
                fresh memory, with one write per stored shard either way).
        """
        self.budget = budget
        self.max_shard_bytes = max_shard_bytes
        self.mesh_info = mesh_info
        self.whole_shards_apart = whole_shards_apart
        self.atoms: dict[str, dict[str, Any]] = {}
        self.tasks: list[WriteTask] = []
        self.merged: dict[int, MergedWrite] = {}
        self.slots: dict[tuple[str, str], tuple[tuple[int, ...], SlotInfo]] = {}
        self._grids: dict[tuple[Any, ...], tuple[Any, tuple[Any, Any]]] = {}
        self._described: set[str] = set()  # atoms whose pattern and leaf a leaf has set

    def add(self, b: LeafBinding) -> None:
        """Plan one leaf: its write tasks, its atoms and the chunk grid of its slot in each.

        Raises:
            MismatchError: two leaves give one atom different shapes, or fill the same slot.
        """
        info = None
        if self.mesh_info is not None and isinstance(b.sharding, jax.sharding.NamedSharding):
            info = self.mesh_info(b.sharding.mesh)
        tasks, cuts = plan_writes(b, info)
        for atom, (shape, fused) in b.atoms().items():
            entry = self.atoms.setdefault(atom, {"shape": shape, "slots": {}, "pattern": [],
                                                 "leaf": b.name, "fused": [], "role": b.role})  # fmt: skip
            if entry["shape"] != shape:
                raise MismatchError(
                    f"save: leaf {b.name!r} maps to atom {atom!r} with shape {shape}, but leaf "
                    f"{entry['leaf']!r} gave it shape {entry['shape']}; fix the rules so each "
                    "atom has one shape"
                )
            if b.slot in entry["slots"]:
                raise MismatchError(
                    f"save: leaves {entry['leaf']!r} and {b.name!r} both map to atom {atom!r} slot "
                    f"{b.slot!r}; fix the rules so that every atom slot comes from one leaf"
                )
            # the atom's pattern and leaf: its parameter's, else the first leaf's (an
            # unpatterned parameter's moments do not take its name: "leaf" was 'opt_state.0.nu.w')
            if b.kind == "param" or atom not in self._described:
                entry["pattern"] = chain_to_json(b.chain)
                entry["fused"] = fused_marks_to_json(fused)
                entry["leaf"] = b.name
                self._described.add(atom)
            bounds = cuts.get(atom, [set() for _ in shape])
            # atoms (and leaves) often share their boundary sets: one chunk grid for them
            key = (shape, b.dtype.itemsize, *map(id, bounds))
            if key not in self._grids:  # (the sets are kept with it: their ids stay theirs)
                self._grids[key] = (
                    bounds,
                    store.choose_chunks(shape, b.dtype.itemsize, bounds, self.max_shard_bytes),
                )
            chunks, inner = self._grids[key][1]
            try:
                folder = atom_dir(atom)
            except UnsafePathError as e:
                if not b.name:  # ucp.save(path, array), or a dict key '': a leaf with no name
                    raise UnsafePathError(
                        "save: a leaf has an empty name: params is a single array, not a tree of "
                        "named leaves, or a dict key at its top is ''; save {'<name>': array}, "
                        "or name it with rules=[(r'^$', ucp.Renamed('<name>'))]"
                    ) from e
                raise UnsafePathError(
                    f"save: leaf {b.name[:80]!r} maps to an atom that cannot be stored: {e}; "
                    "give it a shorter or plainer atom name with a rule, e.g. "
                    "rules=[(r'<its path>', ucp.Renamed('<name>'))]"
                ) from e
            info_ = SlotInfo(dtype_name(b.dtype), f"{folder}/{b.slot}", chunks, inner)
            entry["slots"][b.slot] = info_
            self.slots[(atom, b.slot)] = (shape, info_)
        group = merge_plan(b, tasks, min(MERGE_BYTES, self.budget // 4))
        if group is not None and self.whole_shards_apart and self._whole(b, tasks):
            group = None
        if group is not None:
            self.merged.update((id(t), group) for t in tasks)
        self.tasks.extend(tasks)

    def _whole(self, b: LeafBinding, tasks: list[WriteTask]) -> bool:
        """Every piece of every task's region covers whole stored shards of its atom slot."""
        for t in tasks:
            for p in b.pieces(t.box):
                if p.atom is None:
                    continue
                shape, info = self.slots[(p.atom, b.slot)]
                if not encode.covers_whole_shards(shape, info, p.atom_box):
                    return False
        return True

    def atom_infos(self) -> dict[str, AtomInfo]:
        """The manifest's record of every atom planned."""
        return {
            name: AtomInfo(
                shape=a["shape"],
                dtype=(a["slots"].get("fp32") or next(iter(a["slots"].values()))).dtype,
                slots=a["slots"],
                pattern=a["pattern"],
                leaf=a["leaf"],
                fused=a["fused"],
                role=a["role"],
            )
            for name, a in self.atoms.items()
        }
