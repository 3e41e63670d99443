"""The configuration of a Llama-family model (Llama, Mistral, Qwen2, Mixtral), from a HF ``config.json``.

The implementation lives in the library (the Hugging Face and Megatron importers and exporters
read it too); this module is its public name.

>>> from ucp_jax.models.llama_config import LlamaConfig
>>> LlamaConfig().model_type
'llama'
"""

from .._src.hf_config import config_from_checkpoint as config_from_checkpoint
from .._src.hf_config import config_from_hf as config_from_hf
from .._src.hf_config import read_config_json as read_config_json
from .._src.llama_config import ACTIVATIONS as ACTIVATIONS
from .._src.llama_config import FAMILIES as FAMILIES
from .._src.llama_config import MAX_CONFIG_BYTES as MAX_CONFIG_BYTES
from .._src.llama_config import ROPE_TYPES as ROPE_TYPES
from .._src.llama_config import HFConfigError as HFConfigError
from .._src.llama_config import LlamaConfig as LlamaConfig
from .._src.llama_config import ucp_extra as ucp_extra
