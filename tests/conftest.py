"""Test set-up: 8 forced CPU devices (set before jax starts), shared helpers."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax
import numpy as np
import pytest


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("CI"):
        # In CI every optional dependency must be there: a test skipped for a missing install
        # step would pass for the wrong reason.
        import importlib

        for mod in ("torch", "deepspeed", "safetensors", "nbclient", "matplotlib", "transformers"):
            try:
                importlib.import_module(mod)
            except ImportError as e:
                raise pytest.UsageError(
                    f"CI needs {mod!r} installed (make test does it): {e}"
                ) from e
    if jax.device_count() < 8:
        raise pytest.UsageError(
            f"tests need 8 devices, found {jax.device_count()}; run through `make test` or set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts"
        )


def assert_tree_bitexact(a: object, b: object) -> None:
    """Two pytrees have the same structure, shapes, dtypes and bytes."""
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb, f"tree structures differ:\n{ta}\n{tb}"
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        where = jax.tree_util.keystr(path)
        assert x.shape == y.shape, f"{where}: shape {x.shape} != {y.shape}"
        assert x.dtype == y.dtype, f"{where}: dtype {x.dtype} != {y.dtype}"
        assert x.tobytes() == y.tobytes(), f"{where}: values differ"
