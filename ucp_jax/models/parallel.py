"""Parallel layouts of model parameters: the mesh, its axes, and the nnx building blocks.

A `Layout` names the sizes of the mesh axes ('stage', 'data', 'fsdp', 'tensor'); the model families
of `ucp_jax.models` (and the demo GPT) build their parameters from `Kernel`, `Norm` and `Group` with
a partition spec per parameter, so that `module_shardings` / `module_abstract_params` give the
restore targets of any layout on any mesh.

>>> from ucp_jax.models.parallel import Layout
>>> Layout(data=2, tensor=2).name
'dp2-tp2'
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from .._src.errors import check_device_count

PyTree = Any
MESH_AXES = ("stage", "data", "fsdp", "tensor")

BATCH_AXES = ("data", "fsdp")

NEG_INF = -1e9


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout: sizes of the mesh axes ('stage', 'data', 'fsdp', 'tensor')."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stages: int = 1

    @property
    def size(self) -> int:
        """Number of devices the layout uses."""
        return self.stages * self.data * self.fsdp * self.tensor

    @property
    def name(self) -> str:
        """Short label of the axes larger than 1, e.g. ``pp2-dp2-tp2``, ``fsdp4-tp2``; ``dp1`` alone."""
        sizes = (("pp", self.stages), ("dp", self.data), ("fsdp", self.fsdp), ("tp", self.tensor))
        return "-".join(f"{k}{n}" for k, n in sizes if n > 1) or "dp1"

    def check(self, config: Any) -> None:
        """Raise ValueError if the layout cannot hold the model.

        Args:
            config: the model configuration (``n_heads``, ``n_kv_heads``, ``d_ff``, ``n_layers``,
                ``d_model``).
        """
        t, c = self.tensor, config
        for what, n in (("n_heads", c.n_heads), ("n_kv_heads", c.n_kv_heads), ("d_ff", c.d_ff)):
            if n % t:
                raise ValueError(f"layout {self.name}: tensor={t} does not divide {what}={n}")
        if c.n_layers % self.stages:
            raise ValueError(f"layout {self.name}: stages={self.stages} does not divide n_layers")
        if c.n_heads % c.n_kv_heads or c.d_model % c.n_heads:
            raise ValueError("n_kv_heads must divide n_heads, and n_heads must divide d_model")


def make_mesh(layout: Layout, devices: list[jax.Device] | None = None) -> Mesh:
    """Build the ('stage', 'data', 'fsdp', 'tensor') mesh of a layout over the first devices.

    Args:
        layout: the parallel layout.
        devices: devices to use (default: ``jax.devices()``); the first ``layout.size`` are taken.

    Returns:
        A mesh with Auto axis types.

    Raises:
        DeviceCountError: fewer devices than the layout's size.
    """
    devices = list(jax.devices() if devices is None else devices)
    check_device_count(f"layout {layout.name}", layout.size, devices)
    devices = devices[: layout.size]
    shape = (layout.stages, layout.data, layout.fsdp, layout.tensor)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 4, devices=devices)


def make_param(shape: tuple[int, ...], spec: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=spec, eager_sharding=False)


class Kernel(nnx.Module):
    def __init__(self, shape: tuple[int, ...], spec: tuple[str | None, ...]) -> None:
        self.kernel = make_param(shape, spec)


class Norm(nnx.Module):
    def __init__(
        self, shape: tuple[int, ...], spec: tuple[str | None, ...], bias: bool = False
    ) -> None:
        self.scale = make_param(shape, spec)
        if bias:  # LayerNorm's
            self.bias = make_param(shape, spec)


class Group(nnx.Module):
    def __init__(self, **children: Any) -> None:
        for k, v in children.items():
            setattr(self, k, v)


def constrain_batch(x: jax.Array) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, *(None,) * (x.ndim - 1)))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """torch.nn.LayerNorm: normalised over the last axis (biased variance), scaled and shifted."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


@functools.lru_cache(maxsize=64)
def module_graph(cls: type, config: Any, layout: Layout) -> tuple[nnx.GraphDef, nnx.State]:
    """(graph, abstract state) of the nnx model `cls(config, layout)`, built once per arguments.

    The demo GPT and the model families of `ucp_jax.models` share it and the two below.
    """
    return nnx.split(nnx.eval_shape(lambda: cls(config, layout)))


def module_shardings(cls: type, config: Any, layout: Layout, mesh: Mesh) -> PyTree:
    """The NamedSharding of every parameter of `cls(config, layout)` on `mesh`, as a nested dict."""
    return nnx.to_pure_dict(nnx.get_named_sharding(module_graph(cls, config, layout)[1], mesh))


def module_abstract_params(cls: type, config: Any, layout: Layout, mesh: Mesh) -> PyTree:
    """The params of `cls(config, layout)` as ShapeDtypeStructs with their shardings on `mesh`."""
    shapes = nnx.to_pure_dict(module_graph(cls, config, layout)[1])
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        module_shardings(cls, config, layout, mesh),
    )
