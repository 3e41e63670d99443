"""ucp_jax: Universal Checkpointing for JAX.

Save a train state once as universal atoms; restore it onto any mesh.

>>> import ucp_jax as ucp
>>> ucp.save("/tmp/ckpt/step_10", params, opt_state, step=10)  # doctest: +SKIP
>>> params, opt_state = ucp.restore("/tmp/ckpt/step_10", params_target, opt_state_target)  # doctest: +SKIP
"""

from ._src.errors import ChecksumError as ChecksumError
from ._src.errors import FormatVersionError as FormatVersionError
from ._src.errors import MismatchError as MismatchError
from ._src.errors import NotACheckpointError as NotACheckpointError
from ._src.errors import PatternError as PatternError
from ._src.errors import UcpError as UcpError
from ._src.manifest import AtomInfo as AtomInfo
from ._src.manifest import SlotInfo as SlotInfo
from ._src.patterns import Averaged as Averaged
from ._src.patterns import Fused as Fused
from ._src.patterns import Partitioned as Partitioned
from ._src.patterns import Pattern as Pattern
from ._src.patterns import Replicated as Replicated
from ._src.patterns import Stacked as Stacked
from ._src.patterns import Transposed as Transposed
from ._src.patterns import VocabPadded as VocabPadded
from ._src.restore import Checkpoint as Checkpoint
from ._src.restore import list_checkpoints as list_checkpoints
from ._src.restore import open_checkpoint as open  # noqa: F401  (contract name: ucp.open)
from ._src.restore import restore as restore
from ._src.save import SaveHandle as SaveHandle
from ._src.save import async_save as async_save
from ._src.save import save as save
from ._src.targets import make_mesh as make_mesh
from ._src.targets import targets as targets
from ._src.version import __version__ as __version__

_SUBMODULES = ("orbax", "torch", "memory")


def __getattr__(name: str):  # lazy submodules: `import ucp_jax` never imports torch
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
