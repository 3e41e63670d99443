"""One process of a job preempted with a snapshot's persist and an async save in flight: it sends
itself SIGTERM (a scheduler sends it to every process) while the persist of step 2 is writing.

Alone (no jax.distributed), SIGTERM is ucp_jax's: the work is finished, then the process dies of
SIGTERM. In a jax.distributed job it is JAX's preemption notifier's: the process goes on (to the
preemption sync point, as a JAX job does, where JAX's protocol gets there) and returns.

Usage: sigterm_worker.py PROCESS_ID PROCESSES COORDINATOR OUT PERSIST_SECONDS [twice]
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main() -> None:
    pid, n, addr, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    persist_s = float(sys.argv[5])
    if n > 1:
        jax.distributed.initialize(addr, num_processes=n, process_id=pid)
    from in_flight import start_snapshot_and_save

    from ucp_jax._src.memory import persist

    write = persist.write

    def slow(*a, **k):  # the persist is still writing when SIGTERM comes
        time.sleep(persist_s)
        return write(*a, **k)

    persist.write = slow
    mgr = start_snapshot_and_save(out, pid, "sigterm")  # noqa: F841  (open, as a trainer's)
    print(f"{pid} SIGTERM", flush=True)
    if len(sys.argv) > 6 and sys.argv[6] == "twice":  # a second one while the first is handled
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    os.kill(os.getpid(), signal.SIGTERM)
    if n > 1:  # the process goes on: training steps in lockstep, as a JAX job's are
        from jax.experimental import multihost_utils

        for step in range(3, 40):
            multihost_utils.sync_global_devices(f"step {step}")
            time.sleep(0.05)
            if multihost_utils.reached_preemption_sync_point(step):
                print(f"{pid} preemption sync point at step {step}", flush=True)
                break
        multihost_utils.sync_global_devices("end")
        print(f"{pid} returning", flush=True)
        return
    time.sleep(60)
    print(f"{pid} not reached", flush=True)


if __name__ == "__main__":
    main()
