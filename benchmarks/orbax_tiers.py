"""What Orbax offers for the in-memory benchmark's job (`benchmarks/snapshot.py`), same state.

* `local`: an `orbax.checkpoint.CheckpointManager` saving asynchronously every step into a folder
  in shared memory (`/dev/shm`), which is what the emergency manager's local tier does on each
  host; recovery: a fresh manager (as a restarted job) restores the latest step onto the
  training shardings.
* `emergency`: `orbax.checkpoint.experimental.emergency.checkpoint_manager.CheckpointManager`
  with its local tier in shared memory every step and its persistent tier on disk (every 1000
  steps: never, here); recovery: a fresh emergency manager restores the latest step. On CPU
  devices it may not run at all: `start` then raises, and the caller records the error.

Both run inside the benchmark's jax.distributed job; every process calls every method.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any


class OrbaxLocal:
    """An async `CheckpointManager` saving every step into `directory` (in /dev/shm)."""

    name = "orbax_local"

    def __init__(self, directory: Path, abstract: Any, mesh: Any) -> None:
        self.directory, self.abstract, self.mesh = directory, abstract, mesh
        self.mgr: Any = None

    def _manager(self) -> Any:
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
        return ocp.CheckpointManager(self.directory, options=opts)

    def start(self) -> None:
        self.mgr = self._manager()

    def save(self, step: int, state: Any) -> None:
        import orbax.checkpoint as ocp

        self.mgr.save(step, args=ocp.args.StandardSave(state))

    def wait(self) -> None:
        self.mgr.wait_until_finished()

    def restore(self) -> tuple[int, Any]:
        """(step, state) from a fresh manager, as a restarted job would."""
        import orbax.checkpoint as ocp

        mgr = self._manager()
        step = mgr.latest_step()
        got = mgr.restore(step, args=ocp.args.StandardRestore(self.abstract))
        mgr.close()
        return step, got

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class OrbaxEmergency(OrbaxLocal):
    """Orbax's emergency manager: local tier every step in `directory`, persistent in `persist`."""

    name = "orbax_emergency"

    def __init__(self, directory: Path, abstract: Any, mesh: Any, persist: Path) -> None:
        super().__init__(directory, abstract, mesh)
        self.persist = persist

    def _manager(self) -> Any:
        from orbax.checkpoint.experimental.emergency import checkpoint_manager as em

        opts = em.CheckpointManagerOptions(
            local=em.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
            persistent=em.PersistentCheckpointOptions(save_interval_steps=1000, max_to_keep=1),
            enable_async_checkpointing=True,
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        return em.CheckpointManager(self.directory, self.persist, self.mesh, self.abstract,
                                    options=opts)  # fmt: skip

    def start(self) -> None:
        # the process/device id maps it needs (Orbax's own emergency benchmark does this first)
        from absl import flags
        from orbax.checkpoint._src.multihost import multihost

        if not flags.FLAGS.is_parsed():  # its restore reads absl flags (defaults are fine)
            flags.FLAGS.mark_as_parsed()
        if not multihost.is_runtime_to_distributed_ids_initialized():
            multihost.initialize_runtime_to_distributed_ids()
        if not multihost.is_distributed_to_device_ids_initialized():
            multihost.initialize_distributed_to_device_ids()
        super().start()

    def save(self, step: int, state: Any) -> None:
        import orbax.checkpoint as ocp

        self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))

    def restore(self) -> tuple[int, Any]:
        import orbax.checkpoint as ocp

        mgr = self._manager()
        step = mgr.latest_step()
        got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            self.abstract)))  # fmt: skip
        mgr.close()
        return step, got["state"]

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.persist, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.directory.parent.rmdir()  # the per-host folders' parent, once both are gone


def orbax_summary(r: dict[str, Any], names: list[str], errors: dict[str, str]) -> dict[str, Any]:
    """Each Orbax tier's step overhead and recovery, as ratios against ucp's in-memory tier and
    the disk (`ucp.restore` of the universal format, cold); and why a tier did not run."""
    st, rec = r["step_s"], r["recovery_s"]
    base = st["base"]["median"]
    ucp_extra = st["snap"]["median"] - base
    tiers = {}
    for name in names:
        extra = st[name]["median"] - base
        tiers[name] = {
            "step_overhead": extra / base,
            "extra_step_s": extra,
            "extra_step_vs_ucp": extra / ucp_extra if ucp_extra > 0 else None,
            "recovery_s": rec[name],
            "recovery_vs_ucp_memory": rec[name] / rec["memory"],  # x slower than ucp's memory
            "recovery_speedup_vs_disk_cold": rec["disk_cold"] / rec[name],
            "ucp_wins": {
                "less step overhead": ucp_extra < extra,
                "faster recovery": rec["memory"] < rec[name],
            },
        }
    return {"tiers": tiers, "errors": errors}


def orbax_table(r: dict[str, Any]) -> list[str]:
    """The report's Orbax lines: each tier beside ucp's, and why a tier did not run."""
    st = r["step_s"]
    lines: list[str] = []
    orb = r.get("orbax", {})
    if orb.get("tiers"):
        lines += ["", "Orbax, same job, state and steps (saving every step):",
                  f"{'':18}{'step median':>12}{'overhead':>10}{'x ucp extra':>12}"
                  f"{'recovery':>10}{'x ucp mem':>10}{'disk/it':>9}"]  # fmt: skip
        ucp_o = r["step_overhead"]
        lines.append(f"{'ucp memory':18}{st['snap']['median']:>11.3f}s{100 * ucp_o:>+9.1f}%"
                     f"{1:>12.2f}{r['recovery_s']['memory']:>9.3f}s{1:>10.1f}"
                     f"{r['recovery_speedup_cold']:>8.1f}x")  # fmt: skip
        for name, o in orb["tiers"].items():
            x = o["extra_step_vs_ucp"]
            lines.append(
                f"{name:18}{st[name]['median']:>11.3f}s{100 * o['step_overhead']:>+9.1f}%"
                f"{'-' if x is None else f'{x:.2f}':>12}{o['recovery_s']:>9.3f}s"
                f"{o['recovery_vs_ucp_memory']:>10.1f}{o['recovery_speedup_vs_disk_cold']:>8.1f}x"
            )
    for name, err in orb.get("errors", {}).items():
        lines.append(f"{name}: does not run here: {err[:600]}")
    return lines
