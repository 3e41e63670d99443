"""The train state of `save_restore.py`: a transformer-like parameter tree of a given size with
`optax.adam` state, sharded Megatron-style over a (2, 4) ('data', 'model') mesh, the reshard
target on a (4, 2) mesh with other specs, and the bit-exact check of a restored state.

Import it after `harness.force_cpu_devices()`: it imports jax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the transformer-like parameter tree."""

    d_model: int
    d_ff: int
    vocab: int
    layers: int

    @property
    def param_bytes(self) -> int:
        """float32 bytes of all parameters."""
        per_layer = 4 * self.d_model**2 + 2 * self.d_model * self.d_ff + 2 * self.d_model
        return 4 * (per_layer * self.layers + self.vocab * self.d_model + self.d_model)


def model_shape(gib: float) -> ModelShape:
    """The smallest layer count whose train state (params x 3) holds at least `gib` GiB."""
    d = 1024 if gib >= 0.5 else 512
    base = ModelShape(d_model=d, d_ff=4 * d, vocab=8 * d, layers=0)
    per_layer = ModelShape(d, 4 * d, 0, 1).param_bytes - 4 * d
    want = gib * 2**30 / 3 - base.param_bytes
    return ModelShape(d, 4 * d, 8 * d, max(1, math.ceil(want / per_layer)))


# Megatron-style: column-parallel in, row-parallel out, vocab-parallel embedding, norms replicated.
# The reshard target uses a (4, 2) mesh over the devices in reverse order with 2-D (FSDP x TP) specs.
SPECS: dict[str, tuple[P, P]] = {
    "embed": (P("model", None), P(None, "model")),
    "column": (P(None, "model"), P("data", "model")),
    "row": (P("model", None), P("model", "data")),
    "norm": (P(), P("model")),
}
_KINDS = {"wq": "column", "wk": "column", "wv": "column", "wo": "row", "w1": "column", "w2": "row"}


def param_layout(m: ModelShape) -> dict[str, Any]:
    """Nested dict of (shape, spec kind) for every parameter."""
    d, f = m.d_model, m.d_ff
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, f), "w2": (f, d)}
    tree: dict[str, Any] = {"embed": ((m.vocab, d), "embed")}
    for i in range(m.layers):
        tree[f"layer_{i}"] = {
            "attn": {k: (shapes[k], _KINDS[k]) for k in ("wq", "wk", "wv", "wo")},
            "mlp": {k: (shapes[k], _KINDS[k]) for k in ("w1", "w2")},
            "norm1": ((d,), "norm"),
            "norm2": ((d,), "norm"),
        }
    tree["final_norm"] = ((d,), "norm")
    return tree


def _is_spec(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


def meshes() -> tuple[Mesh, Mesh]:
    """The save mesh (2, 4) and the reshard mesh (4, 2), both ('data', 'model')."""
    devs = np.array(jax.devices()[:8])
    return Mesh(devs.reshape(2, 4), ("data", "model")), Mesh(
        devs[::-1].reshape(4, 2), ("data", "model")
    )


def shardings(layout: dict[str, Any], mesh: Mesh, which: int) -> dict[str, Any]:
    """NamedShardings of the params on `mesh`, spec set `which` (0: save layout, 1: reshard)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, SPECS[s[1]][which]), layout, is_leaf=_is_spec)


def build_state(m: ModelShape, mesh: Mesh, seed: int = 0) -> tuple[Any, Any]:
    """Random params and an `optax.adam` state with random mu/nu (as after some steps).

    Values come from numpy's generator (fast on a small CPU) and are placed with the params'
    Megatron shardings; mu/nu mirror them, `count` is replicated. Returns (params, opt_state).
    """
    layout = param_layout(m)
    p_sh = shardings(layout, mesh, 0)
    shapes = jax.tree.map(lambda s: s[0], layout, is_leaf=_is_spec)
    rng = np.random.default_rng(seed)

    def rand(scale: float, positive: bool = False) -> Any:
        def one(shape: tuple[int, ...], sh: NamedSharding) -> jax.Array:
            x = rng.standard_normal(shape, dtype=np.float32)
            x *= np.float32(scale)
            return jax.device_put(np.abs(x) if positive else x, sh)

        return jax.tree.map(one, shapes, p_sh, is_leaf=lambda x: isinstance(x, tuple))

    params = rand(0.02)
    tx = optax.adam(1e-3)
    adam, *rest = jax.eval_shape(tx.init, params)
    count = jax.device_put(np.asarray(7, np.int32), NamedSharding(mesh, P()))
    opt_state = (adam._replace(count=count, mu=rand(1e-3), nu=rand(1e-6, positive=True)), *rest)
    jax.block_until_ready((params, opt_state))
    return params, opt_state


def targets_for(
    params: Any, opt_state: Any, layout: dict[str, Any], mesh: Mesh, which: int
) -> tuple[Any, Any]:
    """Abstract (ShapeDtypeStruct with sharding) params and opt_state for a restore."""
    p_sh = shardings(layout, mesh, which)
    p_tgt = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, p_sh
    )
    rep = NamedSharding(mesh, P())

    def opt_leaf(x: jax.Array) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)

    # adam state: (ScaleByAdamState(count, mu, nu), EmptyState()); mu and nu mirror params.
    adam = opt_state[0]
    o_tgt = (
        adam._replace(count=opt_leaf(adam.count), mu=p_tgt, nu=p_tgt),
        *opt_state[1:],
    )
    return p_tgt, o_tgt


def tree_bytes(tree: Any) -> int:
    """Logical (global, replicas counted once) bytes of all leaves."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def tgt_tree(tgt: tuple[Any, Any]) -> dict[str, Any]:
    """The restore target in the {'params', 'opt_state'} layout used for both tools."""
    return {"params": tgt[0], "opt_state": tgt[1]}


def check_equal(restored: Any, expected_host: Any, target: Any, what: str) -> None:
    """Raise unless every restored leaf is bit-identical and laid out as the target asks."""
    r_leaves = jax.tree.leaves(restored)
    e_leaves = jax.tree.leaves(expected_host)
    t_leaves = jax.tree.leaves(target)
    if not (len(r_leaves) == len(e_leaves) == len(t_leaves)):
        raise AssertionError(f"{what}: {len(r_leaves)} leaves restored, {len(e_leaves)} expected")
    for r, e, t in zip(r_leaves, e_leaves, t_leaves):
        if not r.sharding.is_equivalent_to(t.sharding, len(t.shape)):
            raise AssertionError(f"{what}: sharding {r.sharding} != target {t.sharding}")
        got = np.asarray(r)
        if got.dtype != e.dtype or got.shape != e.shape:
            raise AssertionError(f"{what}: {got.dtype}{got.shape} != {e.dtype}{e.shape}")
        if got.tobytes() != np.ascontiguousarray(e).tobytes():
            raise AssertionError(f"{what}: restored bytes differ from the original")


def spec_json(which: int) -> dict[str, str]:
    """The PartitionSpec of each parameter kind in layout `which`, as text."""
    return {kind: str(specs[which]) for kind, specs in SPECS.items()}
