"""Subprocess runners for the multi-process tests: a jax.distributed job on localhost, and a
trainer SIGKILLed when it prints a marker. Failures show every process's output."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(devices: int, **extra: str) -> dict[str, str]:
    """The environment of a worker: `devices` CPU devices, a short barrier timeout, the repo."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["UCP_BARRIER_TIMEOUT_S"] = "120"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def run_job(
    argv_of: Callable[[int, str], Sequence[str]], n: int, timeout: float, devices: int = 4
) -> list[tuple[str, str]]:
    """Run `n` worker processes of one jax.distributed job to completion.

    Args:
        argv_of: (process id, coordinator address) -> the worker's argv after the interpreter.
        n: number of processes.
        timeout: seconds each may take.
        devices: CPU devices per process.

    Returns:
        (stdout, stderr) per process; the test fails with all outputs if any exits non-zero.
    """
    addr = f"127.0.0.1:{free_port()}"
    env = worker_env(devices)
    procs = [
        subprocess.Popen(
            [sys.executable, *argv_of(i, addr)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    outs: list[tuple[str, str]] = []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                outs.append(p.communicate())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        text = "\n".join(
            f"--- process {i} (exit {p.returncode}) stdout:\n{o}\n--- stderr:\n{e[-6000:]}"
            for i, (p, (o, e)) in enumerate(zip(procs, outs))
        )
        pytest.fail(f"multi-process job failed:\n{text}")
    return outs


def run_and_kill(
    argv: Sequence[str],
    log: Path,
    timeout: float,
    expect_before: Sequence[str],
    marker: str = "KILL ME",
    **env: str,
) -> None:
    """Start a trainer and SIGKILL it when it prints `marker`.

    The test fails, with the trainer's output, if it never prints the marker, or if the lines it
    printed before differ from `expect_before`.
    """
    full_env = worker_env(8, **env)
    line: str | None = None
    with open(log, "w") as err:
        p = subprocess.Popen(
            [sys.executable, *argv], env=full_env, stdout=subprocess.PIPE, stderr=err, text=True
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert p.stdout is not None
            for out in p.stdout:
                lines.put(out.strip())
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        seen: list[str] = []
        try:
            while True:
                try:
                    line = lines.get(timeout=timeout)
                except queue.Empty:
                    line = None
                if line == marker:
                    os.kill(p.pid, signal.SIGKILL)
                    break
                if line is None:
                    break
                seen.append(line)
        finally:
            if p.poll() is None and line != marker:
                p.kill()
            p.wait(timeout=30)
    if line != marker:
        pytest.fail(
            f"trainer never reached the kill point (exit {p.returncode}); stdout: {seen}\n"
            f"stderr:\n{log.read_text()[-6000:]}"
        )
    assert seen == list(expect_before), seen
    assert p.returncode == -signal.SIGKILL, p.returncode
