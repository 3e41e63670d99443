"""Shared by the fixtures that run real frameworks (DeepSpeed, Megatron-Core) under `torchrun`.

`torchrun` runs one of their training scripts on N local ranks, as torchrun does (gloo, CPU; the
ranks forked by forkrun.py after the framework's imports; retried once: gloo on a loaded 2-core
host occasionally aborts a rank), and `built_once` builds a fixture's checkpoints once per cache
key under pytest's cache directory, process-safe, so later runs reuse them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator

from mp.runner import free_port

FORKRUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forkrun.py")


def torchrun(
    script: str, nproc: int, args: list[str], cwd: str, *, timeout: int = 600,
    pythonpath: str | None = None,
) -> None:  # fmt: skip
    """Run `script` on `nproc` local ranks, as under torchrun; raise with its output on failure.

    The ranks are forked from one process that imported torch and the framework first
    (tests/forkrun.py: the same script and environment as torchrun gives them, at a third of
    the CPU on these 2-core machines). `pythonpath`: a folder put ahead of the venv's packages
    (another framework version).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("XLA_FLAGS", None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    first = ""
    for _ in range(2):
        cmd = [sys.executable, FORKRUN, f"--nproc={nproc}", f"--port={free_port()}", script,
               *args]  # fmt: skip
        code, out, err = _run_in_own_session(cmd, cwd, env, timeout)
        if code == 0:
            return
        if code is None:  # not retried: a second wait as long
            raise RuntimeError(
                f"{' '.join(cmd)} took over {timeout} s:\n{out[-3000:]}\n{err[-6000:]}"
            )
        first = first or err[-4000:]
    raise RuntimeError(
        f"{' '.join(cmd)} failed ({code}):\n{out[-3000:]}\n{err[-6000:]}"
        f"\n--- first attempt ---\n{first}"
    )


def _run_in_own_session(
    cmd: list[str], cwd: str, env: dict[str, str], timeout: float
) -> tuple[int | None, str, str]:
    """Run `cmd` in a session of its own, its output to files (a process the ranks started and
    left behind would hold a pipe open), then kill what is left of the session.

    Returns (exit status, None past `timeout`; stdout; stderr).
    """
    with tempfile.TemporaryDirectory(prefix="ucp-ranks-") as tmp:  # their temporary files too
        env = dict(env, TMPDIR=tmp)
        with (
            open(os.path.join(tmp, "out"), "w+") as out,
            open(os.path.join(tmp, "err"), "w+") as err,
        ):
            p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err,
                                 start_new_session=True)  # fmt: skip
            try:
                code = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            out.seek(0)
            err.seek(0)
            return code, out.read(), err.read()


def source_key(files: Iterable[str], versions: str) -> str:
    """A cache key: the sha256 of `files`' bytes and a `versions` text, 16 hex digits."""
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            h.update(fh.read())
    h.update(versions.encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def locked(path: str) -> Iterator[None]:
    """An exclusive lock on the file `path`, across processes."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def built_once(cache_dir: str, key: str, build: Callable[[str], dict]) -> tuple[str, dict]:
    """The folder `cache_dir/key` and its results, made by `build(folder)` on first use.

    Folders of other keys are removed first; `build` writes into a temporary folder that is
    renamed into place with its results (DONE.json) only once it succeeded.
    """
    final = os.path.join(cache_dir, key)
    os.makedirs(cache_dir, exist_ok=True)
    with locked(os.path.join(cache_dir, ".lock")):
        done = os.path.join(final, "DONE.json")
        if not os.path.isfile(done):
            for old in os.listdir(cache_dir):
                if old != ".lock":
                    shutil.rmtree(os.path.join(cache_dir, old), ignore_errors=True)
            tmp = final + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            results = build(tmp)
            with open(os.path.join(tmp, "DONE.json"), "w") as f:
                json.dump(results, f)
            os.rename(tmp, final)
        with open(done) as f:
            return final, json.load(f)
