"""A flaky object store: a fault-injecting proxy (`faultproxy.py`) between TensorStore's client and
the S3 server process (moto, as in test_object_stores.py).

Transient faults (connections reset mid-upload, answers cut off mid-download, 500 and 503
answers, stalls) are retried with backoff, within `UCP_STORE_RETRIES`: saves and restores give
bit-exact values. An outage (every request failing) makes a save fail with a `StoreError` within
the retry bound, and no COMMIT is left; a restore fails the same way and never returns partial
data. The faults injected are counted and printed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

boto3 = pytest.importorskip("boto3", reason="moto[server] is not installed")
from conftest import assert_tree_bitexact  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from helpers import mesh_of, place, targets  # noqa: E402
from test_object_stores import BUCKET, s3  # noqa: E402, F401 - the moto server fixture

import ucp_jax as ucp  # noqa: E402


def _tree(k: float) -> dict:
    rng = np.random.default_rng(int(k))
    return {
        "w": rng.standard_normal((256, 256), dtype=np.float32),  # sharded files, byte ranges
        "b": rng.standard_normal((64,), dtype=np.float32),
        "s": np.float32(k),
    }


def _spec(endpoint: str, path: str, **retries: str) -> dict:
    spec = {"driver": "s3", "bucket": BUCKET, "path": path, "endpoint": endpoint}
    if retries:  # a faster backoff than the default policy, to keep the test short
        spec["s3_request_retries"] = {"max_retries": 8, **retries}
    return spec


FAST = {"initial_delay": "0.05s", "max_delay": "0.4s"}


@pytest.fixture
def proxy(s3: str) -> Iterator[FaultProxy]:  # noqa: F811
    with FaultProxy(s3, seed=28) as p:
        yield p


def _objects(endpoint: str, prefix: str) -> list[str]:
    out = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for o in out.get("Contents", [])]


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
def test_transient_faults_are_retried(s3, proxy, monkeypatch, layout) -> None:  # noqa: F811
    monkeypatch.setenv("UCP_LAYOUT", layout)
    proxy.rate, proxy.stall_s = 0.25, 0.5
    path = f"flaky/{layout}/step_1"
    ref = _tree(1)
    save = ucp.save if layout == "aggregated" else (lambda *a, **k: ucp.async_save(*a, **k).wait())
    save(_spec(proxy.endpoint, path, **FAST), place(ref, mesh_of((2,))), step=1)
    out, _ = ucp.restore(_spec(proxy.endpoint, path, **FAST), targets(ref, mesh_of((4,))))
    assert_tree_bitexact(ref, out)
    out, _ = ucp.restore(_spec(s3, path), targets(ref, mesh_of((4,))))  # what landed, directly
    assert_tree_bitexact(ref, out)
    print(f"\nflaky store, {layout}: {dict(proxy.counts)}")
    assert sum(v for k, v in proxy.counts.items() if k != "forwarded") >= 10


def test_an_outage_fails_the_save_without_a_commit(s3, proxy, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setenv("UCP_STORE_RETRIES", "3")
    monkeypatch.setenv("UCP_STORE_TIMEOUT_S", "4")  # backoff 0.5 s, 1 s, 1 s
    ucp.save(_spec(proxy.endpoint, "outage/step_1"), _tree(1), step=1)
    for kind in ("http503", "reset_upload"):
        proxy.up()
        original = proxy._fault
        seen = {"n": 0}

        def fail_midway(original=original, seen=seen, kind=kind):  # type: ignore[no-untyped-def]
            seen["n"] += 1
            if seen["n"] > 6:  # the save is under way: then the store goes down
                proxy.down(kind)
            return original()

        proxy._fault = fail_midway  # type: ignore[method-assign]
        t0 = time.monotonic()
        with pytest.raises(ucp.StoreError) as e:
            ucp.save(_spec(proxy.endpoint, f"outage/{kind}"), _tree(2), step=2)
        took = time.monotonic() - t0
        proxy._fault = original  # type: ignore[method-assign]
        assert "s3://" in str(e.value) and took < 60, (took, e.value)
        keys = _objects(s3, f"outage/{kind}/")
        assert not any(k.endswith("/COMMIT") for k in keys), keys  # nothing that reads as done
        assert ucp.list_checkpoints(_spec(s3, "outage")) != []
        assert [str(c) for c in ucp.list_checkpoints(_spec(s3, "outage"))] == [
            f"s3://{BUCKET}/outage/step_1"
        ]
        print(f"\noutage ({kind}) mid-save: {type(e.value).__name__} after {took:.1f} s")
    proxy.down("reset_download")
    with pytest.raises(ucp.StoreError):  # a restore in an outage: an error, never partial data
        ucp.restore(_spec(proxy.endpoint, "outage/step_1"), _tree(1))
    proxy.up()
    out, _ = ucp.restore(_spec(proxy.endpoint, "outage/step_1"), _tree(1))  # the store is back
    assert_tree_bitexact(_tree(1), out)


def test_a_store_without_conditional_writes(s3, caplog) -> None:  # noqa: F811
    """An S3 store that answers If-None-Match / If-Match with 501 (AWS before 2024): TensorStore
    cannot create arrays there, so a save is refused before it writes, saying why; a checkpoint
    written there (through a store that has them) is read and deleted (the deletion's claim
    unconditional, with a warning)."""
    trees = {k: _tree(k) for k in (1, 2)}
    for k in (1, 2):
        ucp.save(_spec(s3, f"nocond/step_{k}"), trees[k], step=k)
    with FaultProxy(s3, no_conditional=True) as p:
        for save in (ucp.save, lambda *a, **k: ucp.async_save(*a, **k).wait()):
            with pytest.raises((ucp.StoreError, RuntimeError), match="conditional writes") as e:
                save(_spec(p.endpoint, "nocond/step_3"), trees[1], step=3)
            assert "AWS S3 since 2024" in str(e.value) + str(e.value.__cause__)
        assert not _objects(s3, "nocond/step_3/")  # nothing written
        listed = [str(c) for c in ucp.list_checkpoints(_spec(p.endpoint, "nocond"))]
        assert listed == [f"s3://{BUCKET}/nocond/step_{k}" for k in (1, 2)]
        out, _ = ucp.restore(_spec(p.endpoint, "nocond/step_1"), trees[1])
        assert_tree_bitexact(trees[1], out)
        with caplog.at_level(logging.WARNING, logger="ucp_jax"):
            ucp.delete_checkpoint(_spec(p.endpoint, "nocond/step_2"))
        assert "written unconditionally" in caplog.text
        assert p.counts["not_implemented"] >= 3
    assert [str(c) for c in ucp.list_checkpoints(_spec(s3, "nocond"))] == [
        f"s3://{BUCKET}/nocond/step_1"
    ]
    keys = _objects(s3, "nocond/")
    assert not any(k.startswith("nocond/step_2/") for k in keys)
    assert not any(k.endswith(".ucp-writer") for k in keys), keys  # claims given back
