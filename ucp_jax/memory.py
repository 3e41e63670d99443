"""The in-memory tier: asynchronous snapshots in per-node shared memory, recovered in seconds.

>>> import ucp_jax as ucp
>>> import ucp_jax.memory  # doctest: +SKIP
>>> mgr = ucp.memory.SnapshotManager("/ckpt", persist_every=100, redundancy="replica")  # doctest: +SKIP
>>> for step in range(start, steps):  # doctest: +SKIP
...     params, opt_state = train_step(params, opt_state, batch)
...     mgr.snapshot(step, params, opt_state)  # returns at once
>>> params, opt_state = mgr.restore(params_target, opt_state_target)  # after a crash  # doctest: +SKIP

See `ucp_jax._src.memory.engine.SnapshotManager`.
"""

from ._src.memory.engine import SnapshotManager as SnapshotManager
from ._src.memory.engine import SnapshotStats as SnapshotStats
from ._src.memory.recovery import RestoreInfo as RestoreInfo
