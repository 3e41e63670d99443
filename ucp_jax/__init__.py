"""ucp_jax: Universal Checkpointing for JAX.

Save a train state once as universal atoms; restore it onto any mesh.

>>> import ucp_jax as ucp
>>> ucp.save("/tmp/ckpt/step_10", params, opt_state, step=10)  # doctest: +SKIP
>>> params, opt_state = ucp.restore("/tmp/ckpt/step_10", params_target, opt_state_target)  # doctest: +SKIP

The names that need JAX (save, restore, targets, ...) and the submodules `orbax`, `torch` and
`memory` are imported on first use, so that tools that only read or write files (`ucp convert`,
`ucp inspect`) start without importing JAX.
"""

import typing as _typing

from ._src.errors import AnotherProcessFailedError as AnotherProcessFailedError
from ._src.errors import ArgumentError as ArgumentError
from ._src.errors import ChecksumError as ChecksumError
from ._src.errors import DestinationExistsError as DestinationExistsError
from ._src.errors import DeviceCountError as DeviceCountError
from ._src.errors import FormatVersionError as FormatVersionError
from ._src.errors import HostMemoryError as HostMemoryError
from ._src.errors import LimitError as LimitError
from ._src.errors import MismatchError as MismatchError
from ._src.errors import NotACheckpointError as NotACheckpointError
from ._src.errors import PatternError as PatternError
from ._src.errors import RestorePlanError as RestorePlanError
from ._src.errors import StorageFullError as StorageFullError
from ._src.errors import StoreError as StoreError
from ._src.errors import StoreUnreachableError as StoreUnreachableError
from ._src.errors import UcpError as UcpError
from ._src.errors import UnsafePathError as UnsafePathError
from ._src.errors import WriterConflictError as WriterConflictError
from ._src.format.manifest import AtomInfo as AtomInfo
from ._src.format.manifest import SlotInfo as SlotInfo
from ._src.format.version import __version__ as __version__
from ._src.mapping.patterns import Averaged as Averaged
from ._src.mapping.patterns import Fused as Fused
from ._src.mapping.patterns import Partitioned as Partitioned
from ._src.mapping.patterns import Pattern as Pattern
from ._src.mapping.patterns import Replicated as Replicated
from ._src.mapping.patterns import Stacked as Stacked
from ._src.mapping.patterns import Transposed as Transposed
from ._src.mapping.patterns import VocabPadded as VocabPadded
from ._src.mapping.rename import Renamed as Renamed

if _typing.TYPE_CHECKING:
    from . import memory as memory
    from . import orbax as orbax
    from . import torch as torch
    from ._src.checkpoint import Checkpoint as Checkpoint
    from ._src.checkpoint import list_checkpoints as list_checkpoints
    from ._src.checkpoint import open_checkpoint as open
    from ._src.format.removal import delete_checkpoint as delete_checkpoint
    from ._src.format.store import Location as Location
    from ._src.frameworks.common.orbax_source import OrbaxImportError as OrbaxImportError
    from ._src.frameworks.maxtext.export import export_maxtext as export_maxtext
    from ._src.frameworks.maxtext.read import import_maxtext as import_maxtext
    from ._src.frameworks.orbax.export import export_orbax as export_orbax
    from ._src.frameworks.orbax.read import import_orbax as import_orbax
    from ._src.plan_report import RestorePlan as RestorePlan
    from ._src.plan_report import plan as plan
    from ._src.read_stats import ReadStats as ReadStats
    from ._src.read_stats import last_read_stats as last_read_stats
    from ._src.restore import restore as restore
    from ._src.save_api import SaveHandle as SaveHandle
    from ._src.save_api import async_save as async_save
    from ._src.save_api import save as save
    from ._src.targets import make_mesh as make_mesh
    from ._src.targets import targets as targets

# public name -> (module under ucp_jax, attribute)
_LAZY = {
    "Checkpoint": ("._src.checkpoint", "Checkpoint"),
    "list_checkpoints": ("._src.checkpoint", "list_checkpoints"),
    "open": ("._src.checkpoint", "open_checkpoint"),
    "Location": ("._src.format.store", "Location"),
    "delete_checkpoint": ("._src.format.removal", "delete_checkpoint"),
    "import_orbax": ("._src.frameworks.orbax.read", "import_orbax"),
    "export_orbax": ("._src.frameworks.orbax.export", "export_orbax"),
    "import_maxtext": ("._src.frameworks.maxtext.read", "import_maxtext"),
    "export_maxtext": ("._src.frameworks.maxtext.export", "export_maxtext"),
    "OrbaxImportError": ("._src.frameworks.common.orbax_source", "OrbaxImportError"),
    "plan": ("._src.plan_report", "plan"),
    "RestorePlan": ("._src.plan_report", "RestorePlan"),
    "restore": ("._src.restore", "restore"),
    "ReadStats": ("._src.read_stats", "ReadStats"),
    "last_read_stats": ("._src.read_stats", "last_read_stats"),
    "SaveHandle": ("._src.save_api", "SaveHandle"),
    "async_save": ("._src.save_api", "async_save"),
    "save": ("._src.save_api", "save"),
    "make_mesh": ("._src.targets", "make_mesh"),
    "targets": ("._src.targets", "targets"),
}
_SUBMODULES = ("orbax", "torch", "memory")


if not _typing.TYPE_CHECKING:  # (a type checker sees the names above; a misspelt one is an error)

    def __getattr__(name: str) -> _typing.Any:  # PEP 562: JAX and torch imported on first use
        import importlib

        if name in _LAZY:
            module, attr = _LAZY[name]
            value = getattr(importlib.import_module(module, __name__), attr)
            globals()[name] = value
            return value
        if name in _SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*(n for n in globals() if not n.startswith("_")), *_LAZY, *_SUBMODULES})


# every public name (a type checker takes `open`, imported under another name, as exported)
__all__ = [
    "AnotherProcessFailedError", "ArgumentError", "AtomInfo", "Averaged", "Checkpoint", "ChecksumError",
    "DestinationExistsError", "DeviceCountError", "FormatVersionError", "Fused", "HostMemoryError",
    "LimitError", "Location", "MismatchError", "NotACheckpointError", "OrbaxImportError",
    "Partitioned", "Pattern", "PatternError", "ReadStats", "Renamed", "Replicated",
    "RestorePlan", "RestorePlanError", "SaveHandle", "SlotInfo", "Stacked", "StorageFullError",
    "StoreError", "StoreUnreachableError", "Transposed", "UcpError", "UnsafePathError",
    "VocabPadded", "WriterConflictError", "__version__", "async_save", "delete_checkpoint",
    "export_maxtext", "export_orbax", "import_maxtext", "import_orbax", "last_read_stats",
    "list_checkpoints", "make_mesh", "memory", "open", "orbax", "plan", "restore", "save",
    "targets", "torch",
]  # fmt: skip
