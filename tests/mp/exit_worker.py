"""One process of a job that ends without waiting: an async save and a persisting snapshot in
flight when the script returns.

Usage: exit_worker.py PROCESS_ID PROCESSES COORDINATOR OUT [shutdown]: with `shutdown`, the
script's last line is `jax.distributed.shutdown()` (the save's last barriers need the job: they
failed after it, and the checkpoint was lost while the process exited 0).
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main() -> None:
    pid, n, addr, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    jax.distributed.initialize(addr, num_processes=n, process_id=pid)
    from in_flight import start_snapshot_and_save

    mgr = start_snapshot_and_save(out, pid, "exit")  # noqa: F841  (open, as a trainer's)
    if sys.argv[5:] == ["shutdown"]:
        jax.distributed.shutdown()
    print(f"{pid} returning", flush=True)


if __name__ == "__main__":
    main()
