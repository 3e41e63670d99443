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

import dataclasses
import functools
import json
import os
import re
import struct
from collections.abc import Mapping
from typing import IO, Any

import ml_dtypes
import numpy as np

from ..errors import MismatchError, NotACheckpointError, UcpError
from ..format.paths import join_inside, open_inside
from ..mapping.patterns import FusedMark
from .limits import MAX_JSON_DEPTH, as_int, as_shape, json_depth, numel, ucp_errors
from .writer import AtomWriter

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64,
    "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}  # fmt: skip
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20


class SafetensorsError(UcpError, ValueError):
    """A safetensors file or index is malformed, or a preset does not fit the tensors."""


# ---------------------------------------------------------------------------------- reading


class SafetensorsFile:
    """One safetensors file, memory-mapped: `names`, `meta(name)`, `array(name)` (a view).

    The header is checked before any tensor is touched: its length against the file, its JSON
    nesting, and for every tensor a known dtype, a shape of non-negative integers, and
    `data_offsets` inside the data section that hold exactly shape x itemsize bytes.
    `root`/`rel`: open `root/rel`, refusing names that leave `root` and symbolic links.
    """

    def __init__(self, path: str, *, root: str | None = None) -> None:
        self.path = path
        with _open(path, root, "safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(MAX_HEADER, size - 8):
                raise SafetensorsError(
                    f"{path}: header length {n} (the first 8 bytes) exceeds the file "
                    f"({size} bytes) or {MAX_HEADER}; not a safetensors file, or truncated"
                )
            raw = f.read(n)
            self.base = 8 + n
            self._mm = np.memmap(f, np.uint8, mode="r") if size > self.base else None
        header: dict[str, Any] = _parse_header(path, raw)
        self.metadata = header.pop("__metadata__", None) or {}
        self.header: dict[str, dict[str, Any]] = header
        if not isinstance(self.metadata, dict):
            raise SafetensorsError(
                f"{path}: __metadata__ must be an object, found {self.metadata!r:.60}"
            )
        data = size - self.base
        for name, h in self.header.items():
            _check_entry(path, name, h, data)

    @property
    def names(self) -> list[str]:
        return list(self.header)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(DTYPES[self.header[name]["dtype"]])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self.header[name]["shape"])

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy view of the mapped file."""
        b, e = self.header[name]["data_offsets"]
        if self._mm is None or e == b:
            return np.zeros(self.shape(name), self.dtype(name))
        return (
            self._mm[self.base + b : self.base + e].view(self.dtype(name)).reshape(self.shape(name))
        )


def _open(path: str, root: str | None, what: str) -> IO[bytes]:
    """`path` (the file the user named), or `root/<path relative to root>` confined to `root`."""
    try:
        if root is None:
            return open(path, "rb")  # the file the user named
        return open_inside(root, os.path.relpath(path, root), what)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot open the {what} ({e.strerror or e})") from e


def _parse_header(path: str, raw: bytes) -> dict[str, Any]:
    """The header JSON: an object, nested at most MAX_JSON_DEPTH deep (checked before parsing)."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise SafetensorsError(
            f"{path}: header nests {depth} levels deep (a safetensors header is 3 deep, at most "
            f"{MAX_JSON_DEPTH} accepted); the file is damaged or hostile"
        )
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise SafetensorsError(f"{path}: header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is a {type(header).__name__}, expected an object")
    return header


def _check_entry(path: str, name: str, h: Any, data: int) -> None:
    """One tensor entry: a known dtype, a valid shape, offsets inside the data section."""
    what = f"{path}: tensor {name!r}"
    if not isinstance(h, dict) or not {"dtype", "shape", "data_offsets"} <= set(h):
        raise SafetensorsError(f"{what}: expected {{dtype, shape, data_offsets}}, found {h!r:.80}")
    code = h["dtype"]
    if not isinstance(code, str) or code not in DTYPES:
        raise SafetensorsError(f"{what}: unsupported dtype {code!r:.40}; known: {sorted(DTYPES)}")
    shape = as_shape(h["shape"], what, SafetensorsError)
    itemsize = np.dtype(DTYPES[code]).itemsize
    count = numel(shape, what, itemsize=itemsize, backing=data, backed_by="the data section")
    offs = h["data_offsets"]
    if not isinstance(offs, list) or len(offs) != 2:
        raise SafetensorsError(f"{what}: data_offsets must be [begin, end], found {offs!r:.60}")
    b = as_int(offs[0], f"{what}: data_offsets begin", SafetensorsError)
    e = as_int(offs[1], f"{what}: data_offsets end", SafetensorsError)
    if not b <= e <= data or e - b != count * itemsize:
        raise SafetensorsError(
            f"{what}: data_offsets [{b}, {e}] must lie in the data section [0, {data}] and hold "
            f"{count * itemsize} bytes (shape {list(shape)} x {itemsize} bytes of {code}); the "
            "file is damaged"
        )


def _load_index(path: str, root: str | None) -> dict[str, str]:
    """The weight_map of a model.safetensors.index.json (inside `root` when given)."""
    with _open(path, root, "safetensors index") as f:
        raw = f.read(MAX_HEADER + 1)
    if len(raw) > MAX_HEADER or json_depth(raw) > MAX_JSON_DEPTH:
        raise SafetensorsError(f"{path}: index larger than {MAX_HEADER} bytes or nested too deep")
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise SafetensorsError(f"{path}: the index is not JSON ({e})") from e
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise SafetensorsError(f"{path}: an index without a weight_map of tensor -> file name")
    return wmap


def open_tensors(src: Any) -> dict[str, SafetensorsFile]:
    """Tensor name -> its file, for a .safetensors file, an index.json, or a folder of either.

    Files named by an index or found in a folder must lie inside that folder (no `..`, no
    absolute paths, no symbolic links).
    """
    src = os.fspath(src)
    root = None
    if os.path.isdir(src):
        root = src
        if os.path.isfile(os.path.join(src, INDEX)):
            src = os.path.join(src, INDEX)
        else:
            names = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
            if not names:
                raise NotACheckpointError(f"{src}: no *.safetensors files and no {INDEX}")
            out: dict[str, SafetensorsFile] = {}
            for f in names:
                sf = SafetensorsFile(join_inside(src, f, "safetensors file"), root=src)
                for n in sf.names:
                    if n in out:
                        raise SafetensorsError(f"{src}: tensor {n!r} is in {f} and in another file")
                    out[n] = sf
            return out
    if not os.path.isfile(src):
        raise NotACheckpointError(f"{src}: no such file or directory")
    if src.endswith(".json"):
        wmap = _load_index(src, root)
        folder = os.path.dirname(src)
        files = {
            f: SafetensorsFile(join_inside(folder, f, f"{src}: weight_map file"), root=folder)
            for f in sorted(set(wmap.values()))
        }
        out = {}
        for n, f in wmap.items():
            if n not in files[f].header:
                raise SafetensorsError(f"{src}: the index puts {n!r} in {f}, which lacks it")
            out[n] = files[f]
        return out
    sf = SafetensorsFile(src)
    return dict.fromkeys(sf.names, sf)


# ---------------------------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class AtomFrom:
    """A target atom built from source tensors: `concat(maybe_T(src_k) for k, axis)`.

    Attributes:
        sources: source tensor names; `{i}` is the layer index.
        transpose: transpose each (2-d) source first (torch Linear `[out, in]` -> `[in, out]`).
        axis: the concatenation axis (after transposing).
        fallback: sources to use when `sources` are absent (e.g. a tied `lm_head`).
    """

    sources: tuple[str, ...]
    transpose: bool = False
    axis: int = 0
    fallback: tuple[str, ...] = ()


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
    want = None if dtype is None else np.dtype(dtype)
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
                w.flush()
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
    QKV, gate/up) and write each at its offset, cast to `want` (None: as stored)."""
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


__all__ = ["PRESETS", "AtomFrom", "SafetensorsError", "import_safetensors", "open_tensors"]
