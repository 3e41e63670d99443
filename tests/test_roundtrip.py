"""Save on one mesh, restore on another: bit-exact, params and optax state, all dtypes."""

from __future__ import annotations

import jax
import pytest
from conftest import assert_tree_bitexact
from helpers import OPTIMIZERS, float_params, mesh_of, mixed_params, place, targets, trained_state

import ucp_jax as ucp
from ucp_jax._src.read_stats import last_read_stats

# (save mesh shape or None for one device, save style) -> (restore mesh shape, restore style)
PAIRS = [
    pytest.param((8,), "spread", (2, 4), "spread", id="8->2x4"),
    pytest.param((2, 4), "spread", (4, 2), "spread", id="2x4->4x2"),
    pytest.param((2, 4), "spread", (1, 8), "spread", id="2x4->1x8"),
    pytest.param((4, 2), "fsdp", (4, 2), "replicated", id="4x2fsdp->replicated"),
    pytest.param(None, "spread", (2, 2, 2), "spread", id="1dev->2x2x2"),
]


def _mesh(shape):
    return None if shape is None else mesh_of(shape)


@pytest.mark.parametrize(("src", "src_style", "dst", "dst_style"), PAIRS)
def test_params_all_dtypes(tmp_path, src, src_style, dst, dst_style):
    params = place(mixed_params(), _mesh(src), src_style)
    ucp.save(tmp_path / "ck", params, step=5)
    out, opt = ucp.restore(tmp_path / "ck", targets(params, mesh_of(dst), dst_style))
    assert opt is None
    assert_tree_bitexact(params, out)
    for leaf, tgt in zip(
        jax.tree.leaves(out), jax.tree.leaves(targets(params, mesh_of(dst), dst_style))
    ):
        assert leaf.sharding == tgt.sharding
    stats = last_read_stats()
    assert stats.bytes_read == stats.bytes_needed, stats  # read amplification 1.00
    assert ucp.open(tmp_path / "ck").step == 5


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("src", "src_style", "dst", "dst_style"), PAIRS)
def test_params_and_optax_state(tmp_path, opt_name, src, src_style, dst, dst_style):
    opt = OPTIMIZERS[opt_name]()
    params, state = trained_state(opt, float_params())
    params, state = place(params, _mesh(src), src_style), place(state, _mesh(src), src_style)
    ucp.save(tmp_path / "ck", params, state, step=2)
    mesh = mesh_of(dst)
    p2, s2 = ucp.restore(
        tmp_path / "ck", targets(params, mesh, dst_style), targets(state, mesh, dst_style)
    )
    assert_tree_bitexact(params, p2)
    assert_tree_bitexact(state, s2)
    # The moments are slots of their parameter's atom, stored once.
    ck = ucp.open(tmp_path / "ck")
    assert {"fp32", "exp_avg", "exp_avg_sq"} <= set(ck.atoms["dense.kernel"].slots)
    assert not any(name.startswith("opt_state.") and ".mu." in name for name in ck.atoms)

    # The next update from the restored state equals the one from the original (computed on
    # host copies, so that sharding-dependent reduction orders play no part).
    def update(p, s):
        p, s = jax.device_get(p), jax.device_get(s)
        return opt.update(jax.tree.map(lambda x: x * 0.5, p), s, p)[0]

    assert_tree_bitexact(update(params, state), update(p2, s2))


def test_async_save_roundtrip(tmp_path):
    params = place(mixed_params(), mesh_of((2, 4)))
    h = ucp.async_save(tmp_path / "a", params, step=1, extra={"note": "async"})
    h.wait()
    assert h.done()
    out, _ = ucp.restore(tmp_path / "a", targets(params, mesh_of((8,))))
    assert_tree_bitexact(params, out)
    assert ucp.open(tmp_path / "a").extra == {"note": "async"}


@pytest.mark.parametrize("how", ["end of script", "sys.exit"])
def test_async_save_never_waited_for_commits_before_exit(tmp_path, how):
    """A training script whose last line is an `async_save` it never waits for: the interpreter
    waits for that save before its thread pools shut down. It failed with "cannot schedule new
    futures after interpreter shutdown" (or "can't register atexit after shutdown") in 3 of 3
    runs, the checkpoint lost."""
    import subprocess
    import sys
    import textwrap

    import numpy as np
    from mp.runner import worker_env

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        import numpy as np
        import ucp_jax as ucp
        state = {{"w": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)}}
        ucp.async_save(sys.argv[1], state, step=7)
        {"sys.exit(0)" if how == "sys.exit" else ""}
    """)
    )
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "final")], env=worker_env(8),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "ucp_jax" not in out.stderr, out.stderr
    ck = ucp.open(tmp_path / "final")
    assert ck.step == 7
    np.testing.assert_array_equal(
        ck.read("w"), np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    )


@pytest.mark.parametrize("own_handler", [False, True])
def test_an_async_save_pending_at_sigterm_commits_then_the_process_dies(tmp_path, own_handler):
    """SIGTERM (a scheduler's preemption) with a background save in flight: Python's default
    ended the process at once, the save lost without a word. The save now finishes, then the
    process dies of SIGTERM as before (exit 143 for a shell). A handler of the program's own
    is left in place: it decides (here it exits at once, and the save is lost)."""
    import signal
    import subprocess
    import sys
    import textwrap

    import numpy as np
    from mp.runner import worker_env

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal, sys, time
        import numpy as np
        import ucp_jax as ucp
        from ucp_jax._src.format import commit
        if {own_handler}:
            signal.signal(signal.SIGTERM, lambda *a: os._exit(3))
        seal = commit.seal
        def slow(*a, **k):  # the save is still writing when SIGTERM comes
            time.sleep(1.0)
            return seal(*a, **k)
        commit.seal = slow
        state = {{"w": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)}}
        ucp.async_save(sys.argv[1], state, step=7)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("not reached")
    """)
    )
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "final")], env=worker_env(8),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "not reached" not in out.stdout
    if own_handler:
        assert out.returncode == 3 and ucp.list_checkpoints(tmp_path) == []
        return
    assert out.returncode == -signal.SIGTERM, out.stderr
    assert "SIGTERM: finishing a background save before the process ends" in out.stderr
    ck = ucp.open(tmp_path / "final")
    assert ck.step == 7
    np.testing.assert_array_equal(
        ck.read("w"), np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    )


@pytest.mark.parametrize("processes", [1, 2, "1-twice"])
def test_a_persist_in_flight_at_sigterm_is_written(tmp_path, processes):
    """SIGTERM to every process of a job (a scheduler's preemption) while a snapshot's persist and
    an async save are still writing.

    One process: both checkpoints are committed, whole, before it dies of SIGTERM as before
    (Python's default ended it at once, and only the in-memory snapshot was left, which a
    preempted node loses). A jax.distributed job: SIGTERM is JAX's preemption notifier's, and it
    stays so (ucp_jax's handler replaced it, and every process died instead of going on to the
    preemption sync point); the processes go on, return, and their exit hooks commit both.
    A second SIGTERM while the first is handled (schedulers repeat it) changes nothing: it ran
    the handler again inside the first one's wait and could end the process before the work.
    """
    twice = processes == "1-twice"
    processes = 1 if twice else processes
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np
    from mp.runner import free_port, worker_env

    worker = Path(__file__).parent / "mp" / "sigterm_worker.py"
    addr = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(processes), addr,
                               str(tmp_path), "1.5", "twice" if twice else "once"],
                              env=worker_env(8 // processes),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(processes)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert "SIGTERM" in out and "not reached" not in out, (out, err)
        if processes == 1:
            assert p.returncode == -signal.SIGTERM, err
            for what in ("a background save", "ucp.memory's snapshot and persist in flight"):
                assert err.count(f"SIGTERM: finishing {what} before the process ends") == 1, err
        else:
            assert p.returncode == 0, err
            assert "returning" in out and "SIGTERM: finishing" not in err, err
            assert "ucp_jax:" not in err, err
    full = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)
    for path in (tmp_path / "persist" / "step_2", tmp_path / "final"):
        ck = ucp.open(path)
        assert ck.step == 2
        np.testing.assert_array_equal(ck.read("x"), full)


def test_sigterm_work_that_does_not_finish_is_cut_off_after_the_grace(tmp_path):
    """Work at SIGTERM that never ends (here a persist stuck for 10 minutes) holds the process no
    longer than `UCP_SIGTERM_GRACE_S`: it then dies of SIGTERM, says what it did not finish, and
    nothing half-written is committed; the async save in flight beside it is finished."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from mp.runner import worker_env

    worker = Path(__file__).parent / "mp" / "sigterm_worker.py"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(worker), "0", "1", "-", str(tmp_path), "600"],
                         env=worker_env(8, UCP_SIGTERM_GRACE_S="2"), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    waited = time.monotonic() - t0
    assert out.returncode == -signal.SIGTERM, out.stderr
    assert "not reached" not in out.stdout
    assert (
        "SIGTERM: ucp.memory's snapshot and persist in flight not finished after "
        "UCP_SIGTERM_GRACE_S=2 s" in out.stderr
    ), out.stderr
    assert waited < 60, waited  # (the process start and jax's import included)
    assert ucp.list_checkpoints(tmp_path / "persist") == []
    assert ucp.open(tmp_path / "final").step == 2  # the save beside it was not held up


@pytest.mark.parametrize("end", ["return", "shutdown"])
def test_a_job_ending_without_waiting_commits_its_save_and_persist(tmp_path, end):
    """Two jax.distributed processes return right after an `async_save` and a snapshot that
    persists (or call `jax.distributed.shutdown()` then): both checkpoints are committed before
    the job's coordination ends (the exit hooks run while the coordination service is still up;
    a shutdown finishes them first), and no process reports an error."""
    from pathlib import Path

    import numpy as np
    from mp.runner import run_job

    worker = Path(__file__).parent / "mp" / "exit_worker.py"
    args = [str(tmp_path)] + ([end] if end == "shutdown" else [])
    outs = run_job(lambda i, addr: [str(worker), str(i), "2", addr, *args], 2, 300, 2)
    for out, err in outs:
        assert "returning" in out and "ucp_jax:" not in err, err
    full = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)
    for path in (tmp_path / "final", tmp_path / "persist" / "step_2"):
        ck = ucp.open(path)
        assert ck.step == 2
        np.testing.assert_array_equal(ck.read("x"), full)


def test_a_background_save_failing_at_exit_ends_the_process_with_status_1(tmp_path):
    """A script returning with an `async_save` in flight that then fails: its error is printed
    and the process exits 1 (it exited 0, so a scheduler counted a job whose last checkpoint was
    lost as a success)."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np\nimport ucp_jax as ucp\nfrom ucp_jax._src import save\n"
        "def failing(self, host):\n    raise OSError('the disk caught fire')\n"
        "save.SaveJob.write = failing\n"
        f"ucp.async_save({str(tmp_path / 'ck')!r}, {{'w': np.ones(3)}}, step=1)\n"
        "print('returning', flush=True)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert "returning" in run.stdout and "the disk caught fire" in run.stderr, run.stderr


@pytest.mark.parametrize(
    ("dst", "spec"),
    [
        ((8,), ("a", None)),
        ((8,), (None, "a")),
        ((2, 4), ("a", "b")),
        ((4, 2), ("b", "a")),
        ((1,), ()),
    ],
    ids=["rows/8", "cols/8", "2x4", "4x2-swapped", "replicated"],
)
def test_common_shardings_read_whole_chunks(tmp_path, dst, spec):
    """Chunks are chosen so that restores splitting axes by 1, 2, 4 or 8 read whole chunks."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    src = mesh_of((2, 4))
    w = np.arange(1024 * 2048, dtype=np.float32).reshape(1024, 2048)  # 8 MiB, 1 MiB inner chunks
    ucp.save(tmp_path / "ck", {"w": jax.device_put(w, NamedSharding(src, P(None, "b")))})
    mesh = mesh_of(dst)
    tgt = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh, P(*spec)))}
    out, _ = ucp.restore(tmp_path / "ck", tgt)
    assert_tree_bitexact({"w": w}, out)
    stats = last_read_stats()
    assert stats.amplification == 1.0
    assert stats.chunk_amplification == 1.0, stats
