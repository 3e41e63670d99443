"""Shared by the fixtures that run real frameworks (DeepSpeed, Megatron-Core) under `torchrun`.

`torchrun` runs one of their training scripts (gloo, CPU, retried once: gloo on a loaded 2-core
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
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator

from mp.runner import free_port


def torchrun(
    script: str, nproc: int, args: list[str], cwd: str, *, timeout: int = 600,
    pythonpath: str | None = None,
) -> None:  # fmt: skip
    """Run `script` under torchrun with `nproc` ranks; raise with its output on failure.

    `pythonpath`: a folder put ahead of the venv's packages (another framework version).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("XLA_FLAGS", None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    first = ""
    for _ in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", script, *args]  # fmt: skip
        # torchrun leaves a torchelastic_* folder in the temp folder at every run: give it one
        # of its own, removed after
        with tempfile.TemporaryDirectory(prefix="ucp-torchrun-") as tmp:
            env["TMPDIR"] = tmp
            p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=timeout)  # fmt: skip
        if p.returncode == 0:
            return
        first = first or p.stderr[-4000:]
    raise RuntimeError(
        f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        f"\n--- first attempt ---\n{first}"
    )


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
