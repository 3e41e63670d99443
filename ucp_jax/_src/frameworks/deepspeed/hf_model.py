"""A DeepSpeed checkpoint of a Hugging Face model: its ``config.json``, found or given.

The HF Trainer (and most scripts built on ``from_pretrained``) saves the model's ``config.json``
in the checkpoint folder, beside DeepSpeed's ``global_step<N>/`` and ``latest``. When it is there
and describes a model ``ucp_jax.models.llama`` implements (Llama, Mistral, Qwen2, Mixtral), the
ZeRO importer names the atoms as ``import_hf`` does (see ``frameworks.common.hf_atoms``), so the
checkpoint restores onto the JAX model and ``export_hf`` writes it back for transformers.
"""

from __future__ import annotations

import os
from typing import Any

from ...hf_config import config_from_hf, read_config_json
from ...llama_config import FAMILIES, HFConfigError, LlamaConfig

CONFIG = "config.json"


def find_hf_config(
    src: str, folder: str, hf_config: Any
) -> tuple[LlamaConfig | None, str | None, str | None]:
    """(config, its path, why an auto-detected config.json was not used).

    Args:
        src: what the user named (the checkpoint directory, or the tag folder).
        folder: the tag folder holding the rank files.
        hf_config: a ``config.json`` or the folder holding one (it must describe a supported
            model); None to look beside the checkpoint; False not to use one.

    Raises:
        HFConfigError: the given config is unreadable or describes another model family.
    """
    if hf_config is False:
        return None, None, None
    if hf_config is not None:
        path = os.fspath(hf_config)
        path = os.path.join(path, CONFIG) if os.path.isdir(path) else path
        return config_from_hf(read_config_json(path), path), path, None
    parent = os.path.dirname(os.path.normpath(folder))
    for cand in dict.fromkeys(os.path.join(d, CONFIG) for d in (src, parent, folder)):
        if not os.path.isfile(cand):
            continue
        if os.path.islink(cand):
            return None, None, f"{cand} is a symbolic link"
        try:
            raw = read_config_json(cand)
        except HFConfigError as e:
            raise HFConfigError(
                f"{e}; pass hf_config=False (--no-hf-config) to import the checkpoint without it"
            ) from e
        if raw.get("model_type") not in FAMILIES or raw.get("model_type") == "gpt":
            return (
                None,
                None,
                (
                    f"{cand}: model_type {raw.get('model_type')!r} is not one of {list(FAMILIES[:4])}"
                ),
            )
        try:
            return config_from_hf(raw, cand), cand, None
        except HFConfigError as e:
            return None, None, str(e)
    return None, None, None


__all__ = ["find_hf_config"]
