"""Host <-> device through pinned host memory (`UCP_STAGING`): the accelerator path, run on CPU.

On an accelerator, restores place each array through the devices' `pinned_host` memory and
snapshots copy device regions into it (one DMA each way); `UCP_STAGING=pinned_host` takes that
path on CPU devices too, so it is exercised here. Results must be bit-exact and land in device
memory, within the staging budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp
from ucp_jax._src.placement import Placer, staging_memory

pytestmark = pytest.mark.skipif(
    "pinned_host" not in {m.kind for m in jax.devices()[0].addressable_memories()},
    reason="this backend has no pinned_host memory kind",
)


def _state(mesh, dtype):
    k = jax.random.key(3)
    params = {
        "w": jax.device_put(
            jax.random.normal(k, (16, 32), dtype), NamedSharding(mesh, P("a", "b"))
        ),
        "b": jax.device_put(jnp.arange(32, dtype=dtype), NamedSharding(mesh, P("b"))),
    }
    return params


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("budget", [1 << 30, 64])  # 64 bytes: every transfer waited for in turn
def test_restore_staged_through_pinned_host(tmp_path, monkeypatch, dtype, budget):
    mesh = mesh_of((2, 4), ("a", "b"))
    params = _state(mesh, dtype)
    ucp.save(tmp_path / "c", params)
    other = mesh_of((4, 2), ("a", "b"))
    tgt = {
        "w": jax.ShapeDtypeStruct((16, 32), dtype, sharding=NamedSharding(other, P("b", "a"))),
        "b": jax.ShapeDtypeStruct((32,), dtype, sharding=NamedSharding(other, P("a"))),
    }
    monkeypatch.setenv("UCP_STAGING", "pinned_host")
    got, _ = ucp.restore(tmp_path / "c", tgt, max_inflight_bytes=budget)
    stats = ucp.last_read_stats()
    assert stats.bytes_staged == sum(
        s.data.nbytes for x in jax.tree.leaves(got) for s in x.addressable_shards
    )
    for k in params:
        assert got[k].sharding.memory_kind == "device"
        assert got[k].sharding.spec == tgt[k].sharding.spec
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(params[k]))
    monkeypatch.setenv("UCP_STAGING", "none")
    ucp.restore(tmp_path / "c", tgt)
    assert ucp.last_read_stats().bytes_staged == 0


def test_host_memory_targets_are_not_staged(tmp_path, monkeypatch):
    mesh = mesh_of((2, 4), ("a", "b"))
    params = _state(mesh, jnp.float32)
    ucp.save(tmp_path / "c", params)
    monkeypatch.setenv("UCP_STAGING", "pinned_host")
    sh = NamedSharding(mesh, P("b", "a"), memory_kind="pinned_host")
    got, _ = ucp.restore(tmp_path / "c", {"w": jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=sh),
                                          "b": jax.ShapeDtypeStruct((32,), jnp.float32, sharding=NamedSharding(mesh, P(), memory_kind="pinned_host"))})  # fmt: skip
    assert got["w"].sharding.memory_kind == "pinned_host"
    assert ucp.last_read_stats().bytes_staged == 0
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(params["w"]))


def test_staging_choice():
    cpu = SingleDeviceSharding(jax.devices()[0])
    assert staging_memory(cpu, "auto") is (
        None if jax.devices()[0].platform == "cpu" else "pinned_host"
    )
    assert staging_memory(cpu, "pinned_host") == "pinned_host"
    assert staging_memory(cpu, "none") is None
    assert (
        staging_memory(
            SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"), "pinned_host"
        )
        is None
    )


def test_placer_holds_at_most_its_budget():
    """The placer waits for the oldest transfers once more than its budget is staged."""
    placer = Placer(budget=4 * 1024, mode="pinned_host")
    dev = SingleDeviceSharding(jax.devices()[0])
    outs = [
        placer.place((256,), dev, lambda index, i=i: np.full(256, i, np.float32), np.float32)
        for i in range(10)
    ]
    assert placer._held <= 4 * 1024 + 1024  # one array over at most
    placer.finish()
    assert placer._held == 0 and placer.staged_bytes == 10 * 1024
    assert [float(o[0]) for o in outs] == list(range(10))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("how", ["sync", "async", "sync-64-bytes"])
def test_save_copies_through_pinned_host(tmp_path, monkeypatch, dtype, how):
    """UCP_STAGING=pinned_host: a save's device-to-host copies go to pinned host memory (one DMA
    per shard, as on an accelerator) and write the same checkpoint as the pageable path (none),
    read back bit-exact, sync and async, and with a budget that waits on each."""
    from ucp_jax._src import save as save_mod

    mesh = mesh_of((2, 4), ("a", "b"))
    params = _state(mesh, dtype)
    params["w2"] = jax.device_put(params["w"] * 2, NamedSharding(mesh, P(None, ("a", "b"))))
    staged: list[str | None] = []
    real = save_mod.jax.device_put

    def spy(x, s=None, *a, **k):
        if isinstance(s, SingleDeviceSharding):
            staged.append(s.memory_kind)
        return real(x, s, *a, **k)

    monkeypatch.setattr(save_mod.jax, "device_put", spy)
    kw = {"max_inflight_bytes": 64} if how.endswith("64-bytes") else {}
    for mode in ("pinned_host", "none"):
        monkeypatch.setenv("UCP_STAGING", mode)
        staged.clear()
        if how == "async":
            ucp.async_save(tmp_path / mode, params, step=1).wait()
        else:
            ucp.save(tmp_path / mode, params, step=1, **kw)
        # replicas are written once: one staged copy per distinct shard (8 devices: w 8, b 4,
        # w2 8; one GPU: one each)
        unique = sum(
            len({tuple((i.start, i.stop) for i in sh.index) for sh in x.addressable_shards})
            for x in jax.tree.leaves(params)
        )
        if jax.device_count() >= 8:
            assert unique == 20
        assert staged == (["pinned_host"] * unique if mode == "pinned_host" else []), staged
    for name in params:
        a, b = (np.asarray(ucp.open(tmp_path / m).read(name)) for m in ("pinned_host", "none"))
        assert a.tobytes() == b.tobytes() == np.asarray(params[name]).tobytes(), name
