"""Megatron-style tensor-parallel slices -> atoms, as `universal_checkpoint_info` describes them.

Concatenated (column/row/vocabulary-parallel) slices go straight to their place in the atom;
replicated ones are checked equal, averaged ones averaged, and fused sub-params (QKV, SwiGLU)
re-assembled from each rank's chunks (DeepSpeed's `ds_to_universal` semantics).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from ...errors import MismatchError
from ...mapping.patterns import Averaged, Partitioned, Pattern, Replicated, VocabPadded
from ..common.writer import AtomWriter
from .common import DeepSpeedFormatError


@dataclasses.dataclass
class _Kind:
    """How the TP slices of one parameter make its atom."""

    how: str  # 'cat' | 'replicated' | 'average' | 'sub2' | 'sub'
    dim: int = 0
    vocab: bool = False
    sub: Any = None  # SubparamShape-like (patterns, shape, partition_dim)
    widths: Any = None  # per sub-param, per TP rank widths (UCP >= 0.4)


class Merger:
    """Places TP-slice fragments into atoms: concatenations directly, the rest buffered per param."""

    def __init__(
        self,
        w: AtomWriter,
        uc: dict[str, Any],
        tp: int,
        shapes: dict[str, list[tuple[int, ...] | None]],
    ) -> None:
        self.w, self.uc, self.tp, self.shapes = w, uc or {}, tp, shapes
        self.kinds: dict[str, _Kind] = {}
        self.bufs: dict[tuple[str, str], list[np.ndarray | None]] = {}
        self.filled: dict[tuple[str, str], list[int]] = {}
        self.steps: set[str] = set()

    def _match(self, key: str, name: str) -> bool:
        return any(re.match(p, name) for p in self.uc.get(key, []) or [])

    def kind(self, name: str) -> _Kind:
        k = self.kinds.get(name)
        if k is not None:
            return k
        vocab = self._match("vocabulary_parameter_patterns", name)
        if self.tp == 1:
            k = _Kind("cat", 0, vocab)
        elif self._match("tp_replicated_parameter_patterns", name):
            k = _Kind("replicated", vocab=vocab)
        elif self._match("parameter_to_average_patterns", name):
            k = _Kind("average", vocab=vocab)
        elif self._match("parameter_with_2_sub_params_cat_dim_0", name):
            k = _Kind("sub2", 0, vocab)
        else:
            sub = self._sub_params(name)
            if sub is not None:
                k = _Kind("sub", vocab=vocab, sub=sub[0], widths=sub[1])
            else:
                row = self._match("parameter_with_row_parallelism_patterns", name)
                k = _Kind("cat", 1 if row else 0, vocab)
        self.kinds[name] = k
        return k

    def _sub_params(self, name: str) -> tuple[Any, Any] | None:
        for s in self.uc.get("parameter_with_sub_params", []) or []:
            pats = s.patterns if hasattr(s, "patterns") else s.get("patterns", [])
            for p in pats:
                if re.match(p, name):
                    widths = (self.uc.get("sub_param_shard_widths") or {}).get(p)
                    return s, widths
        return None

    def slice_shape(self, name: str, t: int) -> tuple[int, ...]:
        s = self.shapes.get(name, [None] * self.tp)[t]
        if s is None:
            raise DeepSpeedFormatError(f"parameter {name!r} has no recorded shape on TP rank {t}")
        return tuple(int(d) for d in s)

    def atom_shape(self, name: str) -> tuple[int, ...]:
        k = self.kind(name)
        s0 = list(self.slice_shape(name, 0))
        if k.how in ("cat", "sub2"):
            s0[k.dim] = sum(self.slice_shape(name, t)[k.dim] for t in range(self.tp))
        elif k.how == "sub":
            pd = _sub_dim(k.sub)
            s0[pd] = sum(self.slice_shape(name, t)[pd] for t in range(self.tp))
        if k.vocab:
            s0[0] = min(s0[0], int(self.uc["original_vocab_size"]))
        return tuple(s0)

    def pattern(self, name: str) -> list[Pattern]:
        """The chain (atom outward) that records how the source held the atom."""
        k = self.kind(name)
        out: list[Pattern] = []
        if k.vocab:
            out.append(VocabPadded(self.atom_shape(name)[0], axis=0))
        if self.tp > 1:
            if k.how == "cat":
                out.append(Partitioned(k.dim))
            elif k.how == "replicated":
                out.append(Replicated())
            elif k.how == "average":
                out.append(Averaged())
        return out

    def declare(self, name: str) -> None:
        if name not in self.w.atoms:
            self.w.atom(name, self.atom_shape(name), pattern=self.pattern(name))

    def put(self, name: str, t: int, slot: str, flat: np.ndarray, start: int, keep: Any) -> None:
        """Elements [start, start + len) of TP rank t's slice of `name`, slot `slot`."""
        size = math.prod(self.slice_shape(name, t))
        if start < 0 or start + flat.size > size:
            raise DeepSpeedFormatError(
                f"import: parameter {name!r} ({slot}, TP rank {t}): fragments reach element "
                f"{start + flat.size} of a slice of {size} ({list(self.slice_shape(name, t))}); "
                "the rank files disagree with the recorded shapes"
            )
        self.declare(name)
        k = self.kind(name)
        if k.how == "cat":
            origin = [0] * len(self.slice_shape(name, t))
            if self.tp > 1:
                origin[k.dim] = sum(self.slice_shape(name, r)[k.dim] for r in range(t))
            self.w.write_flat(name, slot, flat, start, sub_shape=self.slice_shape(name, t),
                              origin=origin, keep=keep)  # fmt: skip
            return
        key = (name, slot)
        if key not in self.bufs:
            self.bufs[key] = [None] * self.tp
            self.filled[key] = [0] * self.tp
        bufs = self.bufs[key]
        buf = bufs[t]
        if buf is None:
            buf = bufs[t] = np.empty(math.prod(self.slice_shape(name, t)), flat.dtype)
        buf[start : start + flat.size] = flat
        self.filled[key][t] += flat.size
        if all(self.filled[key][r] == math.prod(self.slice_shape(name, r)) for r in range(self.tp)):
            full = [b for b in bufs if b is not None]  # all of them, once every slice is filled
            self._merge(
                name, slot, [b.reshape(self.slice_shape(name, r)) for r, b in enumerate(full)]
            )
            del self.bufs[key], self.filled[key]

    def _merge(self, name: str, slot: str, slices: list[np.ndarray]) -> None:
        k = self.kind(name)
        if k.how == "replicated":
            for r, s in enumerate(slices[1:], 1):
                if not np.array_equal(s, slices[0]):
                    raise MismatchError(
                        f"import: {name!r} ({slot}) is TP-replicated by universal_checkpoint_info "
                        f"but TP rank {r} differs from rank 0; the checkpoint is inconsistent"
                    )
            full = slices[0]
        elif k.how == "average":
            acc: Any = 0
            for s in slices:
                acc = acc + s
            full = (acc / len(slices)).astype(slices[0].dtype)
        elif k.how == "sub2":
            halves = [np.split(s, 2, axis=0) for s in slices]
            full = np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)
        else:
            full = _merge_sub_params(name, k, slices, self.tp, self.uc)
        if k.vocab:
            full = full[: self.atom_shape(name)[0]]
        self.w.write(name, slot, tuple((0, d) for d in full.shape), full)

    def step(self, name: str, value: Any) -> None:
        if value is None or name in self.steps:
            return
        self.declare(name)
        self.w.write_scalar(name, "step", value)
        self.steps.add(name)

    def check_done(self) -> None:
        if self.bufs:
            (name, slot), _ = next(iter(self.bufs.items()))
            raise DeepSpeedFormatError(
                f"import: parameter {name!r} ({slot}) is missing TP slices or fragments; some rank "
                "files are missing or truncated"
            )


def _sub_dim(sub: Any) -> int:
    return int(sub.partition_dim if hasattr(sub, "partition_dim") else sub["partition_dim"])


def _merge_sub_params(
    name: str, k: _Kind, slices: list[np.ndarray], tp: int, uc: dict[str, Any]
) -> np.ndarray:
    """Fused sub-parameters (e.g. QKV) split per TP rank: regroup each sub-param's pieces."""
    pd = _sub_dim(k.sub)
    shape = k.sub.shape if hasattr(k.sub, "shape") else k.sub["shape"]
    spec = shape[pd]
    total = sum(s.shape[pd] for s in slices)
    if isinstance(spec, list | tuple):
        sizes = [int(x) for x in spec]
    else:
        sizes = [total // int(spec)] * int(spec)
    widths = k.widths or [[sz // tp] * tp for sz in sizes]
    offs = [0] * tp
    chunks = []
    for ws in widths:
        pieces = []
        for r in range(tp):
            pieces.append(np.take(slices[r], range(offs[r], offs[r] + ws[r]), axis=pd))
            offs[r] += ws[r]
        chunks.append(np.concatenate(pieces, axis=pd))
    return np.concatenate(chunks, axis=pd)
