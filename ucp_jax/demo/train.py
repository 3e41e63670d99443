"""Training pieces of the demo GPT: optimizer, sharded optimizer state, synthetic data, train step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..models.parallel import BATCH_AXES, Layout
from ..models.placement import abstract_opt_state, put_sharded
from .model import GPTConfig, abstract_params, model_from_params, param_shardings

PyTree = Any


def _decay_mask(params: PyTree) -> PyTree:
    return jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key in ("kernel", "embedding"), params
    )


def make_optimizer(
    learning_rate: float = 3e-3, weight_decay: float = 0.1, clip_norm: float = 1.0
) -> optax.GradientTransformation:
    """AdamW with global-norm gradient clipping; no weight decay on the norm scales.

    Args:
        learning_rate: constant learning rate.
        weight_decay: decoupled weight decay of kernels and the embedding.
        clip_norm: maximum global gradient norm.

    Returns:
        The optax transformation.
    """
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=_decay_mask),
    )


def init_opt_state(optimizer: optax.GradientTransformation, params: PyTree) -> PyTree:
    """``optimizer.init(params)`` with the moments sharded like the params.

    Args:
        optimizer: the optax transformation.
        params: the sharded params.

    Returns:
        The optax state on the params' mesh.
    """
    target = abstract_opt_state(optimizer, params)
    shardings = jax.tree.map(lambda s: s.sharding, target)
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def batch(config: GPTConfig, step: int, batch_size: int, mesh: Mesh) -> jax.Array:
    """Deterministic synthetic tokens ``[batch_size, seq_len + 1]`` for a step, batch-sharded.

    Each row is an arithmetic progression ``(start + stride * j) mod vocab_size`` with a random start
    and stride in 1..8, so the model can learn to continue it from context. It depends only on
    ``(config.seed, step)``.

    Args:
        config: the model configuration.
        step: the training step.
        batch_size: rows; a multiple of ``data * fsdp``.
        mesh: the layout's mesh.

    Returns:
        int32 tokens sharded over ('data', 'fsdp') on the batch axis.
    """
    rng = np.random.default_rng([config.seed, 1, step])
    start = rng.integers(0, config.vocab_size, size=(batch_size, 1))
    stride = rng.integers(1, 9, size=(batch_size, 1))
    tokens = ((start + stride * np.arange(config.seq_len + 1)) % config.vocab_size).astype(np.int32)
    return put_sharded(tokens, NamedSharding(mesh, P(BATCH_AXES, None)))


def loss_fn(params: PyTree, tokens: jax.Array, config: GPTConfig, layout: Layout) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens [b, seq_len + 1]``.

    Args:
        params: nested dict of arrays in ``layout``'s parameter layout.
        tokens: int32 tokens; inputs are ``[:, :-1]``, targets ``[:, 1:]``.
        config: the model configuration.
        layout: the parallel layout of ``params``.

    Returns:
        The scalar float32 loss.
    """
    model = model_from_params(params, config, layout)
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


TrainStep = Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, PyTree, jax.Array]]


def make_train_step(
    config: GPTConfig,
    layout: Layout,
    mesh: Mesh,
    optimizer: optax.GradientTransformation,
    *,
    donate: bool = False,
) -> TrainStep:
    """A jitted ``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` for a layout.

    The outputs keep the layout's shardings, so the state can be saved and stepped again.

    Args:
        config: the model configuration.
        layout: the parallel layout.
        mesh: the layout's mesh.
        optimizer: the optax transformation.
        donate: donate the input params and optimizer state buffers.

    Returns:
        The jitted step function; ``loss`` is the loss of the params before the update.
    """
    p_sh = param_shardings(config, layout, mesh)
    o_sh = jax.tree.map(
        lambda s: s.sharding, abstract_opt_state(optimizer, abstract_params(config, layout, mesh))
    )

    def train_step(params: PyTree, opt_state: PyTree, tokens: jax.Array) -> Any:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, config, layout)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(
        train_step,
        out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())),
        donate_argnums=(0, 1) if donate else (),
    )
