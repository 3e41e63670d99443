"""`ucp.save` and `ucp.async_save`: a `SaveJob` run now, or in the background with one in flight."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .mapping.rules import Rule
from .save import SaveJob
from .save_handle import SaveHandle, finish_pending, start


def save(
    path: Any,
    params: Any,
    opt_state: Any = None,
    *,
    step: int | None = None,
    rules: Sequence[Rule] = (),
    extra: Any = None,
    overwrite: bool = False,
    max_inflight_bytes: int | None = None,
) -> None:
    """Save params (and optax state) as a universal checkpoint; returns once committed.

    Every process writes only the shards it owns, each distinct shard once, streaming device to
    storage with at most `max_inflight_bytes` of host copies in flight.

    Args:
        path: local directory or TensorStore kvstore URL (file://, gs://, s3://, memory://).
        params: pytree of jax.Array (any sharding), numpy arrays or scalars.
        opt_state: optax state for these params, or None.
        step: training step recorded in the manifest.
        rules: (regex, pattern) pairs mapping leaves to atoms; see "Patterns and rules" in
            docs/reconfigure.md.
        extra: JSON-serialisable user data stored in the manifest.
        overwrite: replace an existing checkpoint at `path`.
        max_inflight_bytes: bound on host memory held by copies waiting to be written
            (default: `UCP_INFLIGHT_BYTES`, 1 GiB).

    Raises:
        FileExistsError: `path` holds a checkpoint and overwrite is False.
        PatternError: a rule matches nothing or cannot map its leaf.

    >>> ucp.save("/tmp/ckpt/step_10", params, opt_state, step=10)  # doctest: +SKIP
    """
    finish_pending(then=f"the save to {path}")
    job = SaveJob(path, params, opt_state, step=step, rules=rules, extra=extra,
                   overwrite=overwrite, max_inflight_bytes=max_inflight_bytes)  # fmt: skip
    job.write(None)


def async_save(
    path: Any,
    params: Any,
    opt_state: Any = None,
    *,
    step: int | None = None,
    rules: Sequence[Rule] = (),
    extra: Any = None,
    overwrite: bool = False,
) -> SaveHandle:
    """Start a save; returns once this process's shards are copied to host memory.

    Training may go on (and donate its buffers) as soon as this returns; the write and commit run
    in the background. One save is in flight at a time: a new save first waits for the previous
    one, and an error of a background save is raised by its `wait()` or by the next save call.
    A save still running when the script ends is finished before the interpreter exits (an
    uncaught exception included; not a SIGKILL or an unhandled SIGTERM, which end the process at
    once: the checkpoint is then absent, never partial).

    Args:
        path: local directory or TensorStore kvstore URL, as for `save`.
        params: pytree of jax.Array (any sharding), numpy arrays or scalars.
        opt_state: optax state for these params, or None.
        step: training step recorded in the manifest.
        rules: (regex, pattern) pairs mapping leaves to atoms, as for `save`.
        extra: JSON-serialisable user data stored in the manifest.
        overwrite: replace an existing checkpoint at `path`.

    Returns:
        A SaveHandle; `.wait()` returns once the checkpoint is committed.

    >>> h = ucp.async_save("/tmp/ckpt/step_10", params, opt_state, step=10)  # doctest: +SKIP
    >>> h.wait()  # doctest: +SKIP
    """
    finish_pending(then=f"the save to {path}")
    job = SaveJob(path, params, opt_state, step=step, rules=rules, extra=extra,
                   overwrite=overwrite)  # fmt: skip
    return start(job, job.copy_all_to_host())
