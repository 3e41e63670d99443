"""Mixture of experts for the Llama-family model: a Mixtral-style sparse MLP and its expert layout.

A sparse layer replaces the SwiGLU MLP with a router (``router.kernel [d, E]``) and ``E`` SwiGLU
experts; each token goes to its ``top_k`` experts (softmax over the router logits, top-k, weights
renormalised to sum to one, as transformers' Mixtral computes). The experts are stored stacked
``[*layers, E, ...]`` and sharded over the ``expert`` mesh axis of an :class:`MoELayout`; inside an
expert, ``gate_up`` is fused per tensor-parallel shard like the dense MLP's.

Canonical atoms: ``blocks.{i}.router.kernel`` and ``blocks.{i}.experts.{e}.gate_up.kernel`` /
``...down.kernel``, one per expert, so an expert-parallel change is a re-slicing of the expert axis.

>>> MoELayout(expert=4, data=2).name
'dp2-ep4'
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from .._src.errors import check_device_count
from .._src.mapping.patterns import Fused, Stacked
from .llama_config import LlamaConfig
from .parallel import Group, Kernel, Layout
from .parallel import make_mesh as dense_mesh
from .placement import fuse_tp, unfuse_tp

MOE_MESH_AXES = ("stage", "data", "expert", "fsdp", "tensor")
EXPERT_PARAMS = ("experts.gate_up.kernel", "experts.down.kernel")


@dataclasses.dataclass(frozen=True)
class MoELayout(Layout):
    """A parallel layout with an ``expert`` axis: mesh ('stage', 'data', 'expert', 'fsdp', 'tensor').

    The experts of every sparse layer are sharded over ``expert``; everything else is replicated
    over it (the batch is sharded over ``data`` and ``fsdp`` only).
    """

    expert: int = 1

    @property
    def size(self) -> int:
        """Number of devices the layout uses."""
        return self.stages * self.data * self.expert * self.fsdp * self.tensor

    @property
    def name(self) -> str:
        """Short label, e.g. ``pp2-ep2-tp2``; ``dp1`` alone."""
        base = super().name
        parts = [] if base == "dp1" else base.split("-")
        if self.expert > 1:
            at = sum(p.startswith(("pp", "dp", "fsdp")) for p in parts)
            parts.insert(at, f"ep{self.expert}")
        return "-".join(parts) or "dp1"


def expert_degree(layout: Layout) -> int:
    """The size of the layout's ``expert`` axis (1 for a dense :class:`Layout`)."""
    return int(getattr(layout, "expert", 1))


def make_mesh(layout: Layout, devices: list[jax.Device] | None = None) -> Mesh:
    """The mesh of a layout: the demo's 4 axes, plus ``expert`` for an :class:`MoELayout`.

    Args:
        layout: the parallel layout.
        devices: devices to use (default: ``jax.devices()``); the first ``layout.size`` are taken.

    Returns:
        A mesh with Auto axis types.

    Raises:
        DeviceCountError: fewer devices than the layout's size.

    >>> make_mesh(MoELayout(expert=2)).axis_names
    ('stage', 'data', 'expert', 'fsdp', 'tensor')
    """
    if not isinstance(layout, MoELayout):
        return dense_mesh(layout, devices)
    devices = list(jax.devices() if devices is None else devices)
    check_device_count(f"layout {layout.name}", layout.size, devices)
    devices = devices[: layout.size]
    shape = (layout.stages, layout.data, layout.expert, layout.fsdp, layout.tensor)
    return jax.make_mesh(shape, MOE_MESH_AXES, axis_types=(AxisType.Auto,) * 5, devices=devices)


def check_experts(config: LlamaConfig, layout: Layout) -> None:
    """Raise ValueError if the layout's expert axis cannot hold the model's experts.

    Args:
        config: the model configuration.
        layout: the parallel layout.

    Raises:
        ValueError: an expert axis for a dense model, or one that does not divide ``n_experts``,
            or ``top_k`` out of ``1..n_experts``.
    """
    ep = expert_degree(layout)
    if not config.n_experts:
        if ep > 1:
            raise ValueError(f"layout {layout.name}: expert={ep} but the model has no experts")
        return
    if config.n_experts % ep:
        raise ValueError(
            f"layout {layout.name}: expert={ep} does not divide n_experts={config.n_experts}"
        )
    if not 1 <= config.top_k <= config.n_experts:
        raise ValueError(f"top_k={config.top_k} must be in 1..n_experts={config.n_experts}")


def sparse_params(
    config: LlamaConfig,
    layout: Layout,
    lead: tuple[int, ...],
    ls: tuple[str | None, ...],
    fs: str | None,
    tp: str | None,
) -> dict[str, Any]:
    """The per-layer sparse MLP modules: ``router`` and ``experts`` (stacked ``[*lead, E, ...]``)."""
    c, e = config, config.n_experts
    ep = "expert" if expert_degree(layout) > 1 else None
    return {
        "router": Kernel((*lead, c.d_model, e), (*ls, fs, None)),
        "experts": Group(
            gate_up=Kernel((*lead, e, c.d_model, 2 * c.d_ff), (*ls, ep, fs, tp)),
            down=Kernel((*lead, e, c.d_ff, c.d_model), (*ls, ep, tp, fs)),
        ),
    }


def sparse_mlp(h: jax.Array, p: dict, c: LlamaConfig, t: int) -> tuple[jax.Array, jax.Array]:
    """The sparse MLP on normed ``h [b, s, d]``: output and router statistics ``[2, E]``.

    Every expert runs on every token and the outputs are summed with the routing weights (zero
    outside a token's top-k), which equals transformers' gather/scatter to float32 rounding.
    The statistics are the top-k counts and the summed router probabilities of the layer.
    """
    b, s, _ = h.shape
    e, f = c.n_experts, c.d_ff
    probs = jax.nn.softmax((h @ p["router"]["kernel"]).astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, c.top_k)
    top_w = top_w / top_w.sum(axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(top_i, e, dtype=probs.dtype)  # [b, s, k, E]
    weights = jnp.einsum("bske,bsk->bse", chosen, top_w)
    gu = jnp.einsum("bsd,edf->bsef", h, p["experts"]["gate_up"]["kernel"])
    gu = gu.reshape(b, s, e, t, 2, f // t)  # one [gate_r | up_r] group per TP shard r
    gate, up = gu[..., 0, :].reshape(b, s, e, f), gu[..., 1, :].reshape(b, s, e, f)
    out = jnp.einsum("bsef,efd->bsed", jax.nn.silu(gate) * up, p["experts"]["down"]["kernel"])
    stats = jnp.stack([chosen.sum(axis=(0, 1, 2)), probs.sum(axis=(0, 1))])
    return jnp.einsum("bsed,bse->bsd", out, weights), stats


def load_balancing_loss(stats: jax.Array, n_experts: int, tokens: int) -> jax.Array:
    """transformers' Mixtral ``load_balancing_loss_func`` from per-layer statistics ``[L, 2, E]``.

    Args:
        stats: top-k counts and summed router probabilities of each layer.
        n_experts: ``E``.
        tokens: tokens per layer (``batch * seq``).

    Returns:
        ``E * sum_e(fraction routed to e * mean probability of e)`` over all layers' tokens.

    >>> float(load_balancing_loss(jnp.asarray([[[1.0, 0.0], [0.5, 0.5]]]), 2, 1))  # balanced: 1
    1.0
    """
    rows = stats.shape[0] * tokens
    per_expert = stats.sum(axis=0) / rows
    return n_experts * jnp.sum(per_expert[0] * per_expert[1])


def init_experts(
    config: LlamaConfig, i: int, normal: Any, out: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Add layer ``i``'s canonical router and expert weights to ``out`` (``normal(*shape)``)."""
    c = config
    out[f"blocks.{i}.router.kernel"] = normal(c.d_model, c.n_experts)
    for e in range(c.n_experts):
        out[f"blocks.{i}.experts.{e}.gate_up.kernel"] = normal(c.d_model, 2 * c.d_ff)
        out[f"blocks.{i}.experts.{e}.down.kernel"] = normal(c.d_ff, c.d_model)
    return out


def stack_experts(
    canonical: dict[str, np.ndarray], config: LlamaConfig, name: str, i: int, t: int
) -> np.ndarray:
    """Layer ``i``'s experts of ``name`` (``experts.gate_up.kernel`` ...) as ``[E, ...]`` for TP ``t``."""
    rest = name.removeprefix("experts.")
    per = [canonical[f"blocks.{i}.experts.{e}.{rest}"] for e in range(config.n_experts)]
    if rest == "gate_up.kernel":
        per = [fuse_tp(a, (config.d_ff,) * 2, t) for a in per]
    return np.stack(per)


def unstack_experts(
    a: np.ndarray, config: LlamaConfig, name: str, i: int, t: int
) -> dict[str, np.ndarray]:
    """The inverse of :func:`stack_experts`: ``[E, ...]`` -> canonical atoms by name."""
    rest = name.removeprefix("experts.")
    out = {}
    for e in range(config.n_experts):
        x = unfuse_tp(a[e], (config.d_ff,) * 2, t) if rest == "gate_up.kernel" else a[e]
        out[f"blocks.{i}.experts.{e}.{rest}"] = x
    return out


def expert_rules(config: LlamaConfig, layout: Layout) -> list[tuple[str, Any]]:
    """The ``ucp`` rules of the stacked experts: one atom per layer and expert.

    Stacked over the layer axes (``{i}``) outside Stacked over the expert axis (``{e}``), and
    Fused ``[gate | up]`` per tensor-parallel shard inside each expert's ``gate_up``.

    Args:
        config: the model configuration.
        layout: the parallel layout (sets the layer stacking axes).

    Returns:
        ``(regex, pattern chain)`` pairs; they go before the dense ``layers\\.(.*)`` rule.

    >>> [r for r, _ in expert_rules(LlamaConfig(n_experts=4), Layout())]
    ['layers\\\\.experts\\\\.(gate_up\\\\.kernel)', 'layers\\\\.experts\\\\.(.*)']
    """
    layers = Stacked(r"blocks.{i}.experts.\1", axes=(0, 1) if layout.stages > 1 else 0)
    experts = Stacked(r"blocks.{i}.experts.{e}.\1", axes=0, index="e")
    fused = Fused((config.d_ff,) * 2, axis=1, shard_axis="tensor")
    return [
        (r"layers\.experts\.(gate_up\.kernel)", (fused, experts, layers)),
        (r"layers\.experts\.(.*)", (experts, layers)),
    ]
