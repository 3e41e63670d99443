"""A Hugging Face ``config.json`` read into a :class:`~ucp_jax._src.llama_config.LlamaConfig`.

Only the fields that change the function the model computes are kept; everything the JAX model
cannot represent (other activations, MLP or output-projection biases, other RoPE scalings, partial
rotary embeddings, per-layer sliding windows) is refused by :func:`config_from_hf`, naming the
field, so an imported model never silently computes something else than transformers does. The
file itself is untrusted: size-checked, parsed by the one JSON reader, every count bounded.

>>> cfg = config_from_hf({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})
>>> cfg.head_dim, cfg.n_kv_heads, cfg.rope_theta
(16, 4, 10000.0)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from .errors import UnsafePathError
from .llama_config import (
    ACTIVATIONS,
    FAMILIES,
    MAX_CONFIG_BYTES,
    ROPE_TYPES,
    HFConfigError,
    LlamaConfig,
)
from .untrusted.json import read_json
from .untrusted.paths import open_regular

# what transformers' config classes take for a field that config.json leaves out ("heads": the
# number of attention heads): a missing field means the same model here as in transformers
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": "heads", "rms_norm_eps": 1e-6, "rope_theta": 1e4},
    "mistral": {"num_key_value_heads": 8, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
                "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
              "sliding_window": 4096, "max_window_layers": 28},
    "mixtral": {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "sliding_window": None},
}  # fmt: skip


def read_config_json(path: str, what: str = "model config") -> dict[str, Any]:
    """The object in a ``config.json`` (or another of the folder's JSON files, ``what``), size-
    and syntax-checked.

    Args:
        path: the file.
        what: what the file is, for messages.

    Returns:
        The parsed JSON object.

    Raises:
        HFConfigError: unreadable, too large, not JSON, or not an object.
    """
    try:
        with open_regular(os.fspath(path), what) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except UnsafePathError as e:
        raise HFConfigError(str(e)) from e
    except OSError as e:
        raise HFConfigError(
            f"{path}: cannot read the {what} ({e.strerror or e}); a Hugging Face model "
            "folder needs a config.json"
        ) from e
    cfg: dict[str, Any] = read_json(
        raw, f"{path} ({what})", max_bytes=MAX_CONFIG_BYTES, expect=dict, error=HFConfigError
    )
    return cfg


# Counts a config.json may claim: far above any model's (a few hundred layers, experts), low
# enough that lists of one entry per layer or expert (names, layer kinds) stay small
MAX_LAYERS = MAX_EXPERTS = 1 << 16
MAX_LAYER_EXPERTS = 1 << 20


def _bounded(n: int, key: str, where: str, limit: int = MAX_LAYERS) -> int:
    """`n` (a count from config.json), refused above `limit`."""
    if n > limit:
        raise HFConfigError(
            f"{where}: {key} is {n}, more than any model has (ucp_jax takes up to {limit}); the "
            "config is damaged or not a model's"
        )
    return n


def _get(
    cfg: Mapping[str, Any],
    key: str,
    kind: type,
    where: str,
    default: Any = ...,
    *,
    null: bool = False,
) -> Any:
    """`cfg[key]` checked to be a `kind` (a positive one for numbers), else `default` when the
    key is missing (`...`: required); None where the default is None or `null` allows it (a
    field written as null, as Mistral's ``sliding_window: null`` meaning no window)."""
    v = cfg.get(key, default)
    if v is ...:
        raise HFConfigError(f"{where}: field {key!r} is missing; expected a {kind.__name__}")
    if v is None and (default is None or null):
        return None
    ok = (
        isinstance(v, kind) and not isinstance(v, bool) if kind is not bool else isinstance(v, bool)
    )
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        ok, v = True, float(v)
    if not ok or (kind is int and v <= 0) or (kind is float and not (math.isfinite(v) and v > 0)):
        what = "a bool (true or false)" if kind is bool else f"a positive {kind.__name__}"
        raise HFConfigError(f"{where}: field {key!r} must be {what}, found {v!r:.60}")
    return v


def _rope(
    cfg: Mapping[str, Any], where: str, default_theta: float = 1e4
) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(rope_theta, scaling) from transformers v5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        if not isinstance(cfg.get("rope_scaling") or {}, dict):
            raise HFConfigError(f"{where}: rope_scaling must be an object or null")
    if not isinstance(params, dict):
        raise HFConfigError(f"{where}: rope_parameters must be an object, found {params!r:.60}")
    theta_v4 = cfg.get("rope_theta")
    merged = {"rope_theta": default_theta if theta_v4 is None else theta_v4, **params}
    theta = _get(merged, "rope_theta", float, where)
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFConfigError(
            f"{where}: unsupported feature rope scaling type {kind!r}; the JAX Llama model "
            f"implements {list(ROPE_TYPES)}"
        )
    prf = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf != 1.0:
        raise HFConfigError(
            f"{where}: unsupported feature partial_rotary_factor={prf!r} (only 1.0)"
        )
    scaling: dict[str, Any] = {}
    if kind == "linear":
        scaling = {"rope_type": kind, "factor": _get(merged, "factor", float, where)}
    elif kind == "llama3":
        scaling = {"rope_type": kind}
        for k in ("factor", "low_freq_factor", "high_freq_factor"):
            scaling[k] = _get(merged, k, float, where)
        orig = merged.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        scaling["original_max_position_embeddings"] = _get(
            {"o": orig}, "o", int, f"{where}: original_max_position_embeddings"
        )
        if scaling["high_freq_factor"] == scaling["low_freq_factor"]:
            raise HFConfigError(f"{where}: llama3 rope needs high_freq_factor != low_freq_factor")
    return theta, tuple(sorted(scaling.items()))


def config_from_hf(cfg: Mapping[str, Any], where: str = "config.json") -> LlamaConfig:
    """A :class:`LlamaConfig` from a HF config dict, refusing what the model cannot represent.

    Args:
        cfg: the parsed ``config.json``.
        where: the file, for messages.

    Returns:
        The configuration (the source dict kept in ``hf`` for export).

    Raises:
        HFConfigError: a missing or malformed field, an unknown ``model_type``, or an unsupported
            feature (named in the message).
    """
    mt = cfg.get("model_type")
    if mt is None:
        raise HFConfigError(
            f"{where}: field 'model_type' is missing; expected one of {list(FAMILIES)} (the "
            "family the weights belong to, as transformers' config classes write it)"
        )
    if mt not in FAMILIES:
        raise HFConfigError(
            f"{where}: unsupported model_type {mt!r}; supported: {list(FAMILIES)} (for another "
            "architecture, import with import_safetensors and your own AtomFrom mapping)"
        )
    if mt == "gpt":
        return _gpt_config(cfg, where)
    defaults = HF_DEFAULTS[mt]
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):  # transformers maps both names to SiLU
        raise HFConfigError(f"{where}: unsupported feature hidden_act={act!r} (only 'silu')")
    if cfg.get("mlp_bias"):
        raise HFConfigError(f"{where}: unsupported feature mlp_bias=true (no MLP biases)")
    if mt == "llama" and cfg.get("attention_bias"):
        raise HFConfigError(
            f"{where}: unsupported feature attention_bias=true for llama (q/k/v/o biases); only "
            "qwen2's q/k/v biases are modelled"
        )
    n_layers = _bounded(_get(cfg, "num_hidden_layers", int, where), "num_hidden_layers", where)
    window = None
    if mt in ("mistral", "mixtral"):
        window = _get(cfg, "sliding_window", int, where, defaults["sliding_window"], null=True)
    elif mt == "qwen2":
        window = _qwen2_window(cfg, n_layers, where)
    experts, top_k, aux = 0, 2, 0.02
    if mt == "mixtral":  # transformers' MixtralConfig defaults
        experts = _bounded(_get(cfg, "num_local_experts", int, where, 8), "num_local_experts",
                           where)  # fmt: skip
        _bounded(n_layers * experts, "num_hidden_layers x num_local_experts", where,
                 MAX_LAYER_EXPERTS)  # fmt: skip
        top_k = _get(cfg, "num_experts_per_tok", int, where, 2)
        aux = float(cfg.get("router_aux_loss_coef", 0.001))
        if top_k > experts:
            raise HFConfigError(
                f"{where}: num_experts_per_tok={top_k} exceeds num_local_experts={experts}"
            )
    d = _get(cfg, "hidden_size", int, where)
    nh = _get(cfg, "num_attention_heads", int, where)
    kv_default = defaults["num_key_value_heads"]
    if "num_key_value_heads" in cfg and cfg["num_key_value_heads"] is None:
        nkv = nh  # null: as many as the query heads (transformers' __post_init__)
    else:
        nkv = _get(
            cfg, "num_key_value_heads", int, where, nh if kv_default == "heads" else kv_default
        )
    hd = _get(cfg, "head_dim", int, where, None) or d // nh
    if nh % nkv:
        raise HFConfigError(
            f"{where}: num_key_value_heads={nkv} does not divide num_attention_heads={nh}"
            + ("" if "num_key_value_heads" in cfg else
               f" (the field is missing: transformers takes {mt}'s default {nkv}); set it")
        )  # fmt: skip
    theta, scaling = _rope(cfg, where, defaults["rope_theta"])
    tie = _get(cfg, "tie_word_embeddings", bool, where, False)
    return LlamaConfig(
        model_type=mt, vocab_size=_get(cfg, "vocab_size", int, where), d_model=d, n_heads=nh,
        n_kv_heads=nkv, head_dim=hd, n_layers=n_layers,
        d_ff=_get(cfg, "intermediate_size", int, where),
        norm_eps=_get(cfg, "rms_norm_eps", float, where, defaults["rms_norm_eps"]),
        rope_theta=theta, rope_scaling=scaling, qkv_bias=mt == "qwen2", tie_embeddings=bool(tie),
        sliding_window=window, n_experts=experts, top_k=top_k, router_aux_loss_coef=aux,
        hf=json.dumps(dict(cfg), sort_keys=True),
    )  # fmt: skip


def _qwen2_window(cfg: Mapping[str, Any], n_layers: int, where: str) -> int | None:
    """The sliding window of a Qwen2 config when every layer has it, None when no layer has it.

    transformers' Qwen2Config: ``sliding_window`` counts only with ``use_sliding_window``; layer
    ``i`` slides when ``i >= max_window_layers``, unless ``layer_types`` names each layer's kind.
    """
    defaults = HF_DEFAULTS["qwen2"]
    use = _get(cfg, "use_sliding_window", bool, where, False)
    window = (_get(cfg, "sliding_window", int, where, defaults["sliding_window"], null=True)
              if use else None)  # fmt: skip
    kinds = cfg.get("layer_types")
    if kinds is None:
        first = cfg.get("max_window_layers", defaults["max_window_layers"])
        if not isinstance(first, int) or isinstance(first, bool):
            raise HFConfigError(
                f"{where}: field 'max_window_layers' must be an int, found {first!r:.60}"
            )
        kinds = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(n_layers)]  # fmt: skip
    if not isinstance(kinds, list) or len(kinds) != n_layers:
        raise HFConfigError(
            f"{where}: layer_types must list one kind per layer ({n_layers}), found {kinds!r:.80}"
        )
    found = set(kinds)
    if found == {"full_attention"}:
        return None
    if found == {"sliding_attention"} and window is not None:
        return window
    raise HFConfigError(
        f"{where}: unsupported feature sliding-window layers for qwen2 (layer kinds "
        f"{sorted(map(str, found))}, sliding_window={window}); the JAX model gives every layer "
        "the same attention"
    )


def _choice(cfg: Mapping[str, Any], key: str, options: dict[Any, Any], where: str) -> Any:
    v = cfg.get(key, next(iter(options)))
    if v not in options:
        raise HFConfigError(
            f"{where}: unsupported feature {key}={v!r:.60}; the model implements {list(options)}"
        )
    return options[v]


def _gpt_config(cfg: Mapping[str, Any], where: str) -> LlamaConfig:
    """A GPT-style decoder (model_type "gpt"): the fields :meth:`LlamaConfig.to_hf` writes."""
    d = _get(cfg, "hidden_size", int, where)
    nh = _get(cfg, "num_attention_heads", int, where)
    nkv = _get(cfg, "num_key_value_heads", int, where, nh) or nh
    if nh % nkv:
        raise HFConfigError(
            f"{where}: num_key_value_heads={nkv} does not divide num_attention_heads={nh}"
        )
    act = _choice(cfg, "hidden_act", {a: a for a in ACTIVATIONS}, where)
    norm = _choice(cfg, "normalization", {"LayerNorm": "layer", "RMSNorm": "rms"}, where)
    pos = _choice(cfg, "position_embedding_type", {"rope": "rope", "learned_absolute": "learned"},
                  where)  # fmt: skip
    theta, scaling = _rope(cfg, where)
    max_pos = _get(cfg, "max_position_embeddings", int, where) if pos == "learned" else 0
    experts = _get(cfg, "num_local_experts", int, where, None) or 0
    top_k = _get(cfg, "num_experts_per_tok", int, where, 2)
    flags = {k: _get(cfg, k, bool, where, False) for k in ("gated_mlp", "add_bias_linear",
                                                          "add_qkv_bias", "tie_word_embeddings")}  # fmt: skip
    return LlamaConfig(
        model_type="gpt", vocab_size=_get(cfg, "vocab_size", int, where), d_model=d, n_heads=nh,
        n_kv_heads=nkv, head_dim=_get(cfg, "head_dim", int, where, None) or d // nh,
        n_layers=_get(cfg, "num_hidden_layers", int, where),
        d_ff=_get(cfg, "intermediate_size", int, where),
        norm_eps=_get(cfg, "rms_norm_eps", float, where, 1e-5), rope_theta=theta,
        rope_scaling=scaling, qkv_bias=flags["add_qkv_bias"],
        tie_embeddings=flags["tie_word_embeddings"], n_experts=experts, top_k=top_k,
        sliding_window=_get(cfg, "sliding_window", int, where, None),
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.02)), norm=norm,
        activation=act, gated_mlp=flags["gated_mlp"], linear_bias=flags["add_bias_linear"],
        positions=pos, max_positions=max_pos, hf=json.dumps(dict(cfg), sort_keys=True),
    )  # fmt: skip


def config_from_checkpoint(path: Any) -> LlamaConfig:
    """The configuration recorded in a checkpoint's manifest ``extra`` (by import_hf or save).

    Args:
        path: a universal checkpoint (or an open ``ucp.Checkpoint``).

    Returns:
        The :class:`LlamaConfig`.

    Raises:
        HFConfigError: the manifest records no ``hf_config``.
    """
    from .checkpoint import Checkpoint  # reads files only: no JAX

    ck = path if isinstance(path, Checkpoint) else Checkpoint(path)
    extra = ck.manifest.extra
    cfg = extra.get("hf_config") if isinstance(extra, dict) else None
    if not isinstance(cfg, dict):
        raise HFConfigError(
            f"{ck.path}: the manifest's extra records no 'hf_config'; import it with import_hf, "
            "or save with extra=ucp_extra(config)"
        )
    return config_from_hf(cfg, f"{ck.path}: manifest extra.hf_config")
