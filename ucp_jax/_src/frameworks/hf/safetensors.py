"""Hugging Face safetensors (single file, or sharded with `model.safetensors.index.json`) -> atoms.

safetensors files are a JSON header plus raw little-endian tensors: they are memory-mapped and
read directly (no pickle, no torch needed for the data). Without a preset every tensor becomes an
atom of its own name and layout (slot `fp32`, the stored dtype kept). A preset builds the atoms of
a target model instead: each target atom is one source tensor or the concatenation of several,
optionally transposed (torch Linear `[out, in]` -> flax `[in, out]`); `{i}` in names stands for
the layer index.

>>> ucp.torch.import_safetensors("llama-tiny/", "/tmp/ucp/llama", preset="llama-demo")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import MismatchError
from ...mapping.patterns import FusedMark
from ...untrusted.limits import ucp_errors
from ...untrusted.safetensors import SafetensorsError, open_tensors
from ..common.hf_names import AtomFrom
from ..common.model_dtype import MODEL_FLOATS, model_float
from ..common.writer import AtomWriter

# ---------------------------------------------------------------------------------- presets


def _llama_demo() -> dict[str, AtomFrom]:
    lay = "model.layers.{i}."
    return {
        "embed.embedding": AtomFrom(("model.embed_tokens.weight",)),
        "blocks.{i}.ln1.scale": AtomFrom((lay + "input_layernorm.weight",)),
        "blocks.{i}.attn.qkv.kernel": AtomFrom(
            tuple(lay + f"self_attn.{p}_proj.weight" for p in "qkv"), transpose=True, axis=1
        ),
        "blocks.{i}.attn.out.kernel": AtomFrom((lay + "self_attn.o_proj.weight",), transpose=True),
        "blocks.{i}.ln2.scale": AtomFrom((lay + "post_attention_layernorm.weight",)),
        "blocks.{i}.mlp.gate_up.kernel": AtomFrom(
            (lay + "mlp.gate_proj.weight", lay + "mlp.up_proj.weight"), transpose=True, axis=1
        ),
        "blocks.{i}.mlp.down.kernel": AtomFrom((lay + "mlp.down_proj.weight",), transpose=True),
        "ln_f.scale": AtomFrom(("model.norm.weight",)),
        "unembed.kernel": AtomFrom(
            ("lm_head.weight",), transpose=True, fallback=("model.embed_tokens.weight",)
        ),
    }


# name -> (target atom template -> AtomFrom); "llama-demo": HF Llama names onto ucp_jax.demo's atoms
PRESETS: dict[str, dict[str, AtomFrom]] = {"llama-demo": _llama_demo()}
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # buffers that are no model weights


def _layers(preset: Mapping[str, AtomFrom], names: set[str]) -> list[int]:
    found: set[int] = set()
    for spec in preset.values():
        for s in spec.sources + spec.fallback:
            if "{i}" in s:
                rx = re.compile(re.escape(s).replace(r"\{i\}", r"(\d+)"))
                found |= {int(m[1]) for n in names if (m := rx.fullmatch(n))}
    return sorted(found)


def _layer_name(template: str, i: int | None) -> str:
    """A source or atom name with `{i}` replaced by layer `i` (as it is when `i` is None)."""
    return template if i is None else template.replace("{i}", str(i))


def resolve_preset(
    preset: Mapping[str, AtomFrom], names: set[str]
) -> dict[str, tuple[AtomFrom, list[str]]]:
    """Target atom -> (spec, concrete source names), for every layer found; checks coverage."""
    out: dict[str, tuple[AtomFrom, list[str]]] = {}
    layers = _layers(preset, names)
    for tmpl, spec in preset.items():
        for i in layers if "{i}" in tmpl else [None]:
            fill = functools.partial(_layer_name, i=i)
            srcs = [fill(s) for s in spec.sources]
            if not all(s in names for s in srcs) and spec.fallback:
                srcs = [fill(s) for s in spec.fallback]
            missing = [s for s in srcs if s not in names]
            if missing:
                raise SafetensorsError(
                    f"import: atom {fill(tmpl)!r} needs tensor(s) {missing} which the files lack; "
                    "wrong preset for this model?"
                )
            out[fill(tmpl)] = (spec, srcs)
    used = {s for _, srcs in out.values() for s in srcs}
    left = sorted(n for n in names - used if not IGNORED.fullmatch(n))
    if left:
        raise SafetensorsError(
            f"import: the preset uses no atom for tensor(s) {left[:6]}{'...' if len(left) > 6 else ''}"
            "; extend the preset (or import without one)"
        )
    return out


@ucp_errors(SafetensorsError, "import_safetensors")
def import_safetensors(
    src: Any,
    dst: Any,
    *,
    preset: str | Mapping[str, AtomFrom] | None = None,
    dtype: Any = None,
    overwrite: bool = False,
    step: int | None = None,
) -> str:
    """Import safetensors weights (single file, sharded with an index, or a folder) as atoms.

    Args:
        src: a `.safetensors` file, a `model.safetensors.index.json`, or a folder with either.
        dst: where to write the universal checkpoint.
        preset: a name in `PRESETS` (e.g. "llama-demo": HF Llama names onto the atoms of
            `ucp_jax.demo`), or a mapping target atom -> AtomFrom; None keeps names and layouts.
        dtype: store the `fp32` slots in this dtype (default: as stored, e.g. bf16).
        overwrite: replace an existing checkpoint at `dst`.
        step: training step to record.

    Returns:
        The location of the written checkpoint.
    """
    tensors = open_tensors(src)
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise SafetensorsError(f"import: no preset {preset!r}; known: {sorted(PRESETS)}")
        spec_map: Mapping[str, AtomFrom] | None = PRESETS[preset]
    else:
        spec_map = preset
    want = model_float(dtype, f"import_safetensors(dtype=...) of {src}", (*MODEL_FLOATS, "float64"))
    with AtomWriter(dst, overwrite=overwrite) as w:
        if spec_map is None:
            for name, sf in tensors.items():
                a = sf.array(name)
                w.atom(name, a.shape)
                w.write(name, "fp32", tuple((0, d) for d in a.shape), _cast(a, want))
        else:
            for atom, (spec, srcs) in resolve_preset(spec_map, set(tensors)).items():
                arrays = [tensors[s].array(s) for s in srcs]
                if spec.transpose:
                    if any(a.ndim != 2 for a in arrays):
                        raise SafetensorsError(f"import: atom {atom!r}: only 2-d sources transpose")
                    arrays = [a.T for a in arrays]
                shape = list(arrays[0].shape)
                for a in arrays[1:]:
                    if a.ndim != len(shape) or any(
                        x != y for j, (x, y) in enumerate(zip(a.shape, shape)) if j != spec.axis
                    ):
                        raise MismatchError(
                            f"import: atom {atom!r}: sources {srcs} do not concatenate on axis "
                            f"{spec.axis} ({[x.shape for x in arrays]})"
                        )
                write_concatenated(w, atom, arrays, spec.axis, want)
                w.release_sources()
        files = sorted({os.path.basename(sf.path) for sf in tensors.values()})
        meta = next(iter(tensors.values())).metadata if tensors else {}
        source = {
            "framework": "safetensors",
            "safetensors": {"path": os.path.abspath(os.fspath(src)), "files": files,
                            "preset": preset if isinstance(preset, str) or preset is None
                            else "custom", "metadata": meta},
        }  # fmt: skip
        return w.commit(step=step, source=source)


def _cast(a: np.ndarray, want: np.dtype | None) -> np.ndarray:
    return a if want is None or a.dtype == want else a.astype(want)


def write_concatenated(
    w: AtomWriter, atom: str, arrays: list[np.ndarray], axis: int, want: np.dtype | None
) -> None:
    """Declare `atom` as `arrays` concatenated along `axis` (a fused atom when there are several:
    QKV, gate/up) and write each at its offset, cast to `want` (None: as stored; float32 when
    the arrays' dtypes differ)."""
    if want is None and len({a.dtype for a in arrays}) > 1:  # no common dtype for bf16 and f16
        want = np.dtype(np.float64 if any(a.dtype.itemsize > 4 for a in arrays) else np.float32)
    shape = list(arrays[0].shape)
    shape[axis] = sum(a.shape[axis] for a in arrays)
    fused = [FusedMark(tuple(a.shape[axis] for a in arrays), axis)] if len(arrays) > 1 else []
    w.atom(atom, shape, fused=fused)
    off = 0
    for a in arrays:
        box = [(0, d) for d in a.shape]
        box[axis] = (off, off + a.shape[axis])
        off += a.shape[axis]
        w.write(atom, "fp32", tuple(box), _cast(a, want))


__all__ = ["PRESETS", "AtomFrom", "import_safetensors"]
