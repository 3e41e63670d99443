"""The torch tensors of a Llama-family model and the ``models.llama`` atoms they are regions of.

One table names every tensor three ways: torchtitan's (``layers.{i}.attention.qkv_linear.wq.weight``),
Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight``) and the atom's
(``blocks.{i}.attn.qkv.kernel``, part 0 of its fused columns, transposed). torchtitan's ComplexRoPE
rotates adjacent pairs of a head's dimensions, Hugging Face's rotate-half the two halves: the query
and key rows of a head are stored in another order (``to_half`` / ``to_pairs``, as torchtitan's own
``Llama3StateDictAdapter`` permutes them). Optimizer moments are element-wise, so they take the
same permutation as their parameter.

torchtitan's model keeps ``wq`` / ``wk`` / ``wv`` apart in its state dict, but its parameter (and so
the optimizer state's key) is the fused ``wqkv``: per KV group, the group's query heads, then its
key head, then its value head (``split_wqkv`` / ``fuse_wqkv``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from ...llama_config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class TorchName:
    """One torch tensor of the model: its names and the region of an atom it is.

    Attributes:
        torchtitan: torchtitan's name (``{i}`` = layer).
        hf: Hugging Face's name.
        atom: the atom it is (a part of), ``{i}`` = layer.
        part: which of the atom's fused column groups (q, k, v / gate, up), or None: all of it.
        transpose: the atom is the tensor transposed (torch ``[out, in]`` -> ``[in, out]``).
        rope: "q" / "k": rows permuted between torchtitan's pair order and HF's half order.
    """

    torchtitan: str
    hf: str
    atom: str
    part: int | None = None
    transpose: bool = False
    rope: str | None = None


_L, _H = "layers.{i}.", "model.layers.{i}."
NAMES: tuple[TorchName, ...] = (
    TorchName("tok_embeddings.weight", "model.embed_tokens.weight", "embed.embedding"),
    TorchName(_L + "attention_norm.weight", _H + "input_layernorm.weight", "blocks.{i}.ln1.scale"),
    TorchName(_L + "attention.qkv_linear.wq.weight", _H + "self_attn.q_proj.weight",
              "blocks.{i}.attn.qkv.kernel", 0, True, "q"),
    TorchName(_L + "attention.qkv_linear.wk.weight", _H + "self_attn.k_proj.weight",
              "blocks.{i}.attn.qkv.kernel", 1, True, "k"),
    TorchName(_L + "attention.qkv_linear.wv.weight", _H + "self_attn.v_proj.weight",
              "blocks.{i}.attn.qkv.kernel", 2, True),
    TorchName(_L + "attention.wo.weight", _H + "self_attn.o_proj.weight",
              "blocks.{i}.attn.out.kernel", None, True),
    TorchName(_L + "ffn_norm.weight", _H + "post_attention_layernorm.weight", "blocks.{i}.ln2.scale"),
    TorchName(_L + "feed_forward.w1.weight", _H + "mlp.gate_proj.weight",
              "blocks.{i}.mlp.gate_up.kernel", 0, True),
    TorchName(_L + "feed_forward.w3.weight", _H + "mlp.up_proj.weight",
              "blocks.{i}.mlp.gate_up.kernel", 1, True),
    TorchName(_L + "feed_forward.w2.weight", _H + "mlp.down_proj.weight",
              "blocks.{i}.mlp.down.kernel", None, True),
    TorchName("norm.weight", "model.norm.weight", "ln_f.scale"),
    TorchName("lm_head.weight", "lm_head.weight", "unembed.kernel", None, True),
)  # fmt: skip
WQKV = _L + "attention.qkv_linear.wqkv.weight"  # torchtitan's fused parameter (optimizer keys)
TIED = "unembed.kernel"  # absent when the embeddings are tied


def canonical_torchtitan(name: str) -> str:
    """torchtitan's current name of a tensor saved by an older release (``attention.wq``,
    ``output.weight``)."""
    name = re.sub(r"\.attention\.(wq|wk|wv|wqkv)\.", r".attention.qkv_linear.\1.", name)
    return "lm_head.weight" if name == "output.weight" else name


def template(pattern: str) -> re.Pattern[str]:
    """A name template (``{i}`` = layer) as a regex capturing the layer."""
    return re.compile(re.escape(pattern).replace(r"\{i\}", r"(\d+)"))


def match(name: str, kind: str = "torchtitan") -> tuple[TorchName, int | None] | None:
    """The table row of a tensor name (``kind``: "torchtitan" or "hf") and its layer."""
    for row in NAMES:
        m = template(getattr(row, kind)).fullmatch(name)
        if m:
            return row, (int(m[1]) if m.groups() else None)
    return None


def fill(tmpl: str, i: int | None) -> str:
    return tmpl if i is None else tmpl.replace("{i}", str(i))


def part_sizes(cfg: LlamaConfig, atom: str) -> tuple[int, ...] | None:
    """The fused column groups of an atom (q, k, v / gate, up), or None."""
    if atom.endswith("attn.qkv.kernel"):
        return cfg.qkv_sizes
    if atom.endswith("mlp.gate_up.kernel"):
        return (cfg.d_ff, cfg.d_ff)
    return None


def part_slice(cfg: LlamaConfig, row: TorchName) -> slice | None:
    sizes = part_sizes(cfg, row.atom)
    if row.part is None or sizes is None:
        return None
    off = sum(sizes[: row.part])
    return slice(off, off + sizes[row.part])


def rope_heads(cfg: LlamaConfig, row: TorchName) -> int | None:
    return {"q": cfg.n_heads, "k": cfg.n_kv_heads}.get(row.rope or "")


def to_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from pair order (0, 1), (2, 3)... to half order (0, 2, ..., 1, 3, ...)."""
    hd = w.shape[0] // heads
    return w.reshape(heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`to_half`."""
    hd = w.shape[0] // heads
    return w.reshape(heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def split_wqkv(
    w: torch.Tensor, cfg: LlamaConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's fused ``wqkv`` rows ``[n_kv, q heads + k + v, head_dim]`` -> wq, wk, wv."""
    g, hd = cfg.n_kv_heads, cfg.head_dim
    qpg = cfg.n_heads // g
    per = w.reshape(g, qpg + 2, hd, *w.shape[1:])
    tail = w.shape[1:]
    return (per[:, :qpg].reshape(-1, *tail), per[:, qpg].reshape(-1, *tail),
            per[:, qpg + 1].reshape(-1, *tail))  # fmt: skip


def fuse_wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """The inverse of :func:`split_wqkv`."""
    g, hd = cfg.n_kv_heads, cfg.head_dim
    tail = q.shape[1:]
    parts = [q.reshape(g, -1, hd, *tail), k.reshape(g, 1, hd, *tail), v.reshape(g, 1, hd, *tail)]
    return torch.cat(parts, 1).reshape(-1, *tail)


def to_atom_part(t: torch.Tensor, cfg: LlamaConfig, row: TorchName, kind: str) -> torch.Tensor:
    """A tensor (or its optimizer moment) as the atom's region: permuted, transposed."""
    heads = rope_heads(cfg, row)
    if heads and kind == "torchtitan":
        t = to_half(t, heads)
    return t.T if row.transpose else t


def from_atom_part(a: torch.Tensor, cfg: LlamaConfig, row: TorchName, kind: str) -> torch.Tensor:
    """The inverse of :func:`to_atom_part`: the torch tensor of an atom's region."""
    t = a.T if row.transpose else a
    heads = rope_heads(cfg, row)
    if heads and kind == "torchtitan":
        t = to_pairs(t, heads)
    return t.contiguous()


def rows_of(cfg: LlamaConfig) -> list[tuple[TorchName, int | None]]:
    """Every tensor of the model (each layer's), in state-dict order."""
    out: list[tuple[TorchName, int | None]] = []
    for row in NAMES:
        if row.atom == TIED and cfg.tie_embeddings:
            continue
        out += [(row, i) for i in range(cfg.n_layers)] if "{i}" in row.atom else [(row, None)]
    return out


def shape_of(cfg: LlamaConfig, row: TorchName) -> tuple[int, ...]:
    """The torch shape of a tensor of the table."""
    d, hd = cfg.d_model, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed.embedding": (cfg.vocab_size, d), "ln1.scale": (d,), "ln2.scale": (d,),
        "attn.out.kernel": (d, cfg.n_heads * hd), "mlp.down.kernel": (d, cfg.d_ff),
        "ln_f.scale": (d,), "unembed.kernel": (cfg.vocab_size, d),
    }  # fmt: skip
    if row.atom.endswith(("attn.qkv.kernel", "mlp.gate_up.kernel")):
        sizes = part_sizes(cfg, row.atom)
        assert sizes is not None and row.part is not None
        return (sizes[row.part], d)
    return shapes[row.atom.removeprefix("blocks.{i}.")]


def jsonable_groups(groups: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-parameter optimizer hyperparameters, grouped: ``[{"params": [...], **values}]``."""
    out: list[dict[str, Any]] = []
    for name, values in groups.items():
        for g in out:
            if {k: v for k, v in g.items() if k != "params"} == values:
                g["params"].append(name)
                break
        else:
            out.append({"params": [name], **values})
    return out
