"""A Hugging Face Mixtral fine-tuned under DeepSpeed ZeRO-3 (2 ranks, the HF Trainer's folder:
config.json beside global_step3/) -> `ucp convert deepspeed` names its atoms as `import_hf` does,
experts included, for transformers' fused (v5) and per-expert (before v5) layouts.

Referees: DeepSpeed's own `zero_to_fp32` (every weight), the engine's state at the save (every
Adam moment), transformers (the JAX Mixtral's logits on two meshes; `ucp export hf` of the import
loaded with `from_pretrained`)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

import jax  # noqa: E402
from ds.hf_moe_fixtures import CASES, STEPS, hf_moe_ckpts  # noqa: E402, F401

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main as ucp_main  # noqa: E402
from ucp_jax._src.errors import MismatchError  # noqa: E402
from ucp_jax._src.frameworks.common.hf_names import expand, hf_mapping  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.zero import import_deepspeed  # noqa: E402
from ucp_jax._src.llama_config import HFConfigError  # noqa: E402
from ucp_jax.demo import make_optimizer  # noqa: E402
from ucp_jax.models import llama as L  # noqa: E402
from ucp_jax.models.moe import MoELayout  # noqa: E402
from ucp_jax.models.placement import abstract_opt_state  # noqa: E402

E, F = 4, 48  # the script's experts and intermediate size


def canonical(sd: dict, cfg: L.LlamaConfig) -> dict[str, np.ndarray]:
    """The atoms import_hf's mapping gives, from torch-named tensors of either expert layout
    (written apart from the importer)."""
    t = {k: v.detach().float().numpy() for k, v in sd.items()}
    out = {"embed.embedding": t["model.embed_tokens.weight"], "ln_f.scale": t["model.norm.weight"],
           "unembed.kernel": t["lm_head.weight"].T}  # fmt: skip
    for i in range(cfg.n_layers):
        p, b = f"model.layers.{i}.", f"blocks.{i}."
        qkv = [t[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        out |= {b + "attn.qkv.kernel": np.concatenate(qkv).T,
                b + "attn.out.kernel": t[p + "self_attn.o_proj.weight"].T,
                b + "ln1.scale": t[p + "input_layernorm.weight"],
                b + "ln2.scale": t[p + "post_attention_layernorm.weight"]}  # fmt: skip
        fused = p + "mlp.experts.gate_up_proj" in t
        moe = p + ("mlp." if fused else "block_sparse_moe.")
        out[b + "router.kernel"] = t[moe + "gate.weight"].T
        for e in range(E):
            if fused:
                gate_up, down = t[moe + "experts.gate_up_proj"][e], t[moe + "experts.down_proj"][e]
            else:
                w = moe + f"experts.{e}.w"
                gate_up = np.concatenate([t[w + "1.weight"], t[w + "3.weight"]])
                down = t[w + "2.weight"]
            out[b + f"experts.{e}.gate_up.kernel"] = gate_up.T
            out[b + f"experts.{e}.down.kernel"] = down.T
    return out


@pytest.fixture(scope="module")
def imported(hf_moe_ckpts, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("hf_moe")
    return {n: import_deepspeed(hf_moe_ckpts.path(n), root / n, progress=False) for n in CASES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_import_names_atoms_as_import_hf(name, hf_moe_ckpts, imported):  # noqa: F811
    """config.json beside the checkpoint is found; the atoms are import_hf's (one per expert);
    every weight equals DeepSpeed's zero_to_fp32, every moment the engine's, step is 3."""
    ck = ucp.open(imported[name])
    cfg = L.config_from_checkpoint(ck)
    assert (cfg.model_type, cfg.n_experts, cfg.top_k) == ("mixtral", E, 2)
    assert set(ck.atoms) == set(expand(hf_mapping(cfg), cfg.n_layers))
    layout = "fused" if CASES[name][1] == "fused" else "per-expert"
    assert ck.manifest.source["huggingface"]["experts"] == layout
    engine = hf_moe_ckpts.engine_state(name)
    want = {"fp32": canonical(hf_moe_ckpts.zero_to_fp32(name), cfg)}
    for slot in ("exp_avg", "exp_avg_sq"):
        want[slot] = canonical({k: v[slot] for k, v in engine.items()}, cfg)
    np.testing.assert_array_equal(  # the engine and zero_to_fp32 agree on the weights
        want["fp32"]["blocks.1.experts.3.gate_up.kernel"],
        canonical({k: v["fp32"] for k, v in engine.items()}, cfg)["blocks.1.experts.3.gate_up.kernel"],
    )  # fmt: skip
    for slot, atoms in want.items():
        for atom, w in atoms.items():
            got = ck.read(atom, slot)
            assert got.dtype == np.float32 and got.shape == w.shape, (atom, slot)
            np.testing.assert_array_equal(got, w, err_msg=f"{name} {atom} {slot}")
        assert float(ck.read("blocks.0.experts.2.down.kernel", "step")) == STEPS
    fused = ck.atoms["blocks.0.experts.1.gate_up.kernel"].fused
    assert [(list(f["sizes"]), f["axis"]) for f in fused] == [([F, F], 1)]
    assert ck.step == STEPS


def _reference_model(hf_moe_ckpts, name: str):  # noqa: F811
    """transformers' Mixtral holding DeepSpeed's zero_to_fp32 weights (transformers 5 names)."""
    cfg = T.AutoConfig.from_pretrained(hf_moe_ckpts.path(name))
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    sd = hf_moe_ckpts.zero_to_fp32(name)
    for i in range(
        cfg.num_hidden_layers
    ):  # the per-expert layout, fused as transformers 5 holds it
        p = f"model.layers.{i}.block_sparse_moe."
        if p + "gate.weight" in sd:
            w = [[sd.pop(p + f"experts.{e}.w{k}.weight") for e in range(E)] for k in (1, 2, 3)]
            q = f"model.layers.{i}.mlp."
            sd[q + "gate.weight"] = sd.pop(p + "gate.weight")
            sd[q + "experts.gate_up_proj"] = torch.stack(
                [torch.cat([a, c]) for a, c in zip(w[0], w[2])]
            )
            sd[q + "experts.down_proj"] = torch.stack(w[1])
    model.load_state_dict(sd, strict=True)
    return model


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def _rel(out: np.ndarray, ref: np.ndarray) -> float:
    return float((np.abs(out - ref).max(-1) / np.abs(ref).max(-1)).max())


def test_jax_mixtral_restores_with_moments(hf_moe_ckpts, imported):  # noqa: F811
    """The JAX Mixtral restored with its Adam moments on two meshes: logits equal transformers'
    holding zero_to_fp32's weights (<= 1e-4 relative); the restored first moment of an expert is
    the engine's."""
    ckpt = imported["hm_fused"]
    cfg = L.config_from_checkpoint(ckpt)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    ref = _hf_logits(_reference_model(hf_moe_ckpts, "hm_fused"), tokens)
    want_mu = ucp.open(ckpt).read("blocks.1.experts.2.gate_up.kernel", "exp_avg")
    opt = make_optimizer(learning_rate=1e-2)
    for layout in (MoELayout(expert=2, tensor=2, data=2), MoELayout(stages=2, expert=4)):
        mesh = L.make_mesh(layout)
        target = L.abstract_params(cfg, layout, mesh)
        params, opt_state = ucp.restore(ckpt, target, abstract_opt_state(opt, target),
                                        rules=L.ucp_rules(cfg, layout))  # fmt: skip
        err = _rel(np.asarray(L.make_logits_fn(cfg, layout, mesh)(params, tokens)), ref)
        print(f"\nZeRO-3 Mixtral -> {layout.name}: logits rel err {err:.2e}")
        assert err <= 1e-4
        mu = next(s.mu for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))
                  if hasattr(s, "mu"))  # fmt: skip
        got = L.from_layout(mu, cfg, layout)["blocks.1.experts.2.gate_up.kernel"]
        np.testing.assert_array_equal(got, want_mu)


@pytest.mark.parametrize("name", ["hm_fused_bf16", "hm_per_expert"])
def test_export_hf_loads_in_transformers(name, hf_moe_ckpts, imported, tmp_path):  # noqa: F811
    """`ucp export hf` of the import: from_pretrained loads every weight, and its logits are those
    of transformers holding zero_to_fp32's weights."""
    assert ucp_main(["export", "hf", str(imported[name]), str(tmp_path / "hf")]) == 0
    back, info = T.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ref_model = _reference_model(hf_moe_ckpts, name)
    for k, v in ref_model.state_dict().items():
        assert torch.equal(back.state_dict()[k].float(), v), k
    tokens = np.random.default_rng(4).integers(0, 97, (2, 12)).astype(np.int32)
    assert _rel(_hf_logits(back.float().eval(), tokens), _hf_logits(ref_model, tokens)) <= 1e-6


def test_cli_hf_config_options(hf_moe_ckpts, tmp_path):  # noqa: F811
    """--no-hf-config keeps the torch names; --hf-config of another model is refused by name."""
    src = hf_moe_ckpts.path("hm_fused")
    assert ucp_main(["convert", "deepspeed", src, str(tmp_path / "raw"), "--no-hf-config"]) == 0
    raw = ucp.open(str(tmp_path / "raw"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in raw.atoms and raw.manifest.extra is None
    with open(os.path.join(src, "config.json")) as f:
        other = json.load(f)
    other["num_hidden_layers"] = 3
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(MismatchError, match=r"model\.layers\.2\..* are missing"):
        import_deepspeed(src, tmp_path / "bad", hf_config=str(tmp_path / "other.json"))
    assert not os.path.exists(tmp_path / "bad")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ucp-raw-")]  # temporary gone
    assert ucp_main(["convert", "deepspeed", src, str(tmp_path / "c"), "--hf-config",
                     str(tmp_path / "other.json")]) == 1  # fmt: skip


def test_config_json_beside_is_untrusted(hf_moe_ckpts, tmp_path):  # noqa: F811
    """A damaged config.json is refused with the file named and the way around it; one of a
    model family the JAX model does not implement is set aside (recorded), torch names kept."""
    folder = tmp_path / "ck"
    shutil.copytree(hf_moe_ckpts.path("hm_fused"), folder)
    (folder / "config.json").write_bytes(b'{"model_type": ' + b"[" * 200 + b"]" * 200 + b"}")
    with pytest.raises(HFConfigError, match=r"config\.json.*--no-hf-config"):
        import_deepspeed(str(folder), tmp_path / "a")
    assert not os.path.exists(tmp_path / "a")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_moe"}))
    ck = ucp.open(import_deepspeed(str(folder), tmp_path / "b"))
    assert "qwen2_moe" in ck.manifest.source["deepspeed"]["hf_config_skipped"]
    assert "model.embed_tokens.weight" in ck.atoms
    os.remove(folder / "config.json")  # a link out of the folder is not followed
    os.symlink(os.path.join(hf_moe_ckpts.path("hm_fused"), "config.json"), folder / "config.json")
    ck = ucp.open(import_deepspeed(str(folder), tmp_path / "c"))
    assert "symbolic link" in ck.manifest.source["deepspeed"]["hf_config_skipped"]
