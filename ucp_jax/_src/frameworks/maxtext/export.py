"""Universal ``models.llama`` atoms -> a checkpoint MaxText resumes from: ``ucp export maxtext``.

The inverse of :mod:`.read`, in the layout MaxText 0.2 itself writes: an Orbax v1
``training.Checkpointer`` root ``<dst>/<step>/items`` (OCDBT + zarr3) holding MaxText's Linen
train state, ``params.params`` (scanned or not), ``opt_state`` (the ``adamw`` chain:
``[{count, mu, nu}, None, {count}]``), ``step`` and, when the source was a MaxText run with the
same ``scan_layers``, ``nnx_aux`` (its PRNG state; otherwise MaxText starts its RNG streams
fresh, which only dropout would notice). The arrays are global, so MaxText restores them onto
whatever mesh it runs on. Copy ``<dst>/<step>`` into ``<base_output_directory>/<run_name>/
checkpoints/`` and MaxText resumes from it (or point ``load_full_state_path`` at it).

The step: MaxText's folder ``N`` holds the state after its step ``N`` (``step = N + 1``), so the
folder is the checkpoint's step minus one unless ``step_dir`` says otherwise. Adam's counts come
from the atoms of their optax role, else from the per-parameter ``step`` slots of a PyTorch
source, else the step.

The whole train state is assembled on the host before Orbax writes it (memory: its size).

>>> ucp_jax.orbax.export_maxtext("/tmp/ucp/mt", "run2/checkpoints")  # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ...checkpoint import Checkpoint
from ...format.manifest import PARAM_SLOT, STEP_SLOT
from ...hf_config import config_from_checkpoint
from ...llama_config import LlamaConfig
from ...mapping.slot_names import VALUE_SLOT
from ...util.dtypes import np_dtype
from ..common.destination import not_over_source
from ..common.orbax_write import save_tree
from .layout import LLAMA31_SCALING, MaxTextFormatError, MaxTextModel, layer_index, row_blocks

BLOCK_BYTES = 32 << 20
MOMENTS = {"exp_avg": "mu", "exp_avg_sq": "nu"}


def _leaf_array(ck: Checkpoint, model: MaxTextModel, leaf: Any, slot: str) -> np.ndarray:
    """One MaxText leaf of one slot, assembled from its atoms' regions block by block."""
    spec = leaf.spec
    first = model.atom_of(leaf, model.layers_of(leaf)[0])
    dtype = np.dtype(np_dtype(ck.atoms[first].slots[slot].dtype))
    out = np.empty(model.leaf_shape(leaf), dtype)
    shape = model.layer_shape(spec)
    scale = model.row_scale(spec)
    cols = model.columns(spec)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    for layer in model.layers_of(leaf):
        atom = model.atom_of(leaf, layer)
        info = ck.atoms[atom]
        if slot not in info.slots:
            raise MaxTextFormatError(f"{ck.path}: atom {atom!r} has no {slot!r} slot")
        for lo, hi in row_blocks(shape[0], row_bytes, BLOCK_BYTES):
            index = [slice(lo * scale, hi * scale)]
            if len(info.shape) > 1:
                index.append(slice(*cols) if cols else slice(None))
            region = ck.read(atom, slot, tuple(index))
            value = model.from_atom(spec, region, slot)
            exact = model.exact_slot(spec, slot)
            if exact is not None and exact in info.slots:  # MaxText's own values, if unchanged
                raw = ck.read(atom, exact, (slice(lo, hi), slice(None))).reshape(value.shape)
                same = model.unflatten(spec, model.to_atom(spec, raw, slot) == region)
                value = np.where(same, raw, value)
            out[layer_index(leaf, layer, (lo, hi))] = value
    return out


def _nest(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _count(ck: Checkpoint, role: str, fallback: int) -> int:
    """An optax count: the atom of that role, else the per-atom `step` slots, else fallback."""
    found = [n for n, a in ck.atoms.items() if a.role == role]
    if found:
        return int(np.asarray(ck.read(found[0], VALUE_SLOT)).reshape(()))
    steps = {
        int(np.asarray(ck.read(n, STEP_SLOT)).reshape(()))
        for n, a in ck.atoms.items()
        if STEP_SLOT in a.slots and a.slot_shape(STEP_SLOT) == ()
    }
    if len(steps) > 1:
        raise MaxTextFormatError(
            f"{ck.path}: the per-parameter optimizer steps differ ({sorted(steps)[:4]}); "
            "MaxText's Adam keeps one count"
        )
    return steps.pop() if steps else fallback


def _aux(ck: Checkpoint, scan_layers: bool) -> dict[str, Any] | None:
    """MaxText's nnx_aux from the manifest (a MaxText source of the same scan_layers), or None."""
    mt = (ck.manifest.extra or {}).get("maxtext") if isinstance(ck.manifest.extra, dict) else None
    if not isinstance(mt, dict) or mt.get("scan_layers") != scan_layers:
        return None
    aux = mt.get("nnx_aux")
    if not isinstance(aux, dict) or not aux:
        return None
    out: dict[str, Any] = {}
    for name, v in aux.items():
        a = np.asarray(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"])
        _nest(out, tuple(name.split(".")), a)
    return out


def maxtext_state(
    ck: Checkpoint, model: MaxTextModel, *, params_only: bool = False
) -> dict[str, Any]:
    """MaxText's Linen train state (``items``) of a universal checkpoint, as numpy arrays."""
    params: dict[str, Any] = {}
    moments: dict[str, dict[str, Any]] = {m: {} for m in MOMENTS.values()}
    have = set.intersection(*(set(a.slots) for n, a in ck.atoms.items() if a.role is None))
    missing = [s for s in MOMENTS if s not in have]
    if missing and not params_only:
        raise MaxTextFormatError(
            f"{ck.path}: no Adam moments ({', '.join(missing)} slots) on every parameter atom; "
            "MaxText resumes only a full train state. Export the weights alone with "
            "params_only=True (--params-only) for MaxText's load_parameters_path"
        )
    for leaf in model.leaves():
        _nest(params, leaf.path, _leaf_array(ck, model, leaf, PARAM_SLOT))
        if not params_only:
            for slot, field in MOMENTS.items():
                _nest(moments[field], leaf.path, _leaf_array(ck, model, leaf, slot))
    state: dict[str, Any] = {"params": {"params": params}}
    if params_only:
        return state
    step = ck.step
    count = _count(ck, "ScaleByAdamState.count", step if step is not None else 0)
    sched = _count(ck, "ScaleByScheduleState.count", count)
    state["opt_state"] = [
        {"count": np.asarray(count, np.int32), "mu": {"params": moments["mu"]},
         "nu": {"params": moments["nu"]}},
        None,
        {"count": np.asarray(sched, np.int32)},
    ]  # fmt: skip
    state["step"] = np.asarray(step if step is not None else count, np.int32)
    aux = _aux(ck, model.scan_layers)
    if aux is not None:
        state["nnx_aux"] = aux
    return state


def _rope_type(cfg: LlamaConfig, rope: str | None, where: str) -> str:
    """MaxText's ``rope_type`` computing the model's RoPE: ``llama3.1`` for Llama 3.1's scaling
    (MaxText's only one), ``default`` for none; `rope`, if given, must be that one."""
    scaling = dict(cfg.rope_scaling)
    if scaling and scaling != dict(LLAMA31_SCALING):
        raise MaxTextFormatError(
            f"{where}: the model's RoPE scaling {scaling} is not Llama 3.1's "
            f"{dict(LLAMA31_SCALING)}, the one MaxText's llama3.1 rope computes; MaxText would "
            "run it unscaled"
        )
    own = "llama3.1" if scaling else "default"
    if rope is not None and rope != own:
        raise MaxTextFormatError(
            f"{where}: rope={rope!r} (--rope), but the model's RoPE is "
            + ("Llama 3.1's scaled one" if scaling else "unscaled")
            + f": MaxText would compute another model; leave it out (the model's is {own!r})"
        )
    return own


def export_maxtext(
    src: Any,
    dst: Any,
    *,
    scan_layers: bool = True,
    step_dir: int | None = None,
    rope: str | None = None,
    query_scaled: bool | None = None,
    params_only: bool = False,
    overwrite: bool = False,
) -> str:
    """Write a universal checkpoint of ``ucp_jax.models.llama`` as a MaxText checkpoint.

    Args:
        src: the universal checkpoint (with its model config: ``import_maxtext``, ``import_hf``,
            the torchtitan and Megatron importers, or ``ucp.save(extra=llama.ucp_extra(cfg))``).
        dst: MaxText's checkpoint folder (``<base_output_directory>/<run_name>/checkpoints``).
        scan_layers: the layers stacked (MaxText's ``scan_layers``, default True) or not.
        step_dir: the step folder to write (default: the checkpoint's step minus one).
        rope: MaxText's ``rope_type`` (default: the model's: ``llama3.1`` for Llama 3.1's RoPE
            scaling, else ``default``); one the model does not compute is refused.
        query_scaled: fold ``1/sqrt(head_dim)`` into the query kernel (default: the MaxText
            source's, else True as MaxText's llama2 block expects).
        params_only: write only ``params`` (for ``load_parameters_path``), no optimizer state.
        overwrite: replace an existing step folder.

    Returns:
        The step folder written (``<dst>/<step_dir>``).

    Raises:
        HFConfigError: the checkpoint records no model config.
        MaxTextFormatError: not a dense Llama MaxText can hold (a RoPE scaling other than Llama
            3.1's, a `rope` the model does not compute), or no Adam moments.
        FileExistsError: the step folder exists and ``overwrite`` is not set.
    """
    ck = src if isinstance(src, Checkpoint) else Checkpoint(src)
    not_over_source(dst, ck.loc.local_path, "MaxText's checkpoint folder")
    cfg = config_from_checkpoint(ck)
    mt = (ck.manifest.extra or {}).get("maxtext") if isinstance(ck.manifest.extra, dict) else None
    mt = mt if isinstance(mt, dict) else {}
    rope = _rope_type(cfg, rope, ck.path)
    if query_scaled is None:
        query_scaled = bool(mt.get("query_scaled", True))
    model = MaxTextModel(cfg, scan_layers, rope, query_scaled)
    if step_dir is None:
        if ck.step is None or ck.step < 1:
            raise MaxTextFormatError(
                f"{ck.path}: step {ck.step}: MaxText's folder N holds step N + 1; pass step_dir= (--step-dir) "
                "(0 for a model that never trained, as one imported from Hugging Face)"
            )
        step_dir = int(ck.step) - 1
    state = maxtext_state(ck, model, params_only=params_only)
    return save_tree(
        state, dst, layout="v1", step=step_dir, item="items",
        custom_metadata={"scan_layers": scan_layers}, overwrite=overwrite,
    )  # fmt: skip


def export_main(args: Any) -> int:
    """`ucp export maxtext SRC DST`: prints one line."""
    t0 = time.perf_counter()
    out = export_maxtext(
        args.src, args.dst, scan_layers=not args.unscanned, step_dir=args.step_dir,
        rope=args.rope, query_scaled=False if args.unscaled_query else None,
        params_only=args.params_only, overwrite=args.overwrite,
    )  # fmt: skip
    how = "load_parameters_path=<it>/items" if args.params_only else "MaxText resumes from it"
    print(f"wrote {out} in {time.perf_counter() - t0:.2f} s ({how})")
    return 0


__all__ = ["export_main", "export_maxtext", "maxtext_state"]
