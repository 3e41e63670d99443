"""MaxText checkpoints -> atoms of ``ucp_jax.models.llama``: ``ucp convert maxtext SRC DST``.

MaxText (0.2.x) saves its train state with Orbax as the item ``items`` of
``<base_output_directory>/<run>/checkpoints/<step>/``: ``params.params`` (the model), ``opt_state``
(optax's ``adamw`` chain: ``0.{count, mu, nu}``, ``2.count``), ``step`` and ``nnx_aux`` (the NNX
RNG streams). This importer maps it as :mod:`.layout` describes: parameters scanned or not become
the per-layer atoms the Hugging Face, Megatron and torchtitan importers write (so
``ucp_jax.models.llama`` restores it onto any mesh, ``ucp export hf`` writes it for transformers),
``mu`` / ``nu`` the atoms' ``exp_avg`` / ``exp_avg_sq`` slots, the counts atoms of their optax role
(``ScaleByAdamState.count``), ``step`` the manifest's step (the optimizer updates done: MaxText's
folder ``N`` holds ``step = N + 1``), and ``nnx_aux`` (the PRNG state) the manifest's
``extra["maxtext"]["nnx_aux"]``, with the model config in ``extra["hf_config"]``.

Streaming: every atom is written in whole-shard row blocks (at most 32 MiB), each assembled from
the blocks of the MaxText leaves it is made of (q, k and v for the fused QKV kernel), read by
TensorStore through the spec Orbax reads them with; memory stays near the writes in flight
(`UCP_IMPORT_INFLIGHT_BYTES`, 64 MiB) plus the block being assembled, whatever the model.

>>> ucp_jax.orbax.import_maxtext("run/checkpoints", "/tmp/ucp/mt")  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import NotACheckpointError
from ...format.manifest import PARAM_SLOT
from ...mapping.names import named_leaves
from ...mapping.patterns import FusedMark
from ...mapping.slot_names import VALUE_SLOT
from ...mapping.slots import classify_opt_state
from ...untrusted.limits import ucp_errors
from ..common.orbax_source import METADATA, ArrayReader, OrbaxSource, open_orbax
from ..common.writer import AtomWriter
from .layout import (
    PARAMS,
    Leaf,
    MaxTextFormatError,
    MaxTextModel,
    Spec,
    get_path,
    infer_model,
    layer_index,
)

MAX_AUX_ELEMENTS = 1 << 20  # nnx_aux goes to the manifest as JSON: RNG keys and counters only


def open_maxtext(src: Any, step: int | None = None) -> OrbaxSource:
    """The ``items`` item of a MaxText checkpoint: its root, a step folder or the item folder."""
    path = os.fspath(src)
    if os.path.isfile(os.path.join(path, METADATA)):
        return open_orbax(path)
    try:
        return open_orbax(path, item="items", step=step)
    except NotACheckpointError as e:
        raise NotACheckpointError(
            f"{e}; a MaxText checkpoint is `<run>/checkpoints` (its latest step, or step=), "
            "one `<step>` folder of it, or that folder's `items`"
        ) from e


def _slots(tree: Mapping[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Slot -> tree of parameter ShapeDtypeStructs (params, Adam's moments), and the optax
    leaves that mirror no parameter (OptLeaf)."""
    params = tree["params"]
    roots: dict[str, Any] = {PARAM_SLOT: get_path(params, PARAMS[1:])}
    opt = tree.get("opt_state")
    if opt is None:
        return roots, []
    named = named_leaves(params)
    names = [n for n, _, _ in named]
    shapes = [tuple(x.shape) for _, _, x in named]
    import jax

    leaves = classify_opt_state(opt, jax.tree_util.tree_structure(params), names, shapes)
    by_param = {n: x for n, _, x in named}
    mirrors: dict[str, dict[int, Any]] = {}
    others = []
    for o in leaves:
        if o.param is None or o.slot is None:
            others.append(o)
        else:
            mirrors.setdefault(o.slot, {})[id(by_param[o.param])] = o.leaf
    for slot, by_id in mirrors.items():
        roots[slot] = _rebuild(roots[PARAM_SLOT], by_id)
    return roots, others


def _rebuild(tree: Any, by_id: dict[int, Any]) -> Any:
    """`tree` with every leaf replaced by its mirror (by the leaf's id)."""
    if isinstance(tree, Mapping):
        return {k: _rebuild(v, by_id) for k, v in tree.items()}
    return by_id.get(id(tree))


def _aux(reader: ArrayReader, node: Any, prefix: str, out: dict[str, Any]) -> None:
    """The nnx_aux leaves (RNG keys, counters) as JSON: {name: {dtype, shape, data}}."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            _aux(reader, v, f"{prefix}.{k}" if prefix else str(k), out)
        return
    if node is None or not hasattr(node, "shape"):
        return
    n = math.prod(node.shape)
    total = sum(math.prod(v["shape"]) for v in out.values()) + n
    if total > MAX_AUX_ELEMENTS:
        raise MaxTextFormatError(
            f"nnx_aux holds more than {MAX_AUX_ELEMENTS} elements (at {prefix!r}); only RNG "
            "state is expected there (batch statistics are not part of a Llama)"
        )
    a = reader.whole(node)
    out[prefix] = {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.reshape(-1).tolist()}


def _atom_groups(model: MaxTextModel) -> dict[str, list[tuple[Leaf, int | None]]]:
    """Atom -> the (leaf, layer) pairs that fill it, in column order."""
    out: dict[str, list[tuple[Leaf, int | None]]] = {}
    for leaf in model.leaves():
        for layer in model.layers_of(leaf):
            out.setdefault(model.atom_of(leaf, layer), []).append((leaf, layer))
    for parts in out.values():
        parts.sort(key=lambda p: p[0].spec.part)
    return out


def _write_atom(
    w: AtomWriter,
    reader: ArrayReader,
    model: MaxTextModel,
    atom: str,
    slot: str,
    parts: list[tuple[Leaf, int | None, Any]],
) -> None:
    """One slot of one atom, in whole-shard row blocks, each from the blocks of its leaves."""
    spec: Spec = parts[0][0].spec
    shape = model.atom_shape(spec)
    scale = model.row_scale(spec)
    fb = w.flat_block(atom, slot)
    row_elems = math.prod(shape[1:])
    shard_rows = fb // row_elems if fb else shape[0]
    step = max(1, shard_rows // scale)
    aligned = shard_rows % scale == 0
    n_rows = shape[0] // scale
    for lo in range(0, n_rows, step):
        hi = min(lo + step, n_rows)
        futs = [(sd, reader.read(sd, layer_index(leaf, layer, (lo, hi))), leaf)
                for leaf, layer, sd in parts]  # fmt: skip
        raw = [(leaf, reader.result(sd, f)) for sd, f, leaf in futs]
        blocks = [model.to_atom(leaf.spec, x, slot) for leaf, x in raw]
        data = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)
        box = ((lo * scale, hi * scale), *((0, d) for d in shape[1:]))
        w.write(atom, slot, box, data)
        exact = False
        for leaf, x in raw:
            name = model.exact_slot(leaf.spec, slot)
            if name is not None:  # MaxText's own values of a rescaled query kernel
                rows = model.raw_rows(x)
                w.write(atom, name, ((lo, hi), (0, rows.shape[1])), rows)
                exact = True
        if (exact or not aligned) and w.layout == "per-array":
            w.flush()  # version 2: blocks that share a shard file, one after the other


@ucp_errors(MaxTextFormatError, "import_maxtext")
def import_maxtext(
    src: Any,
    dst: Any,
    *,
    step: int | None = None,
    norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
    rope: str = "default",
    query_scaled: bool = True,
    overwrite: bool = False,
) -> str:
    """Import a MaxText Llama checkpoint (scanned or not) as ``ucp_jax.models.llama`` atoms.

    Args:
        src: MaxText's checkpoint folder (``<run>/checkpoints``: its latest step, or ``step``),
            one step folder of it, or the step's ``items`` folder.
        dst: where to write the universal checkpoint.
        step: the step folder to take from the checkpoint folder (default: the latest).
        norm_eps: MaxText's ``normalization_layer_epsilon`` (recorded in the model config).
        rope_theta: MaxText's ``rope_max_timescale``.
        rope: MaxText's ``rope_type``, ``default`` or ``llama3.1`` (interleaved RoPE pairs).
        query_scaled: the query kernel holds ``1/sqrt(head_dim)`` (MaxText's llama2 block does
            unless ``query_pre_attn_scalar`` or qk-norm is set).
        overwrite: replace an existing checkpoint at ``dst``.

    Returns:
        The location of the written checkpoint.

    Raises:
        NotACheckpointError: ``src`` is not an Orbax checkpoint.
        MaxTextFormatError: it is not a MaxText Llama (other parameters, other shapes).
        OrbaxImportError: its metadata or data are damaged.
    """
    t0 = time.perf_counter()
    source = open_maxtext(src, step)
    tree = source.tree
    where = os.fspath(src)
    if not isinstance(tree, Mapping) or not isinstance(get_path(tree, PARAMS), Mapping):
        raise MaxTextFormatError(
            f"{where}: no params.params in the item; not a MaxText train state"
        )
    model = infer_model(
        get_path(tree, PARAMS), norm_eps=norm_eps, rope_theta=rope_theta, rope=rope,
        query_scaled=query_scaled, where=where,
    )  # fmt: skip
    roots, others = _slots(tree)
    reader = ArrayReader(source)
    groups = _atom_groups(model)
    with AtomWriter(dst, overwrite=overwrite) as w:
        todo = []
        for atom, pairs in groups.items():
            spec = pairs[0][0].spec
            fused = model.fused(spec)
            marks = [FusedMark(*fused)] if fused else []
            w.atom(atom, model.atom_shape(spec), fused=marks)
            for slot, root in roots.items():
                parts = [(leaf, layer, get_path(root, leaf.path)) for leaf, layer in pairs]
                if any(sd is None for _, _, sd in parts):
                    continue
                dtypes = {np.dtype(sd.dtype) for _, _, sd in parts}
                if len(dtypes) > 1:
                    raise MaxTextFormatError(f"{where}: atom {atom!r} {slot}: mixed {dtypes}")
                dtype = dtypes.pop()
                w.create_many([(atom, slot, dtype, None)])
                for leaf, _, _ in parts:
                    name = model.exact_slot(leaf.spec, slot)
                    if name is not None:
                        rows = model.raw_rows(np.empty((1, *model.layer_shape(leaf.spec)[1:])))
                        shp = (model.layer_shape(leaf.spec)[0], rows.shape[1])
                        w.create_many([(atom, name, dtype, shp)])
                todo.append((atom, slot, parts))
        for atom, slot, parts in todo:
            _write_atom(w, reader, model, atom, slot, parts)
        for o in others:
            w.atom(o.name, tuple(o.leaf.shape), role=o.role)
            w.write(o.name, VALUE_SLOT, (), reader.whole(o.leaf).reshape(()))
        step_leaf = tree.get("step")
        value = int(reader.whole(step_leaf)) if step_leaf is not None else source.step
        aux: dict[str, Any] = {}
        _aux(reader, tree.get("nnx_aux"), "", aux)
        extra = {
            "hf_config": model.config.to_hf(),
            "maxtext": {"scan_layers": model.scan_layers, "rope": model.rope,
                        "query_scaled": model.query_scaled, "step_dir": source.step,
                        "nnx_aux": aux},
        }  # fmt: skip
        info = {"path": os.path.abspath(where), "step_dir": source.step,
                "seconds": round(time.perf_counter() - t0, 3), "skipped": source.skipped}  # fmt: skip
        return w.commit(step=value, source={"framework": "maxtext", "maxtext": info}, extra=extra)


def convert_main(args: Any) -> int:
    """`ucp convert maxtext SRC DST`: prints one line."""
    from ...checkpoint import Checkpoint

    t0 = time.perf_counter()
    import_maxtext(
        args.src, args.dst, step=args.step, norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        rope=args.rope, query_scaled=not args.unscaled_query, overwrite=args.overwrite,
    )  # fmt: skip
    ck = Checkpoint(args.dst)
    total = sum(a.nbytes for a in ck.atoms.values())
    print(
        f"wrote {ck.path}: {len(ck.atoms)} atoms, {total / 2**20:.2f} MiB, step {ck.step}, "
        f"in {time.perf_counter() - t0:.2f} s"
    )
    return 0


__all__ = ["MaxTextFormatError", "convert_main", "import_maxtext", "open_maxtext"]
