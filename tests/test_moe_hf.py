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
