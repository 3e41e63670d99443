"""Orbax integration: `UniversalCheckpointHandler` with `UniversalSave` / `UniversalRestore` args.

Importing this module registers the handler and its args with Orbax (`ocp.args`).

>>> import orbax.checkpoint as ocp  # doctest: +SKIP
>>> import ucp_jax.orbax  # doctest: +SKIP
>>> mngr = ocp.CheckpointManager("/tmp/ckpt")  # doctest: +SKIP
>>> mngr.save(10, args=ucp_jax.orbax.UniversalSave(params, opt_state))  # doctest: +SKIP
>>> params, opt_state = mngr.restore(10, args=ucp_jax.orbax.UniversalRestore(pt, ot))  # doctest: +SKIP

See `ucp_jax._src.frameworks.orbax.handler` for where the checkpoint lives inside Orbax's step folder.
"""

from ._src.frameworks.orbax.handler import UniversalCheckpointHandler as UniversalCheckpointHandler
from ._src.frameworks.orbax.handler import UniversalRestore as UniversalRestore
from ._src.frameworks.orbax.handler import UniversalSave as UniversalSave
from ._src.frameworks.orbax.handler import UniversalState as UniversalState
