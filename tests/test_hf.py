"""Hugging Face Llama / Mistral / Qwen2 in and out, with transformers as the referee.

Random-init models from small configs (nothing downloaded): import_hf -> restore onto several
layouts -> logits equal transformers' at every position; export_hf -> from_pretrained -> equal again;
HF -> JAX -> train on a mesh -> export -> transformers equals the JAX model.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

import jax  # noqa: E402

import ucp_jax as ucp  # noqa: E402
from ucp_jax.demo import Layout, init_opt_state, make_optimizer  # noqa: E402
from ucp_jax.demo.train import abstract_opt_state  # noqa: E402
from ucp_jax.models import llama as L  # noqa: E402
from ucp_jax.torch import export_hf, import_hf  # noqa: E402

TOL = 1e-5  # max |logit difference| / max |logit| at each position
SEQ, BATCH = 24, 2
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=203)

# name -> (transformers config class, kwargs, layouts to restore onto)
CASES = {
    "llama-gqa-untied": (
        T.LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2),
        [Layout(), Layout(data=4, tensor=2), Layout(stages=2, tensor=2), Layout(fsdp=4, tensor=2)],
    ),
    "llama-mha-tied-theta": (
        T.LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
             rope_theta=500.0),
        [Layout(tensor=4), Layout(stages=2, data=2, tensor=2), Layout(fsdp=2, tensor=4)],
    ),
    "llama3-rope-headdim": (
        T.LlamaConfig,
        dict(num_attention_heads=8, num_key_value_heads=4, head_dim=12, rope_theta=50000.0,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        [Layout(data=2, tensor=4), Layout(stages=2, tensor=2), Layout(fsdp=8)],
    ),
    "llama-linear-rope": (
        T.LlamaConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling={"rope_type": "linear",
                                                                         "factor": 4.0}),
        [Layout(), Layout(tensor=2), Layout(stages=2, fsdp=2)],
    ),
    "mistral-window": (
        T.MistralConfig,
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=7),
        [Layout(tensor=2), Layout(stages=2, tensor=2), Layout(fsdp=4)],
    ),
    "qwen2-bias-tied": (
        T.Qwen2Config,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        [Layout(data=4, tensor=2), Layout(stages=2, tensor=2), Layout(fsdp=2, tensor=2)],
    ),
}  # fmt: skip
MEASURED: dict[str, float] = {}


def hf_model(kind: str, seed: int = 0) -> tuple[object, object]:
    """A random transformers model of a case, with weights large enough to make attention sharp."""
    cls, kw, _ = CASES[kind]
    cfg = cls(**BASE, **kw, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if "embed" in name else 0.15)
    return cfg, model


def hf_logits(model: object, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """Largest over positions of max |out - ref| / max |ref| (the logit scale at that position)."""
    return float((np.abs(out - ref).max(-1) / np.abs(ref).max(-1)).max())


def jax_logits(ckpt: str, cfg: L.LlamaConfig, layout: Layout, tokens: np.ndarray) -> np.ndarray:
    mesh = L.make_mesh(layout)
    params, _ = ucp.restore(
        ckpt, L.abstract_params(cfg, layout, mesh), rules=L.ucp_rules(cfg, layout), cast=True
    )
    return np.asarray(L.make_logits_fn(cfg, layout, mesh)(params, tokens))


def tokens_for(cfg: L.LlamaConfig, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """case -> (hf model, hf folder, universal checkpoint)."""
    out = {}
    root = tmp_path_factory.mktemp("hf")
    for kind in CASES:
        _, model = hf_model(kind)
        src = root / kind
        shard = "40KB" if kind.startswith("mistral") else "5GB"  # mistral: sharded + index
        model.save_pretrained(src, max_shard_size=shard)
        out[kind] = (model, src, import_hf(src, root / f"{kind}.ucp"))
    return out


@pytest.mark.parametrize("kind", list(CASES))
def test_import_logits_equal_transformers(kind: str, imported: dict) -> None:
    model, _, ckpt = imported[kind]
    cfg = L.config_from_checkpoint(ckpt)
    tokens = tokens_for(cfg)
    ref = hf_logits(model, tokens)
    for layout in CASES[kind][2]:
        err = rel_err(jax_logits(ckpt, cfg, layout, tokens)[..., : cfg.vocab_size], ref)
        MEASURED[f"{kind} {layout.name}"] = err
        print(f"{kind:22s} {layout.name:14s} max rel logit diff {err:.2e}")
        assert err <= TOL, f"{kind} on {layout.name}: {err:.2e}"


def test_rope_matters(imported: dict) -> None:
    """The comparison is sensitive: a wrong rope_theta or no rope scaling is far off."""
    for kind, change in (("llama-gqa-untied", {"rope_theta": 20000.0}),
                         ("llama3-rope-headdim", {"rope_scaling": ()}),
                         ("mistral-window", {"sliding_window": None})):  # fmt: skip
        model, _, ckpt = imported[kind]
        cfg = L.config_from_checkpoint(ckpt)
        tokens = tokens_for(cfg)
        wrong = dataclasses.replace(cfg, **change)
        err = rel_err(jax_logits(ckpt, wrong, Layout(), tokens), hf_logits(model, tokens))
        assert err > 1e-2, f"{kind} with {change}: {err:.2e}"


def test_import_records_config_and_patterns(imported: dict) -> None:
    _, _src, ckpt = imported["qwen2-bias-tied"]
    ck = ucp.open(ckpt)
    assert ck.manifest.extra["hf_config"]["model_type"] == "qwen2"
    assert "unembed.kernel" not in ck.atoms  # tied
    assert ck.atoms["blocks.0.attn.qkv.bias"].fused == [{"sizes": [64, 32, 32], "axis": 0}]
    assert ck.manifest.source["huggingface"]["model_type"] == "qwen2"


@pytest.mark.parametrize("kind", ["llama-gqa-untied", "qwen2-bias-tied", "llama3-rope-headdim"])
def test_export_from_pretrained_equal(
    kind: str, imported: dict, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ucp_jax._src.frameworks.hf import export as hf_export
    from ucp_jax._src.frameworks.hf import read as hf

    monkeypatch.setattr(hf_export, "BLOCK_BYTES", 1000)  # tensors go out in many row blocks
    monkeypatch.setattr(hf, "RELEASE_BYTES", 1000)  # and source pages are released often
    model, _, ckpt = imported[kind]
    if kind.startswith("llama3"):  # re-import with the small release threshold
        ckpt = import_hf(imported[kind][1], tmp_path / "again")
    dst = tmp_path / "out"
    export_hf(ckpt, dst, max_shard_size="30KB")
    files = sorted(os.listdir(dst))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and all(f"-of-{len(shards):05d}" in f for f in shards)
    assert {"config.json", "model.safetensors.index.json"} <= set(files)
    back, info = T.AutoModelForCausalLM.from_pretrained(
        dst, output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    sd, sd0 = back.state_dict(), model.state_dict()
    for k, v in sd0.items():
        assert torch.equal(sd[k], v), k  # bit-identical weights
    tokens = tokens_for(L.config_from_checkpoint(ckpt))
    assert rel_err(hf_logits(back.eval(), tokens), hf_logits(model, tokens)) == 0.0


def test_hf_train_on_mesh_export(imported: dict, tmp_path: object) -> None:
    """HF -> JAX (pp2-tp2) -> 3 Adam steps -> save -> export -> transformers == the JAX model."""
    model, _, ckpt = imported["llama-gqa-untied"]
    cfg = L.config_from_checkpoint(ckpt)
    layout = Layout(stages=2, data=2, tensor=2)
    mesh = L.make_mesh(layout)
    opt = make_optimizer(learning_rate=1e-2)
    target = L.abstract_params(cfg, layout, mesh)
    params, _ = ucp.restore(ckpt, target, rules=L.ucp_rules(cfg, layout))
    opt_state = init_opt_state(opt, params)
    step = L.make_train_step(cfg, layout, mesh, opt)
    losses = []
    for s in range(3):
        params, opt_state, loss = step(params, opt_state, L.batch(cfg, s, 4, 16, mesh))
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    saved = tmp_path / "trained"
    ucp.save(saved, params, opt_state, step=3, rules=L.ucp_rules(cfg, layout),
             extra=L.ucp_extra(cfg))  # fmt: skip
    tokens = tokens_for(cfg, seed=5)
    ours = np.asarray(L.make_logits_fn(cfg, layout, mesh)(params, tokens))
    export_hf(saved, tmp_path / "hf_out")
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", attn_implementation="eager")
    theirs = hf_logits(back.eval(), tokens)
    err = rel_err(ours, theirs)
    MEASURED["trained pp2-dp2-tp2 -> export"] = err
    assert err <= TOL and rel_err(theirs, hf_logits(model, tokens)) > 1e-3
    # the optimizer state travels too: resume on another layout, same next loss
    lay_b = Layout(fsdp=4, tensor=2)
    mesh_b = L.make_mesh(lay_b)
    pt = L.abstract_params(cfg, lay_b, mesh_b)
    p_b, o_b = ucp.restore(saved, pt, abstract_opt_state(opt, pt), rules=L.ucp_rules(cfg, lay_b))
    _, _, loss_b = L.make_train_step(cfg, lay_b, mesh_b, opt)(
        p_b, o_b, L.batch(cfg, 3, 4, 16, mesh_b)
    )
    _, _, loss_a = step(params, opt_state, L.batch(cfg, 3, 4, 16, mesh))
    assert abs(float(loss_b) / float(loss_a) - 1) <= TOL


def test_canonical_init_roundtrip() -> None:
    cfg = L.config_from_hf({**BASE, "model_type": "qwen2", "num_attention_heads": 4,
                            "num_key_value_heads": 2})  # fmt: skip
    canon = L.init_canonical(cfg)
    for layout in (Layout(stages=2, tensor=2), Layout(fsdp=2, tensor=2)):
        back = L.from_layout(L.to_layout(canon, cfg, layout, L.make_mesh(layout)), cfg, layout)
        assert all(np.array_equal(back[k], v) for k, v in canon.items())
    assert jax.device_count() == 8


def test_custom_model_mapping_roundtrip(tmp_path: object) -> None:
    """A user's own params, saved with a Fused rule, exported with an AtomFrom mapping, imported back."""
    import safetensors.numpy

    from ucp_jax.torch import AtomFrom, import_safetensors

    rng = np.random.default_rng(0)
    params = {
        "wte": {"embedding": rng.standard_normal((10, 4), dtype=np.float32)},
        "h": {str(i): {"qkv": {"kernel": rng.standard_normal((4, 12), dtype=np.float32)}}
              for i in range(2)},
    }  # fmt: skip
    rules = [(r"h\.\d+\.qkv\.kernel", ucp.Fused((4, 4, 4), axis=1))]
    ucp.save(tmp_path / "mine", params, rules=rules)
    mapping = {
        "wte.embedding": AtomFrom(("tok.weight",)),
        "h.{i}.qkv.kernel": AtomFrom(
            tuple(f"layers.{{i}}.{p}.weight" for p in "qkv"), transpose=True, axis=1
        ),
    }
    export_hf(tmp_path / "mine", tmp_path / "hf", mapping=mapping, config={"model_type": "mine"})
    (shard,) = [f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]
    got = safetensors.numpy.load_file(tmp_path / "hf" / shard)
    assert np.array_equal(got["tok.weight"], params["wte"]["embedding"])
    for i in range(2):
        k = params["h"][str(i)]["qkv"]["kernel"]
        for j, p in enumerate("qkv"):
            assert np.array_equal(got[f"layers.{i}.{p}.weight"], k[:, 4 * j : 4 * j + 4].T)
    back = import_safetensors(tmp_path / "hf", tmp_path / "back", preset=mapping)
    ck = ucp.open(back)
    assert np.array_equal(ck.read("h.1.qkv.kernel"), params["h"]["1"]["qkv"]["kernel"])
    with pytest.raises(ucp.MismatchError, match="no Hugging Face name"):
        export_hf(
            tmp_path / "mine", tmp_path / "hf2", mapping={"wte.embedding": mapping["wte.embedding"]}
        )
