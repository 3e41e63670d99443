"""ucp.memory.SnapshotManager in one process (8 CPU devices, the process is one node).

A tiny model trains with donated buffers and a snapshot every step; the snapshots restore bit for
bit onto the training mesh and onto smaller meshes; only the newest `keep` survive; a torn
snapshot (no COMMIT, or a COMMIT that does not match its index) is ignored; a new manager with the
same namespace reattaches; every `persist_every`-th snapshot is also a universal checkpoint, which
is the fallback once shared memory is gone.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import threading
import uuid
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tree_bitexact
from helpers import mesh_of, mixed_params, place, targets
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucp_jax as ucp
from ucp_jax._src.memory import shm
from ucp_jax.memory import SnapshotManager

OPT = optax.adamw(1e-2)
# a blob holds the copied pieces and padding: < 64 B per piece, < a page before each big one
PADDING = 64 * 40 + 3 * 4096


def _params(mesh):
    rng = np.random.default_rng(0)
    specs = {
        "kernel": ((16, 24), np.float32, P("a", "b")),
        "bias": ((24,), np.float32, P("b")),
        "emb": ((32, 8), jnp.bfloat16, P(None, "b")),
        "big": ((1024, 1024), np.float32, P()),  # 4 MiB replicated: split among its replicas
        "scale": ((), np.float32, P()),
    }
    out = {}
    for name, (shape, dtype, spec) in specs.items():
        ref = (rng.standard_normal(shape) * 0.5).astype(dtype)
        out[name] = jax.device_put(ref, NamedSharding(mesh, spec))
    return {"dense": {"kernel": out.pop("kernel"), "bias": out.pop("bias")}, **out}


def _loss(p, x):
    h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
    return (
        jnp.mean(h**2) * p["scale"]
        + jnp.mean(p["emb"].astype(jnp.float32) ** 2)
        + jnp.mean(p["big"][:4] ** 2)
    )


def _init(params):
    """adamw state: moments laid out like their params, the count replicated on the same mesh."""
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    adam, *rest = OPT.init(params)
    like = functools.partial(jax.tree.map, lambda z, p: jax.device_put(z, p.sharding))
    adam = adam._replace(
        count=jax.device_put(adam.count, NamedSharding(mesh, P())),
        mu=like(adam.mu, params),
        nu=like(adam.nu, params),
    )
    return (adam, *rest)


def _step_fn(params, opt_state):
    shardings = jax.tree.map(lambda a: a.sharding, (params, opt_state))

    def step(p, s, x):
        g = jax.grad(_loss)(p, x)
        u, s = OPT.update(g, s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(step, out_shardings=shardings, donate_argnums=(0, 1))


def _train(mgr, steps, mesh=None, start=None):
    """Train with donated buffers and a snapshot each step; the host copy of every step's state."""
    mesh = mesh or mesh_of((2, 4))
    params, opt_state = start[:2] if start else (_params(mesh), None)
    if opt_state is None:
        opt_state = _init(params)
    fn = _step_fn(params, opt_state)
    history = {}
    first = 1 if start is None else start[2]
    for step in range(first, first + steps):
        x = jnp.asarray(np.random.default_rng(step).standard_normal((8, 16)), jnp.float32)
        params, opt_state = fn(params, opt_state, x)
        if mgr is not None:
            mgr.snapshot(step, params, opt_state)
        history[step] = jax.device_get((params, opt_state))
    return params, opt_state, history


def _targets(params, opt_state, mesh, style="spread"):
    return targets(params, mesh, style), targets(opt_state, mesh, style)


@pytest.fixture(autouse=True, params=["cpu-buffers", "device-copies"])
def copy_path(request, monkeypatch):
    """Every test runs on both copy paths: straight from CPU buffers (what CPU devices use) and
    through device-side copies staged in pinned host memory (what accelerators use)."""
    accelerator_path = request.param == "device-copies"
    monkeypatch.setenv("UCP_SNAPSHOT_DEVICE_COPIES", "1" if accelerator_path else "0")
    monkeypatch.setenv("UCP_STAGING", "pinned_host" if accelerator_path else "auto")
    return request.param


@pytest.fixture
def shm_dir(tmp_path):
    return tmp_path / "shm"


def _mgr(tmp_path, shm_dir, **kw):
    kw.setdefault("namespace", "t")
    return SnapshotManager(tmp_path / "ckpt", shm_dir=shm_dir, **kw)


def test_snapshot_every_step_restores_bitexact(tmp_path, shm_dir):
    mgr = _mgr(tmp_path, shm_dir)
    params, opt_state, hist = _train(mgr, 5)
    mgr.wait()
    assert mgr.latest_step() == 5
    st = mgr.stats
    assert st.step == 5 and st.copied_bytes >= st.nbytes - PADDING and st.rolls == 0
    pt, ot = _targets(params, opt_state, mesh_of((2, 4)))
    p2, o2 = mgr.restore(pt, ot)
    assert mgr.restored.step == 5 and mgr.restored.source == "memory"
    assert_tree_bitexact(jax.device_get((p2, o2)), hist[5])
    assert jax.tree.map(lambda a: a.sharding, p2) == jax.tree.map(lambda t: t.sharding, pt)
    node = shm_dir / "ucp-t" / "0"
    assert sorted(n for n in os.listdir(node) if n.startswith("step_")) == ["step_4", "step_5"]
    mgr.close()


@pytest.mark.parametrize(("shape", "style"), [((4,), "spread"), ((2, 2), "fsdp"), ((1,), "spread")])
def test_restore_onto_a_smaller_mesh(tmp_path, shm_dir, shape, style):
    mgr = _mgr(tmp_path, shm_dir)
    params, opt_state, hist = _train(mgr, 3)
    mesh = mesh_of(shape)
    pt, ot = _targets(params, opt_state, mesh, style)
    p2, o2 = mgr.restore(pt, ot)
    assert_tree_bitexact(jax.device_get((p2, o2)), hist[3])
    for got, t in zip(jax.tree.leaves(p2), jax.tree.leaves(pt)):
        assert got.sharding == t.sharding
    params_only, none = mgr.restore(pt)
    assert none is None
    assert_tree_bitexact(jax.device_get(params_only), hist[3][0])
    mgr.close()


@pytest.mark.parametrize("keep", [1, 3])
def test_keeps_only_the_newest_k(tmp_path, shm_dir, keep):
    mgr = _mgr(tmp_path, shm_dir, keep=keep)
    _train(mgr, 5)
    mgr.wait()
    node = shm_dir / "ucp-t" / "0"
    steps = sorted(int(n[5:]) for n in os.listdir(node) if n.startswith("step_"))
    assert steps == list(range(6 - keep, 6))
    assert [e.step for e in shm.committed(node)] == steps[::-1]
    # retired blobs are reused, not piled up: at most one spare
    assert len(os.listdir(node / ".free")) <= 1
    mgr.close()
    assert not (node / ".free").exists() or not os.listdir(node / ".free")


@pytest.mark.parametrize("how", ["a second manager", "a cleaner"])
def test_a_spare_blob_removed_under_the_manager_is_not_reused(tmp_path, shm_dir, how):
    # the spare data file kept for the next snapshot (.free/) removed from outside: a second
    # manager of the namespace cleans .free when it starts, and so does a /dev/shm cleaner;
    # every later snapshot failed (renaming the vanished file), now each makes a new one
    mgr = _mgr(tmp_path, shm_dir, keep=1)
    params, opt_state, _ = _train(mgr, 3)
    mgr.wait()
    node = shm_dir / "ucp-t" / "0"
    assert os.listdir(node / ".free")
    if how == "a cleaner":
        for n in os.listdir(node / ".free"):
            os.remove(node / ".free" / n)
    else:
        _mgr(tmp_path, shm_dir, keep=1).close()
    _, _, hist = _train(mgr, 2, start=(params, opt_state, 4))
    mgr.wait()
    assert [e.step for e in shm.committed(node)] == [5]
    mesh = mesh_of((2, 4))
    got = mgr.restore(*_targets(params, opt_state, mesh))
    assert_tree_bitexact(jax.device_get(got), hist[5])
    mgr.close()


def test_every_n_steps(tmp_path, shm_dir):
    mgr = _mgr(tmp_path, shm_dir, every=2, keep=5)
    params, opt_state, _ = _train(None, 1)
    assert mgr.snapshot(1, params, opt_state) is False
    assert mgr.snapshot(2, params, opt_state) is True
    assert mgr.snapshot(3, params, opt_state) is False
    mgr.wait()
    assert [e.step for e in shm.committed(shm_dir / "ucp-t" / "0")] == [2]
    mgr.close()


@pytest.mark.parametrize("dies", ["copy_out", "xor_fill"])  # the copies; the background XORs
def test_torn_snapshots_are_ignored(tmp_path, shm_dir, monkeypatch, dies):
    mgr = _mgr(tmp_path, shm_dir, keep=3)
    params, opt_state, hist = _train(mgr, 3)
    mgr.wait()
    node = shm_dir / "ucp-t" / "0"
    # a snapshot killed before its COMMIT: the data is there, the marker is not
    shutil.copytree(node / "step_3", node / "step_9")
    (node / "step_9" / "COMMIT").unlink()
    # a COMMIT that does not belong to its index (index rewritten after the commit)
    shutil.copytree(node / "step_3", node / "step_8")
    idx = (node / "step_8" / "index.json").read_text().replace('"step": 3', '"step": 8')
    (node / "step_8" / "index.json").write_text(idx)
    assert [e.step for e in shm.committed(node)] == [3, 2, 1]
    assert mgr.latest_step() == 3

    # a snapshot whose background copy dies midway is never committed
    def boom(*a, **k):
        raise OSError("simulated crash while copying")

    monkeypatch.setattr(f"ucp_jax._src.memory.engine.{dies}", boom)
    mgr.snapshot(4, params, opt_state)
    with pytest.raises(RuntimeError, match="simulated crash"):
        mgr.wait()
    assert (node / "step_4").is_dir() and not (node / "step_4" / "COMMIT").exists()
    pt, ot = _targets(params, opt_state, mesh_of((8,)))
    p2, o2 = mgr.restore(pt, ot)
    assert mgr.restored.step == 3
    assert_tree_bitexact(jax.device_get((p2, o2)), hist[3])
    monkeypatch.undo()
    mgr.snapshot(4, params, opt_state)  # the next snapshot works and sweeps the torn folders
    mgr.wait()
    assert sorted(n for n in os.listdir(node) if n.startswith("step_")) == [
        "step_2",
        "step_3",
        "step_4",
    ]
    mgr.close()


def test_a_new_manager_reattaches(tmp_path, shm_dir):
    mgr = _mgr(tmp_path, shm_dir)
    params, opt_state, hist = _train(mgr, 4)
    mgr.close()  # keeps the snapshots
    again = _mgr(tmp_path, shm_dir)
    assert again.latest_step() == 4
    pt, ot = _targets(params, opt_state, mesh_of((2, 4)))
    p2, o2 = again.restore(pt, ot)
    assert_tree_bitexact(jax.device_get((p2, o2)), hist[4])
    # the new run goes on from step 4; its snapshots supersede the old run's
    _, _, hist2 = _train(again, 2, start=(p2, o2, 5))
    again.wait()
    node = shm_dir / "ucp-t" / "0"
    assert [e.step for e in shm.committed(node)] == [6, 5]
    assert len({e.run for e in shm.committed(node)}) == 1
    p3, o3 = again.restore(pt, ot)
    assert again.restored.step == 6
    assert_tree_bitexact(jax.device_get((p3, o3)), hist2[6])
    again.free()
    assert not node.exists()


def test_restored_arrays_survive_later_snapshots_and_free(tmp_path, shm_dir):
    """On CPU restored arrays may map the snapshot's pages: later snapshots reuse retired blobs
    in place, and free() deletes the files; neither may change a restored array."""
    mgr = _mgr(tmp_path, shm_dir, keep=1)
    params, opt_state, hist = _train(mgr, 2)
    mesh = mesh_of((2, 4))
    pt, ot = _targets(params, opt_state, mesh)
    p2, o2 = mgr.restore(pt, ot)
    p_rep, _ = mgr.restore(targets(params, mesh_of((2, 2)), "replicated"))
    _train(mgr, 3, start=(params, opt_state, 3))  # without the guard step 2's blob is reused
    mgr.wait()
    host = {"h": np.arange(4.0)}
    mgr.snapshot(6, host)
    h2, _ = mgr.restore({"h": np.zeros(4)})
    for step in (7, 8):
        mgr.snapshot(step, {"h": np.zeros(4)})
    mgr.free(all_nodes=True)
    assert not (shm_dir / "ucp-t").exists()
    assert_tree_bitexact(jax.device_get((p2, o2)), hist[2])
    assert_tree_bitexact(jax.device_get(p_rep), hist[2][0])
    assert h2["h"].tolist() == [0.0, 1.0, 2.0, 3.0]
    # donating a restored array never writes into the snapshot's pages
    p4, _ = (SnapshotManager(None, namespace="u", shm_dir=shm_dir), None)
    p4.snapshot(1, {"x": jax.device_put(np.ones(1 << 16, np.float32), jax.devices()[0])})
    x = p4.restore(
        {
            "x": jax.ShapeDtypeStruct(
                (1 << 16,), np.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
            )
        }
    )[0]["x"]
    y = jax.jit(lambda v: v * 2, donate_argnums=0)(x)
    again = p4.restore({"x": np.zeros(1 << 16, np.float32)})[0]["x"]
    assert float(y[0]) == 2.0 and again[0] == 1.0
    p4.free()


def test_persist_every_and_fallback(tmp_path, shm_dir, caplog):
    mgr = _mgr(tmp_path, shm_dir, persist_every=2)
    params, opt_state, hist = _train(mgr, 5)
    mgr.wait()
    ckpts = ucp.list_checkpoints(tmp_path / "ckpt")
    assert [os.path.basename(c) for c in ckpts] == ["step_2", "step_4"]
    mesh = mesh_of((4, 2))
    pt, ot = _targets(params, opt_state, mesh)
    p4, o4 = ucp.restore(tmp_path / "ckpt" / "step_4", pt, ot)
    assert_tree_bitexact(jax.device_get((p4, o4)), hist[4])
    assert ucp.open(tmp_path / "ckpt" / "step_4").step == 4
    mgr.close()
    shutil.rmtree(shm_dir / "ucp-t" / "0")  # the node's memory is gone
    again = _mgr(tmp_path, shm_dir, persist_every=2)
    assert again.latest_step() == 4
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        p5, o5 = again.restore(pt, ot)
    assert again.restored.source == "persisted" and again.restored.step == 4
    assert "falling back to the persisted universal checkpoint" in caplog.text
    assert_tree_bitexact(jax.device_get((p5, o5)), hist[4])
    again.close()


def test_mixed_dtypes_and_host_values(tmp_path, shm_dir):
    mesh = mesh_of((2, 4))
    tree = place(mixed_params(), mesh)
    tree["host"] = np.arange(6, dtype=np.int64).reshape(2, 3)  # a host value, not a jax.Array
    mgr = _mgr(tmp_path, shm_dir, persist_every=1)
    mgr.snapshot(1, tree)
    mgr.wait()
    tgt = targets({k: v for k, v in tree.items() if k != "host"}, mesh_of((2, 2)))
    tgt["host"] = np.zeros((2, 3), np.int64)
    got, none = mgr.restore(tgt)
    assert none is None
    assert_tree_bitexact(jax.device_get(got), jax.device_get(tree))
    mgr.close()


def test_default_shm_dir_and_free():
    ns = f"test-{uuid.uuid4().hex[:8]}"
    mgr = SnapshotManager(None, namespace=ns)
    _train(mgr, 2)
    mgr.wait()
    root = shm.namespace_root(ns)
    assert str(root) == f"/dev/shm/ucp-{ns}"
    assert (root / "0" / "step_2" / "COMMIT").exists()
    mgr.free(all_nodes=True)
    assert not root.exists()


def test_without_donation_safety_holds_references(tmp_path, shm_dir):
    mgr = _mgr(tmp_path, shm_dir, donation_safe=False)
    params = _params(mesh_of((2, 4)))
    opt_state = _init(params)
    mgr.snapshot(1, params, opt_state)
    mgr.wait()  # the caller waits before it donates
    p2, o2 = mgr.restore(*_targets(params, opt_state, mesh_of((8,))))
    assert_tree_bitexact(jax.device_get((p2, o2)), jax.device_get((params, opt_state)))
    mgr.close()


def test_errors(tmp_path, shm_dir):
    with pytest.raises(ValueError, match="redundancy"):
        SnapshotManager(None, redundancy="raid5", shm_dir=shm_dir)
    with pytest.raises(ValueError, match="persist_every needs"):
        SnapshotManager(None, persist_every=2, shm_dir=shm_dir)
    with pytest.raises(ValueError, match="namespace"):
        SnapshotManager(None, namespace="a/b", shm_dir=shm_dir)
    # a group of one node keeps no redundancy for it (xor with group_size=1 gave [[0], [1], ...])
    for redundancy, bad, least in (("xor", 1, 2), ("replica", 0, 2), ("rs2", 2, 3),
                                   ("xor", 2.5, 2), ("xor", True, 2), (None, 0, 1)):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(
                f"group_size={bad!r}: redundancy {redundancy!r} needs groups of at least {least} "
                "nodes, an integer")):  # fmt: skip
            SnapshotManager(None, redundancy=redundancy, group_size=bad, shm_dir=shm_dir)
    SnapshotManager(None, redundancy="xor", group_size=np.int64(3), shm_dir=shm_dir).close()
    mgr = _mgr(tmp_path, shm_dir)
    params, opt_state, _ = _train(None, 1)
    pt, ot = _targets(params, opt_state, mesh_of((8,)))
    with pytest.raises(ucp.NotACheckpointError, match="nothing to restore"):
        mgr.restore(pt, ot)
    mgr.snapshot(1, params, opt_state)
    bad = dict(pt)
    bad["emb"] = jax.ShapeDtypeStruct((16, 8), jnp.bfloat16, sharding=pt["emb"].sharding)
    with pytest.raises(ucp.MismatchError, match="'emb'"):
        mgr.restore(bad, ot)
    with pytest.raises(ucp.MismatchError, match="not in the snapshot"):
        mgr.restore({"other": pt["emb"]})
    mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.snapshot(2, params, opt_state)


def test_cpu_devices_copy_straight_from_their_buffers(tmp_path, shm_dir, copy_path, monkeypatch):
    """CPU devices: no device-side copies; with a donating step the copy into shared memory runs
    inside snapshot(). UCP_SNAPSHOT_DEVICE_COPIES=1 takes the accelerators' path. Either way the
    donating steps that follow never change a snapshot (checked bit for bit, step by step)."""
    from ucp_jax._src.memory import copies

    if copy_path == "cpu-buffers" and jax.default_backend() != "cpu":
        pytest.skip(
            f"copies straight from device buffers only on CPU devices, not {jax.default_backend()}"
        )
    calls = []
    device_copies = copies._copies

    def counting(*a, **k):
        calls.append(1)
        return device_copies(*a, **k)

    monkeypatch.setattr(copies, "_copies", counting)
    # which thread copies into shared memory (a timing comparison here flaked under load)
    fillers = []
    fill = SnapshotManager._fill

    def recording(self, *a, **k):
        fillers.append(threading.current_thread() is threading.main_thread())
        return fill(self, *a, **k)

    monkeypatch.setattr(SnapshotManager, "_fill", recording)
    mgr = _mgr(tmp_path, shm_dir, keep=3)
    _, _, hist = _train(mgr, 3)
    mgr.wait()
    assert (len(calls) == 0) == (copy_path == "cpu-buffers"), calls
    st = mgr.stats
    assert st.step == 3 and st.copied_bytes >= st.nbytes - PADDING
    # cpu-buffers: every copy ran inside snapshot(), on the training thread; else in background
    assert fillers == [copy_path == "cpu-buffers"] * 3
    for step in (1, 2, 3):  # written while later donating steps ran: still that step's bytes
        node = shm_dir / "ucp-t" / "0"
        for n in os.listdir(node):
            if n.startswith("step_") and n != f"step_{step}":
                os.rename(node / n, node / f".{n}")  # hide the others from the restore
        p2, o2 = mgr.restore(*_targets(*jax.tree.map(jnp.asarray, hist[step]), mesh_of((4, 2))))
        assert mgr.restored.step == step
        assert_tree_bitexact(jax.device_get((p2, o2)), hist[step])
        for n in os.listdir(node):
            if n.startswith(".step_"):
                os.rename(node / n, node / n[1:])
    mgr.close()


def test_a_persist_in_flight_at_exit_is_written(tmp_path):
    """A training script whose last snapshot persists, exiting without `close()`: the persist is
    written before the interpreter exits (it was dropped: the background thread could not start
    its save once thread pools refused new work, and nothing said so)."""
    import subprocess
    import sys
    import textwrap

    from mp.runner import worker_env

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        import jax
        from ucp_jax.memory import SnapshotManager
        mgr = SnapshotManager(sys.argv[1], persist_every=5, shm_dir=sys.argv[2], namespace="atexit")
        for step in range(1, 6):
            mgr.snapshot(step, {"w": jax.numpy.full((512, 512), float(step))})
    """)
    )
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ck"), str(tmp_path / "shm")],
                         env=worker_env(8), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "ucp_jax:" not in out.stderr, out.stderr
    assert [os.path.basename(p) for p in ucp.list_checkpoints(tmp_path / "ck")] == ["step_5"]
    ck = ucp.open(tmp_path / "ck" / "step_5")
    np.testing.assert_array_equal(ck.read("w"), np.full((512, 512), 5.0, np.float32))


def _damage(data_bin, at=None):
    """Flip one bit of a committed snapshot's bytes in place (its COMMIT and index stay valid)."""
    with open(data_bin, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        at = size // 2 if at is None else at
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x10]))


@pytest.mark.parametrize("where", ["middle", "first", "last"])
def test_damaged_snapshot_bytes_are_never_restored(tmp_path, shm_dir, caplog, where):
    # Shared memory outlives the trainer: a bit flipped in a committed snapshot's data must not
    # come back as a value. The damaged step is passed over for the older one kept (one node, no
    # redundancy); with every kept step damaged, the persisted checkpoint is restored.
    mgr = _mgr(tmp_path, shm_dir, persist_every=2)
    params, opt_state, hist = _train(mgr, 5)
    mgr.wait()
    mgr.close()
    node = shm_dir / "ucp-t" / "0"
    size = os.path.getsize(node / "step_5" / shm.DATA)
    _damage(node / "step_5" / shm.DATA, {"middle": None, "first": 0, "last": size - 1}[where])
    pt, ot = _targets(params, opt_state, mesh_of((4, 2)))
    again = _mgr(tmp_path, shm_dir, persist_every=2)
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        p, o = again.restore(pt, ot)
    assert (again.restored.step, again.restored.source) == (4, "memory")
    assert "step 5: node(s) [0] fail their CRC-32 check (node 0: " in caplog.text
    assert_tree_bitexact(jax.device_get((p, o)), hist[4])
    again.close()
    _damage(node / "step_4" / shm.DATA)
    caplog.clear()
    third = _mgr(tmp_path, shm_dir, persist_every=2)
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        p, o = third.restore(pt, ot)
    assert (third.restored.step, third.restored.source) == (4, "persisted")
    assert "node(s) [0] damaged in shared memory" in third.restored.reason
    assert_tree_bitexact(jax.device_get((p, o)), hist[4])
    third.close()


@pytest.mark.parametrize("damage", ["truncated", "no_index", "index_edited"])
def test_a_committed_snapshot_with_missing_files_is_named(tmp_path, shm_dir, caplog, damage):
    # A committed snapshot whose data.bin shrank or whose index.json is gone or edited was
    # damaged after it committed (a torn one has no COMMIT): the step is passed over for the
    # older one kept, and the log names the folder and what is wrong with it.
    mgr = _mgr(tmp_path, shm_dir)
    params, opt_state, hist = _train(mgr, 3)
    mgr.wait()
    mgr.close()
    folder = shm_dir / "ucp-t" / "0" / "step_3"
    if damage == "truncated":
        size = os.path.getsize(folder / shm.DATA)
        os.truncate(folder / shm.DATA, size - 4096)
        what = f"its data.bin holds {size - 4096} bytes, its index.json says {size}"
    elif damage == "no_index":
        os.unlink(folder / shm.INDEX)
        what = "its index.json cannot be read (No such file or directory)"
    else:
        raw = (folder / shm.INDEX).read_bytes()
        (folder / shm.INDEX).write_bytes(raw.replace(b'"step": 3', b'"step": 9'))
        what = "its index.json does not match the CRC-32 in COMMIT"
    pt, ot = _targets(params, opt_state, mesh_of((2, 4)))
    again = _mgr(tmp_path, shm_dir)
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        p, o = again.restore(pt, ot)
    assert (again.restored.step, again.restored.source) == (2, "memory")
    assert f"in-memory snapshot {folder}: committed, but {what}" in caplog.text
    assert_tree_bitexact(jax.device_get((p, o)), hist[2])
    again.close()


def test_the_commit_records_the_crc_of_the_blob(tmp_path, shm_dir):
    mgr = _mgr(tmp_path, shm_dir)
    _train(mgr, 2)
    mgr.wait()
    for step in (1, 2):
        entry = shm.read_entry(shm_dir / "ucp-t" / "0" / f"step_{step}")
        raw = (entry.path / shm.DATA).read_bytes()
        assert entry.crc32 == zlib.crc32(raw)  # (the blobs are reused: each CRC is its step's)
    mgr.close()


def test_a_snapshot_damaged_before_its_persist_is_not_persisted(tmp_path, shm_dir, monkeypatch,
                                                                caplog):  # fmt: skip
    # A persisted checkpoint seals what it writes with fresh crc32c: damaged snapshot bytes
    # written there would pass every later check. The persist checks the commit's CRC-32 first
    # and skips that step (on every process alike: training goes on), logged as an error; the
    # next persist is written from fresh bytes.
    commit = shm.Writer.commit

    def commit_then_damage(self):
        entry = commit(self)
        if entry.step == 2:
            self.blob.array[self.blob.nbytes // 2] ^= 0x40  # after the commit: a stray write
        return entry

    monkeypatch.setattr(shm.Writer, "commit", commit_then_damage)
    mgr = _mgr(tmp_path, shm_dir, persist_every=1)
    params, opt_state, _ = _train(mgr, 1)
    mgr.wait()
    with caplog.at_level(logging.ERROR, logger="ucp_jax"):
        params, opt_state, hist = _train(mgr, 2, start=(params, opt_state, 2))
        mgr.wait()
    assert "step 2 not persisted (on any process)" in caplog.text and "has CRC-32" in caplog.text
    names = [os.path.basename(c) for c in ucp.list_checkpoints(tmp_path / "ckpt")]
    assert names == ["step_1", "step_3"]
    assert not [n for n in os.listdir(tmp_path / "ckpt") if "step_2" in n]  # no staging left
    pt, ot = _targets(params, opt_state, mesh_of((2, 4)))
    p3, o3 = ucp.restore(tmp_path / "ckpt" / "step_3", pt, ot)
    assert_tree_bitexact(jax.device_get((p3, o3)), hist[3])
    mgr.close()
