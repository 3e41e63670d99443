"""What a Hugging Face folder leaves implicit, read as transformers reads it (transformers is the referee).

A ``config.json`` may leave fields out (each family's config class has its own defaults), name
SiLU ``swish``, give ``num_key_value_heads: null``, or spell Qwen2's sliding window three ways; a
folder may hold a stale ``lm_head.weight`` beside a tied embedding, adapters beside the model,
weights of two dtypes, a ``generation_config.json``, or only a pickled ``pytorch_model.bin``. Every
case is imported and compared with what transformers builds from the same folder: the same
config fields, the same logits, or a refusal naming the file and the fix, with nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")

import ucp_jax as ucp  # noqa: E402
from ucp_jax.demo import Layout  # noqa: E402
from ucp_jax.models import llama as L  # noqa: E402
from ucp_jax.models.llama_config import HFConfigError, config_from_hf  # noqa: E402
from ucp_jax.models.moe import MoELayout  # noqa: E402
from ucp_jax.torch import export_hf, import_hf  # noqa: E402

TOL = 1e-5
CLASSES = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config,
           "mixtral": T.MixtralConfig}  # fmt: skip
# 32 heads: Qwen2's default of 32 KV heads must divide them
SHAPE = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=32)  # fmt: skip


def referee(kind: str, cfg: dict) -> dict:
    """The fields transformers' config class resolves from ``cfg`` (defaults, nulls, windows)."""
    c = CLASSES[kind].from_dict(dict(cfg))
    window = getattr(c, "sliding_window", None)
    kinds = getattr(c, "layer_types", None)
    if kind == "qwen2" and kinds is not None and "sliding_attention" not in kinds:
        window = None  # no layer uses it
    return {"n_kv_heads": c.num_key_value_heads, "norm_eps": c.rms_norm_eps,
            "rope_theta": float(c.rope_parameters["rope_theta"]), "sliding_window": window}  # fmt: skip


def ours(cfg: dict) -> dict:
    c = config_from_hf(cfg)
    return {"n_kv_heads": c.n_kv_heads, "norm_eps": c.norm_eps, "rope_theta": c.rope_theta,
            "sliding_window": c.sliding_window}  # fmt: skip


@pytest.mark.parametrize("kind", list(CLASSES))
@pytest.mark.parametrize(
    "case",
    ["all-left-out", "kv-null", "swish", "theta-in-rope-parameters-only", "eps-given"],
)
def test_left_out_fields_mean_what_transformers_takes(kind: str, case: str) -> None:
    cfg = {"model_type": kind, **SHAPE}
    if case == "kv-null":
        cfg["num_key_value_heads"] = None
    elif case == "swish":
        cfg["hidden_act"] = "swish"
    elif case == "theta-in-rope-parameters-only":
        cfg["rope_parameters"] = {"rope_type": "default"}
    elif case == "eps-given":
        cfg["rms_norm_eps"] = 3e-5
    if case == "kv-null" and kind in ("mistral", "mixtral"):
        # transformers 5 refuses a null for these two (its field is an int); the model it means
        # is the one __post_init__ builds for the others: as many KV heads as query heads
        assert ours(cfg)["n_kv_heads"] == SHAPE["num_attention_heads"]
        return
    assert ours(cfg) == referee(kind, cfg)


@pytest.mark.parametrize(
    ("fields", "window"),
    [
        ({}, None),
        ({"use_sliding_window": False, "sliding_window": 7}, None),
        ({"use_sliding_window": True, "sliding_window": 7}, None),  # max_window_layers 28 >= 2
        ({"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 0}, 7),
        ({"use_sliding_window": True, "layer_types": ["sliding_attention"] * 2}, 4096),
        ({"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1}, "refused"),
        ({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}, None),
    ],
    ids=[
        "none",
        "off",
        "on-but-no-layer",
        "every-layer",
        "layer-types",
        "some-layers",
        "on-but-null",
    ],
)
def test_qwen2_sliding_window_as_transformers(fields: dict, window: object) -> None:
    cfg = {"model_type": "qwen2", **SHAPE, **fields}
    if window == "refused":
        kinds = T.Qwen2Config.from_dict(dict(cfg)).layer_types
        assert kinds == ["full_attention", "sliding_attention"]
        with pytest.raises(HFConfigError, match="sliding-window layers"):
            config_from_hf(cfg)
        return
    assert ours(cfg)["sliding_window"] == referee("qwen2", cfg)["sliding_window"] == window
    # written back so that transformers reads the same window
    back = config_from_hf(cfg).to_hf()
    assert referee("qwen2", back)["sliding_window"] == window


@pytest.mark.parametrize("kind", ["mistral", "mixtral"])
def test_a_null_window_is_no_window(kind: str) -> None:
    """Mistral-7B v0.2/v0.3 write ``sliding_window: null``: no window, as transformers reads it
    (it was refused as 'must be a positive int')."""
    cfg = {"model_type": kind, **SHAPE, "num_key_value_heads": 8, "sliding_window": None}
    assert ours(cfg)["sliding_window"] is referee(kind, cfg)["sliding_window"] is None
    assert referee(kind, config_from_hf(cfg).to_hf())["sliding_window"] is None


def test_a_window_transformers_llama_cannot_hold_is_refused_before_saving() -> None:
    with pytest.raises(HFConfigError, match="model_type='mistral'"):
        L.ucp_extra(L.LlamaConfig(model_type="llama", sliding_window=5))
    got = L.LlamaConfig(model_type="mistral", sliding_window=5).to_hf()
    assert T.MistralConfig.from_dict(got).sliding_window == 5


# ------------------------------------------------------------------ whole models, logits


def make_model(
    cls: type, dtype: torch.dtype = torch.float32, seed: int = 0, **kw: object
) -> object:
    """A random model whose attention is sharp enough that a wrong window or theta shows."""
    torch.manual_seed(seed)
    cfg = cls(**kw)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.5 if ("embed" in name or "gate.weight" in name) else 0.15)
    return model.to(dtype)


def loaded_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    """transformers' logits of the model it loads from ``folder`` (the referee), in float32."""
    model = T.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model.float()(torch.from_numpy(tokens).long()).logits.numpy()


def jax_logits(ckpt: object, tokens: np.ndarray, layout: Layout | None = None) -> np.ndarray:
    cfg = L.config_from_checkpoint(ckpt)
    layout = layout or Layout(tensor=2)
    mesh = L.make_mesh(layout)
    params, _ = ucp.restore(
        ckpt, L.abstract_params(cfg, layout, mesh), rules=L.ucp_rules(cfg, layout), cast=True
    )
    out = np.asarray(L.make_logits_fn(cfg, layout, mesh)(params, tokens))
    return out[..., : cfg.vocab_size]


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float((np.abs(out - ref).max(-1) / np.abs(ref).max(-1)).max())


def tokens(vocab: int, seq: int = 24) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, (2, seq)).astype(np.int32)


def edit_config(folder: Path, **changes: object) -> None:
    """Set fields of ``config.json``; a value of ``...`` removes the field."""
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97)  # fmt: skip


def test_mixtral_without_theta_and_eps_computes_what_transformers_does(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    make_model(T.MixtralConfig, **SMALL, num_local_experts=4, num_experts_per_tok=2,
               rope_theta=1e6, rms_norm_eps=1e-5).save_pretrained(src)  # fmt: skip
    edit_config(src, rope_theta=..., rope_parameters=..., rope_scaling=..., rms_norm_eps=...)
    toks = tokens(97)
    ref = loaded_logits(src, toks)
    ck = import_hf(src, tmp_path / "ck")
    assert rel_err(jax_logits(ck, toks, MoELayout(expert=2, tensor=2)), ref) <= TOL
    export_hf(ck, tmp_path / "out")
    np.testing.assert_array_equal(loaded_logits(tmp_path / "out", toks), ref)


def test_qwen2_with_every_layer_sliding_in_and_out(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    make_model(T.Qwen2Config, **SMALL, use_sliding_window=True, sliding_window=5,
               max_window_layers=0).save_pretrained(src)  # fmt: skip
    toks = tokens(97)
    ref = loaded_logits(src, toks)
    ck = import_hf(src, tmp_path / "ck")
    assert L.config_from_checkpoint(ck).sliding_window == 5
    assert rel_err(jax_logits(ck, toks), ref) <= TOL
    full = make_model(T.Qwen2Config, **SMALL)  # the window changes the logits
    full.load_state_dict(T.AutoModelForCausalLM.from_pretrained(src).state_dict())
    with torch.no_grad():
        unwindowed = full(torch.from_numpy(toks).long()).logits.numpy()
    assert rel_err(unwindowed, ref) > 1e-2
    export_hf(ck, tmp_path / "out")
    np.testing.assert_array_equal(loaded_logits(tmp_path / "out", toks), ref)


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    make_model(T.LlamaConfig, **SMALL).save_pretrained(src)  # untied: lm_head in the file
    edit_config(src, tie_word_embeddings=True)
    with pytest.raises(ucp.UcpError, match="tie_word_embeddings to false") as e:
        import_hf(src, tmp_path / "ck")
    assert "lm_head.weight" in str(e.value) and "model.embed_tokens.weight" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_tied_config_with_an_identical_lm_head_imports(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    make_model(T.LlamaConfig, **SMALL, tie_word_embeddings=True).save_pretrained(src)
    tensors = st.load_file(src / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    st.save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    toks = tokens(97)
    ck = import_hf(src, tmp_path / "ck")
    assert rel_err(jax_logits(ck, toks), loaded_logits(src, toks)) <= TOL


def test_weights_of_two_dtypes_import_as_transformers_loads_them(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    model = make_model(T.LlamaConfig, dtype=torch.bfloat16, **SMALL)
    with torch.no_grad():  # norms in float32, the rest in bfloat16 (as some releases ship)
        for name, mod in model.named_modules():
            if name.endswith("norm"):
                mod.float()
        model.model.layers[0].self_attn.k_proj.float()  # fused with a bf16 q and v
    model.save_pretrained(src)
    stored = st.load_file(src / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16, torch.float32}
    toks = tokens(97)
    ck = import_hf(src, tmp_path / "ck")
    assert rel_err(jax_logits(ck, toks), loaded_logits(src, toks)) <= TOL
    export_hf(ck, tmp_path / "out")
    back = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        back.update(st.load_file(f))
    for name, t in stored.items():  # every value back, in its dtype or (fused) float32
        assert torch.equal(back[name].to(t.dtype), t), name
        assert back[name].dtype in (t.dtype, torch.float32), name


def test_only_the_files_transformers_loads_are_read(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    make_model(T.LlamaConfig, **SMALL).save_pretrained(src)
    stray = {"base_model.model.lora_A.weight": torch.ones(4, 32)}
    st.save_file(stray, src / "adapter_model.safetensors")
    st.save_file(stray, src / "consolidated.safetensors")
    toks = tokens(97)
    ck = import_hf(src, tmp_path / "ck")
    assert rel_err(jax_logits(ck, toks), loaded_logits(src, toks)) <= TOL
    assert ucp.open(ck).manifest.source["huggingface"]["files"] == ["model.safetensors"]


def test_the_file_transformers_loads_wins_over_a_stale_index(tmp_path: Path) -> None:
    """``save_pretrained`` sharded, then unsharded into the same folder: the old index stays
    beside the new ``model.safetensors`` (its shards are deleted). transformers loads the file;
    the import read the index (a missing shard, or, shards present, the older weights)."""
    src = tmp_path / "hf"
    make_model(T.LlamaConfig, seed=1, **SMALL).save_pretrained(src, max_shard_size="20KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    old_shards = {f: (src / f).read_bytes() for f in set(index["weight_map"].values())}
    make_model(T.LlamaConfig, seed=2, **SMALL).save_pretrained(src)
    assert (src / "model.safetensors.index.json").exists() and (src / "model.safetensors").exists()
    toks = tokens(97)
    ref = loaded_logits(src, toks)
    assert rel_err(jax_logits(import_hf(src, tmp_path / "a"), toks), ref) <= TOL
    for f, data in old_shards.items():  # the older weights back in their shards: still the file
        (src / f).write_bytes(data)
    assert (
        rel_err(jax_logits(import_hf(src, tmp_path / "b"), toks), loaded_logits(src, toks)) <= TOL
    )
    assert np.abs(loaded_logits(src, toks) - ref).max() == 0


def test_the_weights_config_json_names_are_read(tmp_path: Path) -> None:
    """``transformers_weights`` in config.json names the file transformers loads; a name that is
    no safetensors file is refused, and one leaving the folder too."""
    src = tmp_path / "hf"
    make_model(T.LlamaConfig, seed=1, **SMALL).save_pretrained(src)
    other = tmp_path / "other"
    make_model(T.LlamaConfig, seed=2, **SMALL).save_pretrained(other)
    os.replace(other / "model.safetensors", src / "chosen.safetensors")
    edit_config(src, transformers_weights="chosen.safetensors")
    toks = tokens(97)
    ck = import_hf(src, tmp_path / "ck")
    assert rel_err(jax_logits(ck, toks), loaded_logits(src, toks)) <= TOL
    assert ucp.open(ck).manifest.source["huggingface"]["files"] == ["chosen.safetensors"]
    for bad, match in [("pytorch_model.bin", "transformers_weights"), ("../x.safetensors", "..")]:
        edit_config(src, transformers_weights=bad)
        with pytest.raises(ucp.UcpError, match=match):
            import_hf(src, tmp_path / "bad")
        assert not (tmp_path / "bad").exists()


def test_pickled_weights_only_are_refused_with_the_fix(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    model = make_model(T.LlamaConfig, **SMALL)
    model.save_pretrained(src)
    os.remove(src / "model.safetensors")
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    T.AutoModelForCausalLM.from_pretrained(src)  # transformers reads it
    with pytest.raises(ucp.NotACheckpointError, match=r"pytorch_model\.bin") as e:
        import_hf(src, tmp_path / "ck")
    assert "save_pretrained" in str(e.value)
    assert not (tmp_path / "ck").exists()


def test_generation_config_goes_through(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    model = make_model(T.LlamaConfig, **SMALL)
    model.generation_config = T.GenerationConfig(
        eos_token_id=[2, 7, 9], pad_token_id=0, do_sample=True, temperature=0.6, top_p=0.9,
        max_length=77,
    )  # fmt: skip
    model.save_pretrained(src)
    ck = import_hf(src, tmp_path / "ck")
    export_hf(ck, tmp_path / "out")
    want = T.GenerationConfig.from_pretrained(src).to_dict()
    got = T.GenerationConfig.from_pretrained(tmp_path / "out").to_dict()
    want.pop("transformers_version"), got.pop("transformers_version")
    assert got == want and got["eos_token_id"] == [2, 7, 9]
    # a model trained in JAX and saved with ucp_extra(cfg, source=<its import>) keeps it too
    cfg = L.config_from_checkpoint(ck)
    params, _ = ucp.restore(ck, L.abstract_params(cfg, Layout(), L.make_mesh(Layout())),
                            rules=L.ucp_rules(cfg, Layout()))  # fmt: skip
    ucp.save(tmp_path / "ft", params, rules=L.ucp_rules(cfg, Layout()),
             extra=L.ucp_extra(cfg, source=ck))  # fmt: skip
    export_hf(tmp_path / "ft", tmp_path / "out_ft")
    got = T.GenerationConfig.from_pretrained(tmp_path / "out_ft").to_dict()
    got.pop("transformers_version")
    assert got == want
    # a folder without one exports without one (transformers then derives it from config.json)
    src2 = tmp_path / "hf2"
    shutil.copytree(src, src2)
    os.remove(src2 / "generation_config.json")
    export_hf(import_hf(src2, tmp_path / "ck2"), tmp_path / "out2")
    assert not (tmp_path / "out2" / "generation_config.json").exists()


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "uint16", "complex64", "bf17"])
def test_a_dtype_no_model_loads_is_refused_before_writing(tmp_path: Path, dtype: str) -> None:
    src = tmp_path / "hf"
    make_model(T.LlamaConfig, **SMALL).save_pretrained(src)
    with pytest.raises(ucp.UcpError, match="float32', 'bfloat16', 'float16'"):
        import_hf(src, tmp_path / "ck", dtype=dtype)
    assert not (tmp_path / "ck").exists()
    ck = import_hf(src, tmp_path / "ck")
    with pytest.raises(ucp.UcpError, match=f"dtype '{dtype}'"):
        export_hf(ck, tmp_path / "out", dtype=dtype)
    assert not (tmp_path / "out").exists()


def test_short_dtype_names_cast_as_torch(tmp_path: Path) -> None:
    src = tmp_path / "hf"
    make_model(T.LlamaConfig, **SMALL).save_pretrained(src)
    ck = import_hf(src, tmp_path / "ck", dtype="bf16")
    export_hf(ck, tmp_path / "out", dtype="fp32")
    export_hf(ck, tmp_path / "out16", dtype="fp16")
    source = st.load_file(src / "model.safetensors")
    (f32,) = (tmp_path / "out").glob("*.safetensors")
    (f16,) = (tmp_path / "out16").glob("*.safetensors")
    a, b = st.load_file(f32), st.load_file(f16)
    for name, t in source.items():
        assert torch.equal(a[name], t.bfloat16().float()), name
        assert torch.equal(b[name], t.bfloat16().half()), name
