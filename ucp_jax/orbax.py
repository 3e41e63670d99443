"""Orbax integration: `UniversalCheckpointHandler` with `UniversalSave` / `UniversalRestore` args;
MaxText checkpoints in and out (`import_maxtext`, `export_maxtext`) and plain Orbax out
(`export_orbax`).

Importing this module registers the handler and its args with Orbax (`ocp.args`).

>>> import orbax.checkpoint as ocp  # doctest: +SKIP
>>> import ucp_jax.orbax  # doctest: +SKIP
>>> mngr = ocp.CheckpointManager("/tmp/ckpt")  # doctest: +SKIP
>>> mngr.save(10, args=ucp_jax.orbax.UniversalSave(params, opt_state))  # doctest: +SKIP
>>> params, opt_state = mngr.restore(10, args=ucp_jax.orbax.UniversalRestore(pt, ot))  # doctest: +SKIP

See `ucp_jax._src.frameworks.orbax.handler` for where the checkpoint lives inside Orbax's step folder.
"""

from ._src.frameworks.maxtext.export import export_maxtext as export_maxtext
from ._src.frameworks.maxtext.layout import MaxTextFormatError as MaxTextFormatError
from ._src.frameworks.maxtext.read import import_maxtext as import_maxtext
from ._src.frameworks.orbax.export import export_orbax as export_orbax
from ._src.frameworks.orbax.handler import UniversalCheckpointHandler as UniversalCheckpointHandler
from ._src.frameworks.orbax.handler import UniversalRestore as UniversalRestore
from ._src.frameworks.orbax.handler import UniversalSave as UniversalSave
from ._src.frameworks.orbax.handler import UniversalState as UniversalState
from ._src.frameworks.orbax.v1 import (
    UniversalCheckpointableHandler as UniversalCheckpointableHandler,
)
