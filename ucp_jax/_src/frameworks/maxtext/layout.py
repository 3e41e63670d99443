"""MaxText's Llama (``decoder_block: llama2``) <-> the atoms of ``ucp_jax.models.llama``.

MaxText stores its train state as the Linen tree ``params.params.{token_embedder, decoder}``;
with ``scan_layers=True`` (its default) every per-layer parameter is one leaf with the layers
stacked on ``param_scan_axis`` (1), else one subtree ``decoder.layers_<i>`` per layer. The atoms
are those the Hugging Face, Megatron and torchtitan importers write (torch semantics):

==========================================================  ======================================  ===============================
MaxText leaf (under ``params.params``)                       atom                                    how
==========================================================  ======================================  ===============================
``token_embedder.embedding`` ``[V, d]``                      ``embed.embedding`` ``[V, d]``          as is
``decoder.layers.pre_self_attention_layer_norm.scale``       ``blocks.{i}.ln1.scale`` ``[d]``        layer ``i`` of the stack
``decoder.layers.self_attention.query.kernel`` ``[d,H,hd]``  ``blocks.{i}.attn.qkv.kernel`` q cols   ``* sqrt(hd)``, heads flattened
``decoder.layers.self_attention.key.kernel`` ``[d,K,hd]``    ``blocks.{i}.attn.qkv.kernel`` k cols   heads flattened
``decoder.layers.self_attention.value.kernel``               ``blocks.{i}.attn.qkv.kernel`` v cols   heads flattened
``decoder.layers.self_attention.out.kernel`` ``[H,hd,d]``    ``blocks.{i}.attn.out.kernel`` ``[H*hd, d]``  heads flattened
``decoder.layers.post_self_attention_layer_norm.scale``      ``blocks.{i}.ln2.scale``
``decoder.layers.mlp.wi_0.kernel`` / ``wi_1`` ``[d, F]``     ``blocks.{i}.mlp.gate_up.kernel`` gate / up cols
``decoder.layers.mlp.wo.kernel`` ``[F, d]``                  ``blocks.{i}.mlp.down.kernel``
``decoder.decoder_norm.scale``                               ``ln_f.scale``
``decoder.logits_dense.kernel`` ``[d, V]``                   ``unembed.kernel`` (absent when tied)
==========================================================  ======================================  ===============================

MaxText folds attention's ``1/sqrt(head_dim)`` into the query kernel (its initializer divides by
it; the attention does not scale), so the query atom is MaxText's kernel times ``sqrt(hd)``, and
its Adam moments are the gradient's in that parametrization: ``mu / sqrt(hd)``, ``nu / hd``.
With ``rope_type: llama3.1`` MaxText's RoPE rotates interleaved pairs; q and k columns are then
de-interleaved per head (MaxText's own ``to_huggingface`` does the same). Optax's ``mu`` / ``nu``
are the atoms' ``exp_avg`` / ``exp_avg_sq`` slots.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ...errors import UcpError
from ...llama_config import LlamaConfig

SCAN_AXIS = 1  # MaxText's param_scan_axis
ROPES = ("default", "llama3.1")
PARAMS = ("params", "params")  # where the parameters sit in MaxText's `items` tree
LLAMA31_SCALING = (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
                   ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192))  # fmt: skip


class MaxTextFormatError(UcpError, ValueError):
    """A MaxText checkpoint (or the state to export) is not a Llama this mapping covers."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """One MaxText parameter (one layer's, for per-layer ones) and its region of an atom.

    Attributes:
        path: its key path under ``params.params`` (per-layer: under the layer's subtree).
        atom: the atom (``{i}``: the layer).
        kind: ``same`` (the atom, or columns of it), ``heads_in`` (``[d, heads, hd]`` -> columns
            ``[d, heads*hd]``), ``heads_out`` (``[heads, hd, d]`` -> rows ``[heads*hd, d]``).
        part: the fused part of the atom it fills (q, k, v / gate, up), else 0.
    """

    path: tuple[str, ...]
    atom: str
    kind: str = "same"
    part: int = 0


LAYER_SPECS = (
    Spec(("pre_self_attention_layer_norm", "scale"), "blocks.{i}.ln1.scale"),
    Spec(("self_attention", "query", "kernel"), "blocks.{i}.attn.qkv.kernel", "heads_in", 0),
    Spec(("self_attention", "key", "kernel"), "blocks.{i}.attn.qkv.kernel", "heads_in", 1),
    Spec(("self_attention", "value", "kernel"), "blocks.{i}.attn.qkv.kernel", "heads_in", 2),
    Spec(("self_attention", "out", "kernel"), "blocks.{i}.attn.out.kernel", "heads_out"),
    Spec(("post_self_attention_layer_norm", "scale"), "blocks.{i}.ln2.scale"),
    Spec(("mlp", "wi_0", "kernel"), "blocks.{i}.mlp.gate_up.kernel", "same", 0),
    Spec(("mlp", "wi_1", "kernel"), "blocks.{i}.mlp.gate_up.kernel", "same", 1),
    Spec(("mlp", "wo", "kernel"), "blocks.{i}.mlp.down.kernel"),
)
GLOBAL_SPECS = (
    Spec(("token_embedder", "embedding"), "embed.embedding"),
    Spec(("decoder", "decoder_norm", "scale"), "ln_f.scale"),
    Spec(("decoder", "logits_dense", "kernel"), "unembed.kernel"),
)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One MaxText parameter leaf: its full path under ``params.params`` and its mapping.

    ``layer`` is the layer of an unscanned per-layer leaf; None for a stacked leaf (all layers,
    on ``SCAN_AXIS``) and for the embedding, final norm and output layer.
    """

    path: tuple[str, ...]
    spec: Spec
    layer: int | None
    stacked: bool

    @property
    def name(self) -> str:
        return ".".join((*PARAMS, *self.path))


@dataclasses.dataclass(frozen=True)
class MaxTextModel:
    """A MaxText Llama: its config, its layer storage and the conventions of its weights.

    Attributes:
        config: the model (Llama-family config; its ``norm_eps`` and ``rope_theta`` are
            MaxText's ``normalization_layer_epsilon`` and ``rope_max_timescale``).
        scan_layers: layers stacked on axis 1 (MaxText's ``scan_layers``).
        rope: MaxText's ``rope_type``: ``default`` (rotate-half, as torch) or ``llama3.1``
            (interleaved pairs).
        query_scaled: the query kernel holds ``1/sqrt(head_dim)`` (MaxText's llama2 block,
            unless ``query_pre_attn_scalar`` or qk-norm is set).
    """

    config: LlamaConfig
    scan_layers: bool = True
    rope: str = "default"
    query_scaled: bool = True

    def __post_init__(self) -> None:
        if self.rope not in ROPES:
            raise MaxTextFormatError(f"rope {self.rope!r}: expected one of {ROPES}")
        c = self.config
        if c.n_experts or c.qkv_bias or c.sliding_window is not None:
            raise MaxTextFormatError(
                "MaxText's llama2 decoder block has no experts, q/k/v biases or sliding window; "
                f"this {c.model_type} config has one of them"
            )

    # ------------------------------------------------------------------- names and shapes

    def leaves(self) -> list[Leaf]:
        """Every MaxText parameter leaf, embedding first."""
        out = [Leaf(s.path, s, None, False) for s in GLOBAL_SPECS[:2]]
        if not self.config.tie_embeddings:
            out.append(Leaf(GLOBAL_SPECS[2].path, GLOBAL_SPECS[2], None, False))
        for s in LAYER_SPECS:
            if self.scan_layers:
                out.append(Leaf(("decoder", "layers", *s.path), s, None, True))
            else:
                out += [
                    Leaf(("decoder", f"layers_{i}", *s.path), s, i, False)
                    for i in range(self.config.n_layers)
                ]
        return out

    def layer_shape(self, spec: Spec) -> tuple[int, ...]:
        """One layer's shape of a parameter, as MaxText holds it."""
        c = self.config
        d, h, k, hd, f, v = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
        name = spec.path[-2]
        return {
            "token_embedder": (v, d), "decoder_norm": (d,), "logits_dense": (d, v),
            "pre_self_attention_layer_norm": (d,), "post_self_attention_layer_norm": (d,),
            "query": (d, h, hd), "key": (d, k, hd), "value": (d, k, hd), "out": (h, hd, d),
            "wi_0": (d, f), "wi_1": (d, f), "wo": (f, d),
        }[name]  # fmt: skip

    def leaf_shape(self, leaf: Leaf) -> tuple[int, ...]:
        shape = self.layer_shape(leaf.spec)
        if leaf.stacked:
            return (*shape[:SCAN_AXIS], self.config.n_layers, *shape[SCAN_AXIS:])
        return shape

    def atom_shape(self, spec: Spec) -> tuple[int, ...]:
        c = self.config
        if spec.atom.endswith("qkv.kernel"):
            return (c.d_model, sum(c.qkv_sizes))
        if spec.atom.endswith("gate_up.kernel"):
            return (c.d_model, 2 * c.d_ff)
        shape = self.layer_shape(spec)
        return (shape[0] * shape[1], shape[2]) if spec.kind == "heads_out" else shape

    def fused(self, spec: Spec) -> tuple[tuple[int, ...], int] | None:
        """(sizes, axis) of a fused atom, else None."""
        if spec.atom.endswith("qkv.kernel"):
            return self.config.qkv_sizes, 1
        if spec.atom.endswith("gate_up.kernel"):
            return (self.config.d_ff,) * 2, 1
        return None

    def columns(self, spec: Spec) -> tuple[int, int] | None:
        """The atom columns one parameter fills (fused atoms), else None (the whole atom)."""
        f = self.fused(spec)
        if f is None:
            return None
        sizes = f[0]
        lo = sum(sizes[: spec.part])
        return lo, lo + sizes[spec.part]

    def atom_of(self, leaf: Leaf, layer: int | None) -> str:
        return leaf.spec.atom.replace("{i}", str(layer))

    def layers_of(self, leaf: Leaf) -> list[int | None]:
        """The layers a leaf holds (None: a global parameter)."""
        if leaf.stacked:
            return list(range(self.config.n_layers))
        return [leaf.layer]

    # ------------------------------------------------------------------------ conversions

    def _factor(self, spec: Spec, slot: str) -> float | None:
        """The factor atom = MaxText * factor of the query kernel's slot, else None."""
        if not (self.query_scaled and spec.path[-2] == "query"):
            return None
        hd = self.config.head_dim
        s = math.sqrt(hd)
        return {"fp32": s, "exp_avg_sq": 1.0 / hd}.get(slot, 1.0 / s)  # moments: of the gradient

    def exact_slot(self, spec: Spec, slot: str) -> str | None:
        """The slot that keeps MaxText's own values of a rescaled parameter, else None.

        Scaling by ``sqrt(head_dim)`` and back is exact when the factor is a power of two; else
        one float32 in about seven comes back one ulp off, which MaxText's bfloat16 compute
        turns into losses 1e-4 apart after a few steps. So the importer keeps MaxText's values
        in this slot (``maxtext_<slot>``, the parameter's columns only), and the exporter takes
        them wherever the atom still holds exactly their rescaled value.
        """
        f = self._factor(spec, slot)
        if f is None or math.frexp(f)[0] == 0.5:
            return None
        return f"maxtext_{slot}"

    def raw_rows(self, x: np.ndarray) -> np.ndarray:
        """Rows of one layer's parameter as 2-d rows (the layout of an exact slot)."""
        return x.reshape(x.shape[0], -1)

    def _perm(self, spec: Spec) -> np.ndarray | None:
        """Head-dim order of the atom's q/k columns (interleaved RoPE), else None."""
        if self.rope != "llama3.1" or spec.path[-2] not in ("query", "key"):
            return None
        hd = self.config.head_dim
        return np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])

    def row_scale(self, spec: Spec) -> int:
        """Atom rows per leading row of one layer's parameter."""
        return self.config.head_dim if spec.kind == "heads_out" else 1

    def to_atom(self, spec: Spec, x: np.ndarray, slot: str) -> np.ndarray:
        """Rows of one layer's parameter (MaxText layout) -> the same rows in the atom's layout."""
        perm = self._perm(spec)
        if perm is not None:
            x = x[..., perm]
        if spec.kind == "heads_in":
            x = x.reshape(x.shape[0], -1)
        elif spec.kind == "heads_out":
            x = x.reshape(-1, x.shape[-1])
        return _scaled(x, self._factor(spec, slot), inverse=False)

    def from_atom(self, spec: Spec, a: np.ndarray, slot: str) -> np.ndarray:
        """Rows of an atom region -> one layer's parameter rows in MaxText's layout."""
        return self.unflatten(spec, _scaled(a, self._factor(spec, slot), inverse=True))

    def unflatten(self, spec: Spec, a: np.ndarray) -> np.ndarray:
        """Atom rows -> MaxText's layout of the parameter rows (no rescaling)."""
        c = self.config
        if spec.kind == "heads_in":
            a = a.reshape(a.shape[0], -1, c.head_dim)
        elif spec.kind == "heads_out":
            a = a.reshape(-1, c.head_dim, a.shape[-1])
        perm = self._perm(spec)
        if perm is not None:
            a = a[..., np.argsort(perm)]
        return a


def _scaled(x: np.ndarray, factor: float | None, *, inverse: bool) -> np.ndarray:
    """x * factor (or / factor), computed in float64 and rounded once to x's dtype."""
    if factor is None:
        return x
    y = x.astype(np.float64)
    y = y / factor if inverse else y * factor
    return y.astype(x.dtype)


def layer_index(leaf: Leaf, layer: int | None, rows: tuple[int, int]) -> tuple[Any, ...]:
    """The index of rows [lo, hi) of one layer's parameter inside the MaxText leaf."""
    sl = slice(*rows)
    if leaf.stacked:
        assert layer is not None
        if SCAN_AXIS == 0:
            return (layer, sl)
        return (sl, *([slice(None)] * (SCAN_AXIS - 1)), layer)
    return (sl,)


def row_blocks(n_rows: int, row_bytes: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) row ranges of at most `block_bytes` (at least one row each)."""
    step = max(1, block_bytes // max(row_bytes, 1))
    for lo in range(0, n_rows, step):
        yield lo, min(lo + step, n_rows)


def get_path(tree: Any, path: tuple[str, ...]) -> Any:
    """The node at `path` of nested mappings, or None."""
    for k in path:
        if not isinstance(tree, Mapping) or k not in tree:
            return None
        tree = tree[k]
    return tree


def infer_model(
    params: Mapping[str, Any],
    *,
    norm_eps: float,
    rope_theta: float,
    rope: str,
    query_scaled: bool,
    where: str,
) -> MaxTextModel:
    """The MaxText model of a tree of parameter shapes (``params.params``'s content)."""

    def shape(*path: str) -> tuple[int, ...]:
        x = get_path(params, path)
        if x is None or not hasattr(x, "shape"):
            raise MaxTextFormatError(
                f"{where}: no parameter params.params.{'.'.join(path)}; not a MaxText Llama "
                "(decoder_block llama2: RMSNorm, self_attention query/key/value/out, mlp "
                "wi_0/wi_1/wo)"
            )
        return tuple(int(d) for d in x.shape)

    dec = params.get("decoder") if isinstance(params, Mapping) else None
    if not isinstance(dec, Mapping):
        raise MaxTextFormatError(f"{where}: no params.params.decoder; not a MaxText checkpoint")
    scan = "layers" in dec
    v, d = shape("token_embedder", "embedding")
    if scan:
        q = shape("decoder", "layers", "self_attention", "query", "kernel")
        kk = shape("decoder", "layers", "self_attention", "key", "kernel")
        f = shape("decoder", "layers", "mlp", "wi_0", "kernel")
        if len(q) != 4 or len(kk) != 4 or len(f) != 3:
            raise MaxTextFormatError(
                f"{where}: stacked query/key/mlp kernels of shapes {q}, {kk}, {f}; expected "
                f"[d, layers, heads, head_dim] and [d, layers, mlp] (param_scan_axis 1)"
            )
        n_layers, h, hd, k, ff = q[1], q[2], q[3], kk[2], f[2]
    else:
        n_layers = sum(1 for key in dec if key.startswith("layers_"))
        if not n_layers or any(f"layers_{i}" not in dec for i in range(n_layers)):
            raise MaxTextFormatError(
                f"{where}: decoder has neither `layers` (scanned) nor layers_0..layers_N-1"
            )
        q = shape("decoder", "layers_0", "self_attention", "query", "kernel")
        k = shape("decoder", "layers_0", "self_attention", "key", "kernel")[1]
        h, hd = q[1], q[2]
        ff = shape("decoder", "layers_0", "mlp", "wi_0", "kernel")[1]
    tied = get_path(params, ("decoder", "logits_dense")) is None
    cfg = LlamaConfig(
        model_type="llama", vocab_size=v, d_model=d, n_heads=h, n_kv_heads=k, head_dim=hd,
        n_layers=n_layers, d_ff=ff, norm_eps=norm_eps, rope_theta=rope_theta,
        rope_scaling=LLAMA31_SCALING if rope == "llama3.1" else (), tie_embeddings=tied,
    )  # fmt: skip
    model = MaxTextModel(cfg, scan, rope, query_scaled)
    check_leaves(model, params, where)
    return model


def check_leaves(model: MaxTextModel, params: Mapping[str, Any], where: str) -> None:
    """Every expected parameter is there with its shape, and nothing else."""
    want = {leaf.path: model.leaf_shape(leaf) for leaf in model.leaves()}
    found: dict[tuple[str, ...], tuple[int, ...]] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*path, str(k)))
        elif node is not None:
            found[path] = tuple(int(d) for d in getattr(node, "shape", ()))

    walk(params, ())
    extra = sorted(set(found) - set(want))
    if extra:
        raise MaxTextFormatError(
            f"{where}: parameter params.params.{'.'.join(extra[0])} is not part of a MaxText "
            "Llama (decoder_block llama2, no biases, no MoE); this mapping does not cover it"
        )
    for path, shp in want.items():
        if found.get(path) != shp:
            raise MaxTextFormatError(
                f"{where}: params.params.{'.'.join(path)} has shape {found.get(path)}, the "
                f"model inferred from the other parameters needs {shp}"
            )
