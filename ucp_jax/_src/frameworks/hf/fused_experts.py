"""transformers 5's fused Mixtral experts in a safetensors file, read under the per-expert names.

``save_pretrained`` writes Mixtral's experts one tensor each (``block_sparse_moe.experts.<e>.w1``,
``w2``, ``w3`` and the router ``block_sparse_moe.gate``), the names the Hub's models have. A file
of the model's own ``state_dict()`` (``safetensors.torch.save_file(model.state_dict(), ...)``) holds
transformers 5's parameters instead: ``mlp.experts.gate_up_proj [E, 2F, D]`` (each expert's gate
rows, then its up rows), ``mlp.experts.down_proj [E, D, F]`` and ``mlp.gate.weight [E, D]``.
transformers loads both. Here the fused ones are seen under the per-expert names, each a view
into its fused tensor (nothing copied), so the rest of the import is the same for both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...untrusted.safetensors import SafetensorsError, SafetensorsFile

_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")  # fmt: skip


class ExpertView:
    """One per-expert tensor, a view into a fused tensor of one file: ``fused[index][rows]``.

    Answers what the import asks of a `SafetensorsFile` for that name (`path`, `shape`, `dtype`,
    `array`); `file` and `name` are the fused tensor's.
    """

    def __init__(
        self, file: SafetensorsFile, name: str, index: int | None, rows: tuple[int, int] | None
    ) -> None:
        self.file, self.name, self.index, self.rows = file, name, index, rows
        self.path = file.path

    def shape(self, _name: str) -> tuple[int, ...]:
        shape = self.file.shape(self.name)[0 if self.index is None else 1 :]
        if self.rows is not None:
            shape = (self.rows[1] - self.rows[0], *shape[1:])
        return shape

    def dtype(self, _name: str) -> np.dtype:
        return self.file.dtype(self.name)

    def array(self, _name: str) -> np.ndarray:
        a = self.file.array(self.name)
        if self.index is not None:
            a = a[self.index]
        return a if self.rows is None else a[self.rows[0] : self.rows[1]]


def per_expert(tensors: Mapping[str, SafetensorsFile], n_experts: int) -> dict[str, Any]:
    """`tensors` with transformers 5's fused expert tensors replaced by per-expert views.

    Args:
        tensors: tensor name -> its file, as the folder holds them.
        n_experts: the experts per layer config.json gives (0: a dense model, nothing replaced).

    Returns:
        Tensor name -> its file or an `ExpertView`, named as ``save_pretrained`` names them.

    Raises:
        SafetensorsError: a fused tensor of the wrong rank or expert count, or a file with both
            layouts.
    """
    fused = [n for n in tensors if n_experts and _FUSED.match(n)]
    if not fused:
        return dict(tensors)
    if legacy := next((n for n in tensors if ".block_sparse_moe." in n), None):
        raise SafetensorsError(
            f"{tensors[legacy].path}: experts both per expert ({legacy!r}) and fused "
            f"({fused[0]!r}); a model folder holds one layout"
        )
    out: dict[str, Any] = {n: sf for n, sf in tensors.items() if n not in fused}
    for n in fused:
        m = _FUSED.match(n)
        assert m is not None
        sf, moe = tensors[n], f"model.layers.{m[1]}.block_sparse_moe."
        if m[2] == "gate.weight":
            out[moe + "gate.weight"] = ExpertView(sf, n, None, None)
            continue
        shape = sf.shape(n)
        if (
            len(shape) != 3
            or shape[0] != n_experts
            or (m[2].endswith("gate_up_proj") and shape[1] % 2)
        ):
            raise SafetensorsError(
                f"{sf.path}: tensor {n!r} has shape {list(shape)}; expected [{n_experts} experts "
                f"(config.json), {'2 x intermediate_size, hidden_size' if 'gate_up' in n else 'hidden_size, intermediate_size'}]"
            )  # fmt: skip
        for e in range(n_experts):
            w = f"{moe}experts.{e}.w"
            if m[2].endswith("down_proj"):
                out[w + "2.weight"] = ExpertView(sf, n, e, None)
                continue
            f = shape[1] // 2  # each expert's gate rows, then its up rows (chunk(2) of its output)
            out[w + "1.weight"] = ExpertView(sf, n, e, (0, f))
            out[w + "3.weight"] = ExpertView(sf, n, e, (f, 2 * f))
    return out


__all__ = ["ExpertView", "per_expert"]
