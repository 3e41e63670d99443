"""Universal atoms -> a DeepSpeed universal checkpoint folder, which `load_universal: true` resumes.

The layout is what DeepSpeed's `ds_to_universal` writes and its universal loader reads:

    <dst>/zero/<param>/fp32.pt         {"param": fp32 tensor, "cat_dim": 0}  (+ "vocab_tensor")
    <dst>/zero/<param>/exp_avg.pt      same form, Adam's first moment
    <dst>/zero/<param>/exp_avg_sq.pt   same form, Adam's second moment
    <dst>/zero/<param>/step.pt         the optimizer step, a float32 scalar tensor
    <dst>/zero/optimizer_state.pt      global optimizer state (param groups, clip_grad, version)
    <dst>/mp_rank_00_model_states.pt   (and zero_pp_rank_0_mp_rank_00_model_states.pt for ZeRO-3)
    <parent of dst>/latest_universal   the tag (the name of <dst>)

so `engine.load_checkpoint(<parent of dst>)` with `"checkpoint": {"load_universal": true}` resumes
on any DP size and ZeRO stage. Every file holds only tensors and plain containers.
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ...checkpoint import Checkpoint
from ...errors import DestinationExistsError, MismatchError
from ...format import space
from ...format.manifest import PARAM_SLOT, STEP_SLOT
from ...mapping.pattern_json import chain_from_json
from ...mapping.patterns import Partitioned, VocabPadded
from ...untrusted.paths import check_component, join_inside
from ..common.destination import local_destination, not_over_source
from ..common.optax_count import optax_count
from ..common.progress import Progress
from ..common.torch_arrays import to_torch

DS_VERSION = "0.19.8"  # written when the source was not DeepSpeed; DeepSpeed checks >= 0.3.17
MOMENT_SLOTS = ("exp_avg", "exp_avg_sq")
EMPTY_GROUPS = 64  # DeepSpeed zips these with its own param groups: extra empty ones are ignored
_EXPERT_RE = re.compile(r"^(?P<pre>.*\.deepspeed_experts\.)(?P<e>\d+)(?P<post>\..*)$")


def _save(obj: Any, path: str) -> None:
    # A file this function opens and closes: when torch.save fails (a full disk), the file is
    # closed here, not held open by the error's traceback, so that removing it frees its space.
    with open(path, "wb") as f:
        torch.save(obj, f)


def export_deepspeed_universal(
    path: Any,
    dst: Any,
    *,
    names: Mapping[str, str] | Callable[[str], str | None] | None = None,
    param_groups: list[dict[str, Any]] | None = None,
    expert_parallel: int | Mapping[str, int] | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
) -> str:
    """Write a universal checkpoint as a DeepSpeed universal folder (`load_universal: true`).

    Every atom with an `fp32` slot is a parameter; its `exp_avg`/`exp_avg_sq` slots (optax adam's
    mu/nu) become the moments, and its `step` slot, or else the checkpoint's optax count
    (`ScaleByAdamState.count`), becomes `step.pt`. Atom names must be the torch module's parameter
    names: save from JAX with rules that map leaves to torch-named atoms (`ucp.Stacked`,
    `ucp.Transposed`), or pass `names`.

    Args:
        path: a committed universal checkpoint.
        dst: the universal tag folder to write (e.g. `ds_ckpt/global_step100`); the parent gets a
            `latest_universal` file naming it, so `engine.load_checkpoint(parent)` finds it.
        names: atom name -> torch parameter name (a mapping, or a callable returning None to skip).
        param_groups: optimizer hyperparameters per param group for DeepSpeed to load; default:
            those recorded when the checkpoint was imported from DeepSpeed, else empty groups
            (the DeepSpeed job's own config then applies).
        expert_parallel: the expert-parallel size (`ep_size`) of the DeepSpeed MoE job that will
            load the folder (experts are laid out for it, see above): one size for every MoE
            layer, or per layer, by the experts' name prefix (`{"blocks.2.moe.deepspeed_moe.
            experts.deepspeed_experts.": 4, ...}`: a model whose MoE layers have different
            `ep_size`s); default: each layer's size in the DeepSpeed run it was imported from,
            else 1.
        overwrite: replace `dst` if it exists.
        progress: show a progress bar (default: when stderr is a terminal).

    Returns:
        `dst`.

    >>> ucp.torch.export_deepspeed_universal("/tmp/ucp/step_3", "ds_univ/global_step3")  # doctest: +SKIP
    """
    dst = local_destination(dst, "the DeepSpeed universal folder")
    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    not_over_source(dst, ck.loc.local_path, "the DeepSpeed universal folder")
    dst = os.path.abspath(os.fspath(dst))
    params = _parameters(ck, _renamer(names))  # names checked before anything is written
    src = (ck.manifest.source or {}).get("deepspeed") or {}
    stacks = _expert_stacks(params, _ep_of(expert_parallel, src))
    if os.path.exists(dst) and not overwrite:
        raise DestinationExistsError(
            f"{dst} exists; pass overwrite=True (--overwrite) or export to a new folder"
        )
    largest = max((ck.atoms[a].nbytes for a in params), default=0)  # a whole atom, as fp32 too
    space.require_memory(3 * largest, f"{dst}: the export", space.EXPORT_FIX)
    bar = Progress(progress, sum(ck.atoms[a].nbytes for a in params), "ucp export")
    try:
        with space.folder_in_place(dst, "the export") as tmp:  # an old dst goes at the end
            zero = os.path.join(tmp, "zero")
            os.makedirs(zero)
            shapes, step_value = _write_params(ck, params, stacks, zero, optax_count(ck), bar)
            groups = param_groups if param_groups is not None else src.get("param_groups")
            groups = [_group(g) for g in groups or [{} for _ in range(EMPTY_GROUPS)]]
            version = src.get("ds_version") or DS_VERSION
            _save(_optimizer_state(src, groups, version, step_value),
                  os.path.join(zero, "optimizer_state.pt"))  # fmt: skip
            global_steps = ck.step if ck.step is not None else int(step_value or 0)
            model = _model_states(src, shapes, version, global_steps)
            _save(model, os.path.join(tmp, "mp_rank_00_model_states.pt"))
            _save(model, os.path.join(tmp, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    finally:
        bar.stop()
    with open(os.path.join(os.path.dirname(dst), "latest_universal"), "w") as f:
        f.write(os.path.basename(dst))
    return dst


def _parameters(ck: Checkpoint, rename: Callable[[str], str | None]) -> dict[str, str]:
    """Atom -> torch name of every parameter atom (an `fp32` slot, no optimizer role) exported."""
    params: dict[str, str] = {}
    for atom, info in ck.atoms.items():
        if PARAM_SLOT not in info.slots or info.role is not None:
            continue
        torch_name = rename(atom)
        if torch_name is not None:
            params[atom] = _folder_name(atom, torch_name, params)
    if not params:
        raise MismatchError(
            f"export: {ck.path} has no parameter atoms (atoms with an 'fp32' slot); nothing to export"
        )
    return params


def _slot_extra(info: Any) -> dict[str, Any]:
    """The keys DeepSpeed's universal files carry next to `param`: `cat_dim`, `vocab_tensor`."""
    extra: dict[str, Any] = {"cat_dim": 0}
    for p in chain_from_json(info.pattern):
        if isinstance(p, Partitioned) and len(info.shape) > 1:
            extra["cat_dim"] = int(p.axis)
        if isinstance(p, VocabPadded):
            extra["vocab_tensor"] = True
    return extra


def _ep_of(given: int | Mapping[str, int] | None, src: Mapping[str, Any]) -> Callable[[str], int]:
    """Expert-layer prefix -> the expert-parallel size its experts are laid out for: `given` (one
    size, or per prefix), else as the DeepSpeed run imported had it (per layer, as the import
    recorded it; one size where the run had one MoE group), else 1."""
    if isinstance(given, int):
        return lambda pre: given
    if given is not None:
        table = dict(given)

        def from_table(pre: str) -> int:
            if pre not in table:
                raise MismatchError(
                    f"export: expert_parallel has no size for the experts {pre}<e>; give every "
                    f"MoE layer's prefix (here: {pre!r}, ...)"
                )
            return int(table[pre])

        return from_table
    recorded = src.get("expert_parallel")
    if isinstance(recorded, dict):
        return lambda pre: int(recorded.get(pre, 1))
    sizes = sorted({int(m[1]) for g in src.get("param_groups") or []
                    if g.get("moe") and (m := re.fullmatch(r"ep_size_(\d+)", str(g.get("name"))))})  # fmt: skip
    if len(sizes) > 1:
        raise MismatchError(
            f"export: the DeepSpeed run had MoE layers of expert-parallel sizes {sizes}, and the "
            "import did not record which layer had which; pass expert_parallel={<expert prefix>: "
            "<ep_size>, ...} (or re-import with this version)"
        )
    return lambda pre: sizes[0] if sizes else 1


def _expert_stacks(params: dict[str, str], ep_of: Callable[[str], int]) -> dict[str, list[str]]:
    """Local torch name -> the atoms stacked in its universal file, one per rank of the largest
    expert-parallel group (layers at EP 1 are not stacked).

    DeepSpeed's universal loader slices every expert file by the rank in its *largest* expert
    group (`_get_universal_checkpoint_ep_info`), whatever the layer's own `ep_size`: a layer at
    EP `P` below the largest `M` stacks, at position `q`, the expert that rank `q` holds at EP
    `P` (default topology: expert-parallel rank `q % P`), so every layer loads its own experts.
    """
    experts: dict[tuple[str, str], dict[int, str]] = {}
    for atom, torch_name in params.items():
        if m := _EXPERT_RE.match(torch_name):
            experts.setdefault((m["pre"], m["post"]), {})[int(m["e"])] = atom
    sizes = {pre: ep_of(pre) for pre, _ in experts}
    for pre, ep in sizes.items():
        if ep < 1:
            raise MismatchError(f"export: expert_parallel must be >= 1, not {ep} (for {pre}<e>)")
    top = max((ep for ep in sizes.values() if ep > 1), default=1)
    stacks: dict[str, list[str]] = {}
    for (pre, post), by_e in experts.items():
        ep = sizes[pre]
        if ep == 1:
            continue
        n = len(by_e)
        if sorted(by_e) != list(range(n)) or n % ep or top % ep:
            raise MismatchError(
                f"export: experts {pre}<e>{post} are {sorted(by_e)[:8]}; expert_parallel={ep} needs "
                f"0..E-1 with E a multiple of it, and dividing the largest MoE layer's ({top}) "
                "(pass the DeepSpeed job's ep_size)"
            )
        local = n // ep
        for i in range(local):
            stacks[f"{pre}{i}{post}"] = [by_e[(q % ep) * local + i] for q in range(top)]
    return stacks


def _write_params(
    ck: Checkpoint,
    params: dict[str, str],
    stacks: dict[str, list[str]],
    zero: str,
    count: float | None,
    bar: Progress,
) -> tuple[collections.OrderedDict[str, torch.Size], float | None]:
    """`zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt` of every parameter (experts: `stacks`).

    Returns:
        (torch name -> shape, in order; the first step written, or None).
    """
    shapes: collections.OrderedDict[str, torch.Size] = collections.OrderedDict()
    step_value = None
    stacked = {a for atoms in stacks.values() for a in atoms}
    todo = [(a, n, [a]) for a, n in params.items() if a not in stacked]
    todo += [(atoms[0], name, atoms) for name, atoms in stacks.items()]
    for atom, torch_name, rows in todo:
        info = ck.atoms[atom]
        pdir = join_inside(zero, torch_name, f"export: atom {atom!r}: parameter")
        os.makedirs(pdir, exist_ok=True)
        extra = _slot_extra(info)
        if torch_name in stacks:
            extra.update(cat_dim=0, is_expert_param=True, ep_num_experts=len(rows))
        for slot in (PARAM_SLOT, *MOMENT_SLOTS):
            if slot not in info.slots:
                continue
            parts = [to_torch(ck.read(a, slot)).float() for a in rows]
            t = torch.stack(parts) if torch_name in stacks else parts[0]
            _save({**extra, "param": t}, os.path.join(pdir, f"{slot}.pt"))
        step = float(np.asarray(ck.read(atom, STEP_SLOT))) if STEP_SLOT in info.slots else count
        if step is not None and any(s in info.slots for s in MOMENT_SLOTS):
            _save(torch.tensor(step, dtype=torch.float32), os.path.join(pdir, "step.pt"))
            step_value = step if step_value is None else step_value
        shapes[torch_name] = torch.Size(info.shape)
        bar.advance(info.nbytes * len(rows))
    return shapes, step_value


def _optimizer_state(src: Mapping[str, Any], groups: list[dict[str, Any]], version: str,
                     step_value: float | None) -> dict[str, Any]:  # fmt: skip
    """`zero/optimizer_state.pt`: the global optimizer state DeepSpeed's universal loader reads."""
    osd: dict[str, Any] = {
        "ds_version": version,
        "dynamic_loss_scale": bool(src.get("dynamic_loss_scale") or False),
        "overflow": False,
        "param_groups": groups,
        # ZeRO-3's universal loader reads the step and hyperparameters from here
        "optimizer_state_dict": {
            "state": {0: {"step": torch.tensor(step_value or 0.0, dtype=torch.float32)}},
            "param_groups": [{**groups[0], "params": [0]}],
        },
    }
    if src.get("clip_grad") is not None:
        osd["clip_grad"] = float(src["clip_grad"])
    if src.get("zero_stage") is not None:
        osd["zero_stage"] = int(src["zero_stage"])
    return osd


def _model_states(src: Mapping[str, Any], shapes: collections.OrderedDict[str, torch.Size],
                  version: str, global_steps: int) -> dict[str, Any]:  # fmt: skip
    """`mp_rank_00_model_states.pt`: no weights (they are in zero/), the shapes and the run."""
    return {
        "module": {},
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [shapes],
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "lr_scheduler": src.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": [],
        "skipped_steps": int(src.get("skipped_steps") or 0),
        "global_steps": int(global_steps),
        "global_samples": int(src.get("global_samples") or 0),
        "dp_world_size": int(src.get("dp_degree") or 1),
        "mp_world_size": 1,
        "ds_version": version,
        "universal_checkpoint_info": dict(src.get("universal_checkpoint_info") or {}),
    }


def _folder_name(atom: str, torch_name: Any, taken: Mapping[str, str]) -> str:
    """The parameter's folder name under `zero/`: one safe path component, used once."""
    check_component(torch_name, f"export: atom {atom!r}: parameter name (its folder in zero/)")
    if torch_name == "optimizer_state.pt" or torch_name in taken.values():
        raise MismatchError(
            f"export: atom {atom!r}: parameter name {torch_name!r} is already taken (by another "
            "atom, or zero/optimizer_state.pt); rename it with `names`"
        )
    return torch_name


def _group(g: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in g.items() if k != "params"}
    if isinstance(out.get("betas"), list):
        out["betas"] = tuple(out["betas"])
    return out


def _renamer(names: Any) -> Callable[[str], str | None]:
    if names is None:
        return lambda a: a
    if callable(names):
        return names
    return lambda a: names.get(a, a)


__all__ = ["export_deepspeed_universal"]
