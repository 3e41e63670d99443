"""Training the Llama model on a mesh: synthetic batches, loss, a jitted sharded train step.

The optimizer pieces are the demo's (:func:`ucp_jax.demo.make_optimizer`, ``init_opt_state``,
``abstract_opt_state``): they work on any params tree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .llama import abstract_params, model_from_params, param_shardings
from .llama_config import LlamaConfig
from .parallel import BATCH_AXES, Layout
from .placement import abstract_opt_state, put_sharded

PyTree = Any
TrainStep = Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, PyTree, jax.Array]]


def batch(
    config: LlamaConfig, step: int, batch_size: int, seq_len: int, mesh: Mesh, seed: int = 0
) -> jax.Array:
    """Deterministic random tokens ``[batch_size, seq_len + 1]`` for a step, batch-sharded.

    Args:
        config: the model configuration (its vocabulary).
        step: the training step.
        batch_size: rows; a multiple of ``data * fsdp``.
        seq_len: input length (the batch holds one more token: the last target).
        mesh: the layout's mesh.
        seed: data seed.

    Returns:
        int32 tokens sharded over ('data', 'fsdp') on the batch axis.
    """
    rng = np.random.default_rng([seed, 2, step])
    tokens = rng.integers(0, config.vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32)
    return put_sharded(tokens, NamedSharding(mesh, P(BATCH_AXES, None)))


def loss_fn(params: PyTree, tokens: jax.Array, config: LlamaConfig, layout: Layout) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens [b, s + 1]`` (plus the weighted aux loss if sparse).

    Args:
        params: nested dict of arrays in ``layout``'s parameter layout.
        tokens: int32 tokens; inputs are ``[:, :-1]``, targets ``[:, 1:]``.
        config: the model configuration.
        layout: the parallel layout of ``params``.

    Returns:
        The scalar float32 loss.
    """
    logits, aux = model_from_params(params, config, layout).forward(tokens[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss + config.router_aux_loss_coef * aux if config.n_experts else loss


def make_train_step(
    config: LlamaConfig, layout: Layout, mesh: Mesh, optimizer: optax.GradientTransformation
) -> TrainStep:
    """A jitted ``train_step(params, opt_state, tokens) -> (params, opt_state, loss)`` for a layout.

    Args:
        config: the model configuration.
        layout: the parallel layout.
        mesh: the layout's mesh.
        optimizer: the optax transformation.

    Returns:
        The jitted step; the outputs keep the layout's shardings.
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

    return jax.jit(train_step, out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())))


def make_logits_fn(config: LlamaConfig, layout: Layout, mesh: Mesh) -> Callable[..., jax.Array]:
    """A jitted ``logits(params, tokens) -> [b, s, vocab_size]`` (padding columns dropped).

    Args:
        config: the model configuration.
        layout: the parallel layout of the params.
        mesh: the layout's mesh.

    Returns:
        The jitted function.
    """

    def logits(params: PyTree, tokens: jax.Array) -> jax.Array:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            out = model_from_params(params, config, layout)(tokens)
        return out[..., : config.vocab_size]

    return jax.jit(logits)
