"""ucp_jax.torch: PyTorch checkpoints in and out.

>>> import ucp_jax.torch as ucpt  # doctest: +SKIP
>>> ucpt.import_deepspeed("ds_ckpt", "/tmp/universal/step_3")  # doctest: +SKIP
>>> ucpt.export_deepspeed_universal("/tmp/universal/step_3", "ds_univ/global_step3")  # doctest: +SKIP

Needs PyTorch (the `[torch]` extra); DeepSpeed itself is never imported.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError as _e:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "ucp_jax.torch needs PyTorch, which is not installed; install it with "
        "pip install 'ucp_jax[torch]'"
    ) from _e

from ._src.frameworks.common.dcp_files import DCPFormatError as DCPFormatError
from ._src.frameworks.dcp.export import DCPExportError as DCPExportError
from ._src.frameworks.dcp.export import export_dcp as export_dcp
from ._src.frameworks.dcp.read import import_dcp as import_dcp
from ._src.frameworks.deepspeed.common import DeepSpeedFormatError as DeepSpeedFormatError
from ._src.frameworks.deepspeed.export import (
    export_deepspeed_universal as export_deepspeed_universal,
)
from ._src.frameworks.deepspeed.universal import (
    import_deepspeed_universal as import_deepspeed_universal,
)
from ._src.frameworks.deepspeed.zero import import_deepspeed as import_deepspeed
from ._src.frameworks.hf.export import export_hf as export_hf
from ._src.frameworks.hf.read import hf_mapping as hf_mapping
from ._src.frameworks.hf.read import import_hf as import_hf
from ._src.frameworks.hf.safetensors import PRESETS as PRESETS
from ._src.frameworks.hf.safetensors import AtomFrom as AtomFrom
from ._src.frameworks.hf.safetensors import import_safetensors as import_safetensors
from ._src.frameworks.megatron.common import MegatronFormatError as MegatronFormatError
from ._src.frameworks.megatron.export import MegatronExportError as MegatronExportError
from ._src.frameworks.megatron.export import export_megatron as export_megatron
from ._src.frameworks.megatron.read import import_megatron as import_megatron
from ._src.frameworks.torchtitan.export import TorchtitanExportError as TorchtitanExportError
from ._src.frameworks.torchtitan.export import export_torchtitan as export_torchtitan
from ._src.frameworks.torchtitan.read import TorchtitanFormatError as TorchtitanFormatError
from ._src.frameworks.torchtitan.read import import_torchtitan as import_torchtitan
from ._src.untrusted.safetensors import SafetensorsError as SafetensorsError
from ._src.untrusted.unpickle import UnsafePickleError as UnsafePickleError
from ._src.untrusted.unpickle import load as load_weights_only

__all__ = [
    "PRESETS",
    "AtomFrom",
    "DCPExportError",
    "DCPFormatError",
    "DeepSpeedFormatError",
    "MegatronExportError",
    "MegatronFormatError",
    "SafetensorsError",
    "TorchtitanExportError",
    "TorchtitanFormatError",
    "UnsafePickleError",
    "export_dcp",
    "export_deepspeed_universal",
    "export_hf",
    "export_megatron",
    "export_torchtitan",
    "hf_mapping",
    "import_dcp",
    "import_deepspeed",
    "import_deepspeed_universal",
    "import_hf",
    "import_megatron",
    "import_safetensors",
    "import_torchtitan",
    "load_weights_only",
]
