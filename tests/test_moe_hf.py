"""Hugging Face Mixtral in and out, with transformers as the referee (random init, nothing downloaded).

import_hf -> restore onto expert-parallel layouts -> logits equal transformers' at every position;
train on an EP x TP mesh -> save -> export_hf -> from_pretrained -> transformers equals the JAX model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

import ucp_jax as ucp  # noqa: E402
from ucp_jax.demo import init_opt_state, make_optimizer  # noqa: E402
from ucp_jax.models import llama as L  # noqa: E402
from ucp_jax.models.moe import MoELayout  # noqa: E402
from ucp_jax.torch import export_hf, import_hf  # noqa: E402

TOL = 1e-5  # max |logit difference| / max |logit| at each position
SEQ, BATCH = 24, 2
LAYOUTS = [
    MoELayout(expert=4),
    MoELayout(expert=2, tensor=2, data=2),
    MoELayout(stages=2, expert=2),
]


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """Largest over positions of max |out - ref| / max |ref| (the logit scale at that position)."""
    return float((np.abs(out - ref).max(-1) / np.abs(ref).max(-1)).max())


def hf_logits(model: object, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()  # type: ignore[operator]


def jax_logits(ckpt: Path, cfg: L.LlamaConfig, layout: MoELayout, tokens: np.ndarray) -> np.ndarray:
    mesh = L.make_mesh(layout)
    target = L.abstract_params(cfg, layout, mesh)
    params, _ = ucp.restore(ckpt, target, rules=L.ucp_rules(cfg, layout), cast=True)
    return np.asarray(L.make_logits_fn(cfg, layout, mesh)(params, tokens))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path, Path]:
    """(transformers model, its folder, the imported universal checkpoint)."""
    cfg = T.MixtralConfig(
        vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        rms_norm_eps=1e-5, sliding_window=9,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if "embed" in name or "gate.weight" in name else 0.15)
    root = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(root / "hf")
    return model, root / "hf", Path(import_hf(root / "hf", root / "ucp"))


def test_import_has_one_atom_per_expert(mixtral: tuple) -> None:
    _, _, ckpt = mixtral
    cfg = L.config_from_checkpoint(ckpt)
    assert (cfg.model_type, cfg.n_experts, cfg.top_k, cfg.sliding_window) == ("mixtral", 4, 2, 9)
    atoms = set(ucp.Checkpoint(ckpt).manifest.atoms)
    assert {f"blocks.1.experts.{e}.gate_up.kernel" for e in range(4)} <= atoms
    assert "blocks.0.router.kernel" in atoms and not any(".mlp." in a for a in atoms)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_import_logits_equal_transformers(layout: MoELayout, mixtral: tuple) -> None:
    model, _, ckpt = mixtral
    cfg = L.config_from_checkpoint(ckpt)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)
    err = rel_err(jax_logits(ckpt, cfg, layout, tokens), hf_logits(model, tokens))
    print(f"\nmixtral import -> {layout.name}: logits rel err {err:.2e}")
    assert err <= TOL


def test_train_on_ep_mesh_export_from_pretrained(mixtral: tuple, tmp_path: Path) -> None:
    """HF -> JAX (ep2-tp2) -> 2 Adam steps -> save -> export -> transformers == the JAX model."""
    model, _, ckpt = mixtral
    cfg = L.config_from_checkpoint(ckpt)
    layout = MoELayout(expert=2, tensor=2, data=2)
    mesh = L.make_mesh(layout)
    opt = make_optimizer(learning_rate=1e-2)
    rules = L.ucp_rules(cfg, layout)
    params, _ = ucp.restore(ckpt, L.abstract_params(cfg, layout, mesh), rules=rules)
    opt_state = init_opt_state(opt, params)
    step = L.make_train_step(cfg, layout, mesh, opt)
    for s in range(2):
        params, opt_state, _ = step(params, opt_state, L.batch(cfg, s, 4, 16, mesh))
    ucp.save(tmp_path / "trained", params, opt_state, step=2, rules=rules, extra=L.ucp_extra(cfg))
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)
    ours = np.asarray(L.make_logits_fn(cfg, layout, mesh)(params, tokens))
    export_hf(tmp_path / "trained", tmp_path / "hf_out")
    back, info = T.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf_out", output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    theirs = hf_logits(back.eval(), tokens)
    err = rel_err(ours, theirs)
    print(f"\nmixtral trained on {layout.name} -> export -> transformers: rel err {err:.2e}")
    assert err <= TOL and rel_err(theirs, hf_logits(model, tokens)) > 1e-3
    # the untrained import exports bit-identical weights
    export_hf(ckpt, tmp_path / "hf_same")
    same = T.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_same", attn_implementation="eager")
    sd = same.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def _state_dict_folder(model: object, folder: Path, config_from: Path) -> Path:
    """A folder holding the model's own ``state_dict()`` (transformers 5's fused experts) as
    ``model.safetensors``, the way ``safetensors.torch.save_file`` writes it, beside its config."""
    st = pytest.importorskip("safetensors.torch")
    folder.mkdir()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    st.save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_bytes((config_from / "config.json").read_bytes())
    return folder


def test_fused_experts_of_a_state_dict_import_as_save_pretrained_ones(
    mixtral: tuple, tmp_path: Path
) -> None:
    """transformers loads a file of fused experts (``mlp.experts.gate_up_proj [E, 2F, D]``) as
    well as save_pretrained's per-expert one; both import to the same atoms, bit for bit (the
    fused one was refused as 'a shard is missing')."""
    model, hf, ckpt = mixtral
    src = _state_dict_folder(model, tmp_path / "fused", hf)
    tokens = np.random.default_rng(2).integers(0, 203, (BATCH, SEQ)).astype(np.int32)
    loaded = T.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").float()
    assert np.array_equal(hf_logits(loaded.eval(), tokens), hf_logits(model, tokens))  # referee
    fused = ucp.Checkpoint(import_hf(src, tmp_path / "ucp"))
    ref = ucp.Checkpoint(ckpt)
    assert set(fused.manifest.atoms) == set(ref.manifest.atoms)
    for atom in ref.manifest.atoms:
        a, b = fused.read(atom, "fp32"), ref.read(atom, "fp32")
        assert a.dtype == b.dtype and np.array_equal(a, b), atom
    assert fused.manifest.atoms["blocks.0.experts.1.gate_up.kernel"].fused  # [gate | up] recorded


def test_a_fused_expert_tensor_of_the_wrong_count_is_refused(
    mixtral: tuple, tmp_path: Path
) -> None:
    model, hf, _ = mixtral
    src = _state_dict_folder(model, tmp_path / "fused", hf)
    cfg = (
        (src / "config.json")
        .read_text()
        .replace('"num_local_experts": 4', '"num_local_experts": 3')
    )
    (src / "config.json").write_text(cfg)
    with pytest.raises(
        ucp.UcpError,
        match=r"experts\.(gate_up|down)_proj' has shape \[4, \d+, \d+\]; expected \[3 experts",
    ):
        import_hf(src, tmp_path / "ucp")
    assert not (tmp_path / "ucp").exists()
