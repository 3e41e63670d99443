"""Run a torch.distributed training script on N local ranks, as `torchrun --nproc_per_node N` does,
with the ranks forked from one process that has imported the heavy modules first.

    python forkrun.py --nproc 4 --port 29500 SCRIPT [ARGS...]

Why: on the suite's 2-core machines a rank spends most of a short job importing torch and the
framework (Megatron-Core: ~10 s of CPU per rank, 60% of a 2-rank job; torchrun's own agent imports
torch once more). Forked ranks share those imports. What a rank runs is unchanged: the script as
`__main__` with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, GROUP_RANK), gloo initialised by the script itself after the fork.
Before forking it runs the script's top level (not as `__main__`: its imports and shims; the
script's work must be under `if __name__ == "__main__"`, as in any torchrun script) and
imports the modules named in the script's `FORK_PRELOAD` (those its functions import). Nothing
that starts threads may be imported before the fork (checked: it refuses to fork then). Like
torchrun, a failing rank fails the run: the others are stopped, and the exit status is 1; a
rank dies with this process. Run it in a session of its own and kill that session after (as
fixture_cache.torchrun does): a rank killed early leaves the processes it started behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import runpy
import signal
import sys
import threading
import time
import traceback


def _rank(script: str, args: list[str], rank: int, nproc: int) -> int:
    with contextlib.suppress(OSError, AttributeError):  # die with the launcher (a timeout kills it)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))  # fmt: skip
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    # the script's top level first (its imports, and shims that must precede the framework's),
    # not as __main__; then the modules it imports later, in its functions
    sys.path.insert(0, os.path.dirname(os.path.abspath(a.script)))
    top = runpy.run_path(a.script, run_name="__forkrun_preload__")
    del sys.path[0]
    for name in top.get("FORK_PRELOAD", ()):
        importlib.import_module(name)
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]  # Linux
    if threads or len(tasks) > 1:
        sys.exit(f"forkrun: the preloaded modules started threads ({threads}): cannot fork")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(a.nproc):
        pid = os.fork()
        if pid == 0:  # the rank exits as a torchrun rank does: its exit handlers run (they
            # stop the helper processes it started, e.g. Megatron's checkpoint workers)
            sys.exit(_rank(a.script, a.args, rank, a.nproc))
        pids[pid] = rank
    failed = None
    while pids:
        pid, status = os.wait()
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failed is None:
            failed = (rank, code)
            print(f"forkrun: rank {rank} exited with {code}; stopping the others", file=sys.stderr)
            for other in pids:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline:
                done, _ = os.waitpid(-1, os.WNOHANG)
                if done:
                    pids.pop(done, None)
                else:
                    time.sleep(0.1)
            for other in pids:
                os.kill(other, signal.SIGKILL)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
