"""DeepSpeed mixture-of-experts ZeRO checkpoints: local expert names -> global ones, per rank.

A `deepspeed.moe.layer.MoE` layer holds `num_experts / ep_size` experts on each rank, named by
their *local* index (`...deepspeed_experts.{i}...`). The optimizer keeps them in their own param
groups (`moe: True`, named `ep_size_{E}`, from `split_params_into_different_moe_groups_for_optimizer`),
which ZeRO partitions over the expert-data-parallel group (`dp / ep_size` ranks, `partition_count`)
instead of the whole data-parallel group. With DeepSpeed's default topology (expert parallel groups
of consecutive ranks), data-parallel rank `d` holds the experts of expert-parallel rank `d % ep_size`,
and its local expert `i` is global expert `(d % ep_size) * num_local + i`. The expert model files
(`layer_{l}_expert_{e}_mp_rank_00_model_states.pt`, one per global expert) hold each global
expert's module weights: the import checks that they name the same experts with the same shapes,
and, before it commits, that each expert's imported fp32 master cast to the file's dtype equals
them, so a checkpoint laid out otherwise is an error, not a silent mix-up of experts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ...untrusted.lazy import load_lazy as load
from ...untrusted.limits import as_shape
from ...untrusted.paths import refuse_symlinks
from .common import DeepSpeedFormatError

EXPERT_FILE_RE = re.compile(
    r"^layer_(?P<layer>\d+)_expert_(?P<e>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$"
)
_OLD_EXPERT_RE = re.compile(r"^expert_\d+_mp_rank_\d+_model_states\.pt$")
_EXPP_RE = re.compile(r"^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
_LOCAL_RE = re.compile(r"^(?P<pre>.*\.deepspeed_experts\.)(?P<i>\d+)(?P<post>\..*)$")


@dataclasses.dataclass
class ExpertGroups:
    """How the MoE param groups of a ZeRO-1/2 checkpoint map to global expert names.

    Attributes:
        groups: param group index -> its expert-parallel size.
        local: (param group, expert-layer prefix) -> experts per rank in that layer.
        files: global parameter name -> the expert model file that holds it.
        by_name: MoE param group name (`ep_size_<E>`) -> its index here (the first rank file's).
        frozen: global name -> expert file, of the expert parameters in no optimizer group
            (`requires_grad=False`): their expert file is their only copy.
    """

    groups: dict[int, int]
    local: dict[tuple[int, str], int]
    files: dict[str, str]
    by_name: dict[str, int] = dataclasses.field(default_factory=dict)
    frozen: dict[str, str] = dataclasses.field(default_factory=dict)

    def group_in(self, g: int, param_groups: Any) -> int:
        """The group (as numbered here: the first rank file's order) that group `g` of a rank
        file is. DeepSpeed builds the MoE groups from a set of names, so their order differs
        between ranks (Python's hash randomization) where a model mixes expert-parallel sizes;
        they are matched by name (`ep_size_<E>`)."""
        pg = param_groups[g] if isinstance(param_groups, list) and g < len(param_groups) else {}
        name = pg.get("name") if isinstance(pg, dict) else None
        return self.by_name.get(name, g) if isinstance(name, str) else g

    def ep_rank(self, g: int, dp_rank: int) -> int:
        """The expert-parallel rank of data-parallel rank `dp_rank` in group `g`."""
        return dp_rank % self.groups[g]

    def name(self, g: int, name: str, dp_rank: int) -> str:
        """The global name of parameter `name` of group `g` on data-parallel rank `dp_rank`."""
        if g not in self.groups:
            return name
        m = _LOCAL_RE.match(name)
        if m is None:
            raise DeepSpeedFormatError(
                f"parameter {name!r} is in the MoE param group {g} but has no "
                "'.deepspeed_experts.<i>.' in its name; only deepspeed.moe.layer.MoE experts "
                "are understood"
            )
        n_local = self.local.get((g, m["pre"]))
        if n_local is None:
            raise DeepSpeedFormatError(
                f"parameter {name!r} of MoE param group {g} is not in the model states' param_shapes"
            )
        glob = self.ep_rank(g, dp_rank) * n_local + int(m["i"])
        return f"{m['pre']}{glob}{m['post']}"

    def global_shapes(self, shapes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`param_shapes` (local names, one dict per group) with every expert under its global names."""
        out = []
        for g, group in enumerate(shapes):
            if g not in self.groups:
                out.append(group)
                continue
            ep = self.groups[g]
            out.append({self.name(g, n, r): s for r in range(ep) for n, s in group.items()})
        return out


def refuse_other_moe(folder: str, name: str) -> None:
    """Expert files DeepSpeed writes outside ZeRO-1/2 MoE checkpoints: a clear error."""
    if _EXPP_RE.match(name):
        raise DeepSpeedFormatError(
            f"{folder}: {name} is the optimizer file of an MoE run without ZeRO (stage 0); only "
            "ZeRO-1/2 MoE checkpoints (zero_pp_rank_*_optim_states.pt) can be imported"
        )
    if _OLD_EXPERT_RE.match(name):
        raise DeepSpeedFormatError(
            f"{folder}: {name} is a pre-0.6 DeepSpeed expert file (no layer index); re-save the "
            "checkpoint with a current DeepSpeed"
        )


def expert_groups(
    folder: str, names: list[str], meta: dict[str, Any], osd: dict[str, Any], dp: int,
    stage: int, n_mp: int,
) -> ExpertGroups | None:  # fmt: skip
    """The MoE layout of a ZeRO folder, or None when it has no expert files and no MoE groups.

    Args:
        folder, names: the tag folder and its file names.
        meta: the first model states file's small entries (param_shapes, ds_config).
        osd: the first optimizer file's optimizer_state_dict (param groups, partition_count).
        dp, stage, n_mp: data-parallel ranks, ZeRO stage, model-parallel ranks.

    Raises:
        DeepSpeedFormatError: MoE with ZeRO-3 or model parallelism, a topology other than
            DeepSpeed's default, or expert files that do not match the optimizer's groups.
    """
    expert_files = {n: m for n in names if (m := EXPERT_FILE_RE.match(n))}
    base = osd.get("base_optimizer_state") or {}
    pgroups = base.get("param_groups") if isinstance(base, dict) else None
    moe = [g for g, pg in enumerate(pgroups or []) if isinstance(pg, dict) and pg.get("moe")]
    if not expert_files and not moe:
        return None
    if stage >= 3:
        raise DeepSpeedFormatError(
            f"{folder}: a deepspeed.moe checkpoint with ZeRO stage {stage}, which DeepSpeed itself "
            "refuses to train ('MoE not supported with Stage 3'); MoE imports read ZeRO-1/2 (a "
            "Hugging Face MoE model under ZeRO-3 is read with its config.json)"
        )
    if n_mp > 1:
        raise DeepSpeedFormatError(
            f"{folder}: a deepspeed.moe checkpoint with {n_mp} tensor/pipeline-parallel ranks: "
            "whether each rank's experts are slices of the expert (and along which axis) or "
            "replicas depends on the model code (enable_expert_tensor_parallelism, its Linear "
            "layers), which the checkpoint does not record (universal_checkpoint_info covers the "
            "dense parameters only, and DeepSpeed's ds_to_universal cannot convert MoE either); "
            "MoE imports read ZeRO-1/2 without tensor or pipeline parallelism"
        )
    cfg = meta.get("ds_config") or {}
    if isinstance(cfg, dict) and cfg.get("use_data_before_expert_parallel_"):
        raise DeepSpeedFormatError(
            f"{folder}: ds_config sets use_data_before_expert_parallel_ (data-before-expert rank "
            "order); only DeepSpeed's default expert-parallel topology is understood"
        )
    if not moe or not expert_files:
        raise DeepSpeedFormatError(
            f"{folder}: {len(expert_files)} expert model files but {len(moe)} MoE optimizer "
            "param groups (moe: True); both or neither are expected"
        )
    counts = osd.get("partition_count") or []
    shapes = meta.get("param_shapes") or []
    groups: dict[int, int] = {}
    local: dict[tuple[int, str], int] = {}
    by_name: dict[str, int] = {}
    for g in moe:
        if g >= len(counts) or g >= len(shapes) or not int(counts[g]) or dp % int(counts[g]):
            raise DeepSpeedFormatError(
                f"{folder}: MoE param group {g} has partition_count "
                f"{counts[g] if g < len(counts) else None} for {dp} data-parallel ranks"
            )
        ep = dp // int(counts[g])
        named = re.fullmatch(r"ep_size_(\d+)", str(pgroups[g].get("name", "")))  # type: ignore[index]
        if named and int(named[1]) != ep:
            raise DeepSpeedFormatError(
                f"{folder}: MoE param group {g} is named {pgroups[g]['name']!r} but is "  # type: ignore[index]
                f"partitioned over {counts[g]} of {dp} ranks (expert-parallel size {ep})"
            )
        groups[g] = ep
        if named:
            by_name[named[0]] = g
        ids: dict[str, set[int]] = {}
        for n in shapes[g]:
            if m := _LOCAL_RE.match(n):
                ids.setdefault(m["pre"], set()).add(int(m["i"]))
        for pre, seen in ids.items():
            if seen != set(range(len(seen))):
                raise DeepSpeedFormatError(
                    f"{folder}: local experts of {pre!r} are {sorted(seen)}, not 0..{len(seen) - 1}"
                )
            local[(g, pre)] = len(seen)
    eg = ExpertGroups(groups, local, {}, by_name)
    _check_expert_files(folder, expert_files, eg, shapes)
    return eg


def _check_expert_files(
    folder: str, files: dict[str, re.Match[str]], eg: ExpertGroups, shapes: list[dict[str, Any]]
) -> None:
    """Every global expert parameter is in exactly its expert file, with the optimizer's shape."""
    want: dict[str, tuple[int, ...]] = {}
    for g, group in enumerate(eg.global_shapes(shapes)):
        if g in eg.groups:
            for n, s in group.items():
                want[n] = as_shape(s, f"param_shapes[{g}][{n!r}]", DeepSpeedFormatError)
    experts: dict[str, set[int]] = {}  # expert-layer prefix -> its experts in the groups
    for k in want:
        if m := _LOCAL_RE.match(k):
            experts.setdefault(m["pre"], set()).add(int(m["i"]))
    for fname in sorted(files):
        path = refuse_symlinks(folder, fname, "expert file")
        sd = load(path)
        e = int(files[fname]["e"])
        for key, t in sd.items():
            m = _LOCAL_RE.match(key)
            if m is None or int(m["i"]) != e:
                raise DeepSpeedFormatError(
                    f"{path}: entry {key!r} is not a parameter of expert {e}"
                )
            if key not in want:
                # a frozen parameter of an expert the groups hold (its other parameters are
                # there): no optimizer state, its expert file is its only copy
                if int(m["i"]) in experts.get(m["pre"], ()):
                    eg.frozen[key] = path  # (checked below: frozen in every expert)
                    continue
                raise DeepSpeedFormatError(
                    f"{path}: {key!r} is not an expert parameter of the optimizer's MoE groups "
                    f"(expected names like {sorted(want)[:2]}); the experts were laid out on the "
                    "ranks differently than DeepSpeed's default topology"
                )
            if tuple(getattr(t, "shape", ())) != want[key]:
                raise DeepSpeedFormatError(
                    f"{path}: {key!r} has shape {tuple(t.shape)} but the optimizer holds "
                    f"{want[key]}"
                )
            eg.files[key] = path
    _check_frozen(eg.frozen, want, experts)
    missing = sorted(set(want) - set(eg.files))
    if missing:
        raise DeepSpeedFormatError(
            f"{folder}: no expert model file holds {missing[:4]} ({len(missing)} in all); expected "
            f"layer_<l>_expert_<e>_mp_rank_00_model_states.pt for every global expert"
        )


def _check_frozen(
    frozen: dict[str, str], want: dict[str, tuple[int, ...]], experts: dict[str, set[int]]
) -> None:
    """A frozen expert parameter is one of every expert of its layer (experts are copies of one
    module): one found in some experts only is not a parameter of this model."""
    found: dict[tuple[str, str], set[int]] = {}
    for k in frozen:
        m = _LOCAL_RE.match(k)
        assert m is not None
        found.setdefault((m["pre"], m["post"]), set()).add(int(m["i"]))
    for (pre, post), have in sorted(found.items()):
        if have != experts.get(pre, set()):
            key = f"{pre}{min(have)}{post}"
            raise DeepSpeedFormatError(
                f"{frozen[key]}: {key!r} is not an expert parameter of the optimizer's MoE groups "
                f"(expected names like {sorted(want)[:2]}), nor a frozen parameter of every expert "
                f"of its layer (only of experts {sorted(have)}); the experts were laid out on the "
                "ranks differently than DeepSpeed's default topology"
            )


def check_expert_values(eg: ExpertGroups, read_master: Callable[[str], np.ndarray]) -> None:
    """Each expert file's weights equal the imported fp32 master of that global expert (as cast).

    Args:
        eg: the layout (its `files`: global parameter name -> expert file).
        read_master: global parameter name -> the imported fp32 master.

    Raises:
        DeepSpeedFormatError: a file disagrees (names the file, the parameter and by how much).
    """
    for path in sorted(set(eg.files.values())):
        for key, t in load(path).items():
            want = t.numpy()
            got = np.asarray(read_master(key)).astype(want.dtype)
            if got.shape != want.shape or not np.array_equal(got, want):
                diff = np.abs(got.astype(np.float32) - want.astype(np.float32)).max()
                raise DeepSpeedFormatError(
                    f"{path}: {key!r} differs from the optimizer's master weights of that expert "
                    f"(max abs diff {diff:.3g}): the experts are laid out on the ranks differently "
                    "than DeepSpeed's default topology (data-parallel rank d holds expert-parallel "
                    "rank d % ep_size), or the files are from another save"
                )


__all__ = ["ExpertGroups", "check_expert_values", "expert_groups", "refuse_other_moe"]
