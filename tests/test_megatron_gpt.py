"""Megatron-Core GPT-style (LayerNorm, GELU, biases, tied embeddings, learned or RoPE positions) and
mixture-of-experts (SequentialMLP experts under expert parallelism) checkpoints, both ways.

Referees: torch's own `dcp_to_torch_save` of each folder (every tensor and moment), Megatron's own
forward (the JAX model's logits on two meshes), and Megatron itself loading our exports at another
TP / PP / EP (the loss of a fixed batch; the next steps' losses equal those of Megatron resumed
from its own checkpoint at that layout, where Megatron can load its own)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mcore.gpt_fixtures import (  # noqa: E402, F401
    CASES,
    EXPORTS,
    HEADS,
    MODELS,
    RESUMES,
    TOP_K,
    VOCAB,
    mcore_gpt_ckpts,
)

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main as ucp_main  # noqa: E402
from ucp_jax._src.frameworks.megatron.common import MegatronFormatError  # noqa: E402
from ucp_jax._src.frameworks.megatron.export import MegatronExportError, export_megatron  # noqa: E402
from ucp_jax._src.frameworks.megatron.read import import_megatron  # noqa: E402
from ucp_jax.models import llama as L  # noqa: E402
from ucp_jax.models.moe import MoELayout  # noqa: E402
from ucp_jax.models.parallel import Layout  # noqa: E402

QPG, HD, GROUPS, LAYERS, EXPERTS = 2, 8, 2, 4, 4  # the script's GQA: 4 heads of 8 in 2 groups
L_, X_ = "decoder.layers.", "decoder.layers.mlp.experts.experts."
ATOMS = {  # Megatron tensor -> atom (after blocks.{i}. / blocks.{i}.experts.{e}.)
    "embedding.word_embeddings.weight": "embed.embedding",
    "embedding.position_embeddings.weight": "pos_embed.embedding",
    "output_layer.weight": "unembed.kernel",
    "decoder.final_layernorm.weight": "ln_f.scale",
    "decoder.final_layernorm.bias": "ln_f.bias",
    L_ + "self_attention.linear_qkv.layer_norm_weight": "ln1.scale",
    L_ + "self_attention.linear_qkv.layer_norm_bias": "ln1.bias",
    L_ + "self_attention.linear_qkv.weight": "attn.qkv.kernel",
    L_ + "self_attention.linear_qkv.bias": "attn.qkv.bias",
    L_ + "self_attention.linear_proj.weight": "attn.out.kernel",
    L_ + "self_attention.linear_proj.bias": "attn.out.bias",
    L_ + "mlp.linear_fc1.layer_norm_weight": "ln2.scale",
    L_ + "mlp.linear_fc1.layer_norm_bias": "ln2.bias",
    L_ + "mlp.linear_fc1.weight": "mlp.up.kernel",  # GELU (the GPT cases); MoE has no dense MLP
    L_ + "mlp.linear_fc1.bias": "mlp.up.bias",
    L_ + "mlp.linear_fc2.weight": "mlp.down.kernel",
    L_ + "mlp.linear_fc2.bias": "mlp.down.bias",
    L_ + "mlp.router.weight": "router.kernel",
    X_ + "linear_fc1.weight": "gate_up.kernel",
    X_ + "linear_fc2.weight": "down.kernel",
}


def reference(w: np.ndarray, name: str) -> np.ndarray:
    """What an atom must hold, from one layer's (and expert's) slice of the merged global tensor,
    by Megatron's documented layouts (per-group [q..., k, v] rows), written apart from the
    importer."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        per = (QPG + 2) * HD
        rows = [[w[g * per + h * HD : g * per + (h + 1) * HD] for g in range(GROUPS)
                 for h in range(QPG)]]  # fmt: skip
        rows.append([w[g * per + QPG * HD : g * per + (QPG + 1) * HD] for g in range(GROUPS)])
        rows.append([w[g * per + (QPG + 1) * HD : (g + 1) * per] for g in range(GROUPS)])
        out = np.concatenate(rows[0] + rows[1] + rows[2], 0)
        return out.T if out.ndim == 2 else out
    if name == "embedding.word_embeddings.weight":
        return w[:VOCAB]
    if name == "output_layer.weight":
        return w[:VOCAB].T
    linear = name.endswith(("linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight",
                            "router.weight"))  # fmt: skip
    return w.T if linear else w


def _referee(mcore_gpt_ckpts, case: str) -> dict:  # noqa: F811
    ref = case + "_asfull" if case.endswith("_dp") else case
    return torch.load(mcore_gpt_ckpts.torch_save(ref), weights_only=False)


def _slot_keys(sd: dict, name: str) -> dict[str, str]:
    """slot -> the merged state dict's key (the fp32 master where there is one; any chain)."""
    out = {}
    for prefix in ("", "chained_0.", "chained_1."):
        for slot, field in (("fp32", "fp32_param"), ("fp32", "param"), ("exp_avg", "exp_avg"),
                            ("exp_avg_sq", "exp_avg_sq")):  # fmt: skip
            key = f"{prefix}optimizer.state.{field}.{name}"
            if key in sd:
                out[slot] = key
    return {"fp32": name} | out


@pytest.fixture(scope="module")
def imported(mcore_gpt_ckpts, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("mcore_gpt")
    return {c: import_megatron(mcore_gpt_ckpts.path(c), root / c, heads=HEADS, top_k=TOP_K,
                               vocab_size=VOCAB) for c in CASES}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_import_matches_dcp_to_torch_save(mcore_gpt_ckpts, imported, case):  # noqa: F811
    """Every weight and Adam moment after import (experts one atom per layer and expert, their
    moments from the ChainedOptimizer's chained_1) equals torch's merge of the same checkpoint
    (for dp_reshardable: Megatron's own fully_reshardable save of the same state)."""
    sd = _referee(mcore_gpt_ckpts, case)
    ck = ucp.Checkpoint(imported[case])
    assert ck.step == 2
    model = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and "optimizer." not in k]
    assert model and all(k in ATOMS for k in model), [k for k in model if k not in ATOMS]
    want_atoms, seen = set(), 0
    for name in model:
        for slot, key in _slot_keys(sd, name).items():
            t = sd[key].float().numpy()
            if name.startswith(X_):
                parts = {f"blocks.{i}.experts.{e}.{ATOMS[name]}": t[i, e]
                         for i in range(LAYERS) for e in range(EXPERTS)}  # fmt: skip
            elif name.startswith(L_):
                parts = {f"blocks.{i}.{ATOMS[name]}": t[i] for i in range(LAYERS)}
            else:
                parts = {ATOMS[name]: t}
            for atom, w in parts.items():
                got, want = ck.read(atom, slot), reference(w, name)
                assert got.dtype == np.float32 and got.shape == want.shape, (atom, slot)
                np.testing.assert_array_equal(got, want, err_msg=f"{case} {atom} {slot}")
                want_atoms.add(atom)
                seen += 1
    assert sorted(ck.atoms) == sorted(want_atoms)
    assert seen == 3 * len(want_atoms)  # the value and both moments of every atom
    if MODELS[case] == "moe":
        assert any(k.startswith("chained_1.optimizer.state.exp_avg." + X_) for k in sd)


def _logits(ckpt: str, layout: Layout, tokens: np.ndarray) -> np.ndarray:
    cfg = L.config_from_checkpoint(ckpt)
    mesh = L.make_mesh(layout)
    params, _ = ucp.restore(
        ckpt, L.abstract_params(cfg, layout, mesh), rules=L.ucp_rules(cfg, layout), cast=True
    )
    return np.asarray(L.make_logits_fn(cfg, layout, mesh)(params, tokens))


MESHES = {
    "g_tp2": (Layout(tensor=2), Layout(stages=2, data=2, tensor=2)),
    "g_tp2dp2_dp": (Layout(fsdp=2, tensor=2),),
    "m_ep2": (MoELayout(expert=2), MoELayout(expert=4, tensor=2)),
    "m_etp2": (MoELayout(stages=2, expert=2, tensor=2),),
}


@pytest.mark.parametrize("case", sorted(MESHES))
def test_restore_computes_megatrons_forward(mcore_gpt_ckpts, imported, case):  # noqa: F811
    """The JAX model restored from the checkpoint (GPT: LayerNorm, GELU, biases, tied embeddings
    and learned positions, or RoPE and untied; MoE: the Mixtral-style experts, from EP=2 and
    from expert-TP=2) gives the logits Megatron's own forward gave on the same batch."""
    g = torch.Generator().manual_seed(7)  # the script's ref_tokens()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g).numpy()
    ref = np.asarray(mcore_gpt_ckpts.results[case]["logits"], np.float32)[..., :VOCAB]
    cfg = L.config_from_checkpoint(imported[case])
    want = {
        "g_tp2": ("gpt", "learned", True, False),
        "g_tp2dp2_dp": ("gpt", "rope", False, False),
        "m_ep2": ("mixtral", "rope", False, True),
        "m_etp2": ("mixtral", "rope", False, True),
    }
    assert (cfg.model_type, cfg.positions, cfg.tie_embeddings, cfg.n_experts == 4) == want[case]
    for layout in MESHES[case]:
        err = float(
            (
                np.abs(_logits(imported[case], layout, tokens) - ref).max(-1) / np.abs(ref).max(-1)
            ).max()
        )
        print(f"\n{case} -> {layout.name}: logits rel err {err:.2e}")
        assert err <= 1e-5, (case, layout, err)


def test_shape_from_args_else_asked(mcore_gpt_ckpts, tmp_path):  # noqa: F811
    """The head count and the rest come from Megatron-LM's args where the checkpoint has them;
    where it has none, the error names the argument to pass; args that disagree are refused."""
    cfg = L.config_from_checkpoint(import_megatron(mcore_gpt_ckpts.path("g_tp2"), tmp_path / "a"))
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm, cfg.activation) == (
        4, 2, 8, "layer", "gelu")  # fmt: skip
    assert (cfg.gated_mlp, cfg.linear_bias, cfg.qkv_bias, cfg.max_positions) == (False, True,
                                                                                  True, 16)  # fmt: skip
    with pytest.raises(MegatronFormatError, match=r"not recorded .* pass heads= \(--heads\)"):
        import_megatron(mcore_gpt_ckpts.path("m_ep2"), tmp_path / "b")
    with pytest.raises(MegatronFormatError, match=r"top-k is not recorded .* top_k= \(--top-k\)"):
        import_megatron(mcore_gpt_ckpts.path("m_ep2"), tmp_path / "c", heads=HEADS)
    with pytest.raises(MegatronFormatError, match="num_query_groups=2"):
        import_megatron(mcore_gpt_ckpts.path("g_tp2"), tmp_path / "d", heads=2)
    assert ucp_main(["convert", "megatron", mcore_gpt_ckpts.path("g_tp2pp2"),
                     str(tmp_path / "e")]) == 0  # fmt: skip
    assert L.config_from_checkpoint(str(tmp_path / "e")).tie_embeddings
    for p in "bcd":
        assert not os.path.exists(tmp_path / p)


def test_values_no_args_record_are_named_when_defaulted(mcore_gpt_ckpts, tmp_path, caplog):  # noqa: F811
    """Without Megatron-LM's args, the activation of a gated MLP (SwiGLU or GEGLU: the same
    shapes), the norm epsilon and the RoPE base are Megatron's defaults: the log names each with
    its flag; values passed, or recorded in args, leave nothing to name."""
    src = mcore_gpt_ckpts.path("m_ep2")
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        import_megatron(src, tmp_path / "a", heads=HEADS, top_k=TOP_K)
    assert "no Megatron-LM args" in caplog.text
    for named in ("activation=silu (--activation)", "norm_eps=1e-05 (--norm-eps)",
                  "rope_theta=10000 (--rope-theta)"):  # fmt: skip
        assert named in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        import_megatron(src, tmp_path / "b", heads=HEADS, top_k=TOP_K, activation="silu",
                        norm_eps=1e-5, rope_theta=10000.0)  # fmt: skip
        import_megatron(mcore_gpt_ckpts.path("g_tp2"), tmp_path / "c")
    assert "not recorded" not in caplog.text


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", sorted(n for n in RESUMES if n.startswith("ours_")))
def test_megatron_loads_exports(mcore_gpt_ckpts, name):  # noqa: F811
    """Megatron-Core loads our export at another TP / PP / EP (plain, or distributed optimizer):
    the loss of a fixed batch equals the source's (fp32: <= 1e-5 relative); the next losses equal
    those of Megatron resumed from its own checkpoint at that layout, where it has one (bf16 too:
    exactly), or (EP=2 -> EP=1, where Megatron cannot load its own) those of the source job."""
    r = mcore_gpt_ckpts.results
    ours, ckpt = r[name], RESUMES[name][5]
    src = r[EXPORTS[ckpt][0]]
    own = r.get(name.replace("ours_", "own_"))
    if own is not None:
        assert ours["resumed"] == own["resumed"] and ours["eval"] == own["eval"], (ours, own)
    if RESUMES[name][3] == "fp32":
        assert _rel(ours["eval"], src["eval"]) <= 1e-5, (ours["eval"], src["eval"])
    if name.endswith("_at_ep1"):  # DP=2 as the source: the job that never stopped
        assert _rel(ours["resumed"][0], src["resumed"][0]) <= 1e-5
        np.testing.assert_allclose(ours["resumed"], src["resumed"], rtol=1e-2)
    print(f"\n{name}: eval {ours['eval']:.7f} (source {src['eval']:.7f}), resumed "
          f"{ours['resumed']}, own {own and own['resumed']}")  # fmt: skip


@pytest.mark.parametrize("x", ["x_g_tp2", "x_g_tp2pp2", "x_m_ep2"])
def test_export_equals_source_tensors(mcore_gpt_ckpts, tmp_path, x):  # noqa: F811
    """import -> export in the source's optimizer layout gives back every tensor of the source
    (torch's merge of both): tied GPT (plain fp32), bf16 with the distributed optimizer, and the
    MoE model's ChainedOptimizer."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = torch.load(mcore_gpt_ckpts.torch_save(EXPORTS[x][0]), weights_only=False)
    dcp_to_torch_save(mcore_gpt_ckpts.path(x), str(tmp_path / "x.pt"))
    got = torch.load(str(tmp_path / "x.pt"), weights_only=False)
    want = {k: v for k, v in src.items() if isinstance(v, torch.Tensor)}
    assert sorted(k for k, v in got.items() if isinstance(v, torch.Tensor)) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    common = got["common_state/shard_0_1"][0]
    assert common["iteration"] == 2
    assert sorted(k for k in src if "_extra_state" in k) == sorted(k for k in got if
                                                                  "_extra_state" in k)  # fmt: skip


def test_export_cli_and_refusals(mcore_gpt_ckpts, imported, tmp_path):  # noqa: F811
    u = imported["m_ep2"]
    rc = ucp_main(["export", "megatron", u, str(tmp_path / "m"), "--padded-vocab", "64",
                   "--optimizer", "distributed", "--expert-parallel", "1"])  # fmt: skip
    assert rc == 0
    back = ucp.Checkpoint(import_megatron(str(tmp_path / "m"), tmp_path / "b", heads=HEADS,
                                          top_k=TOP_K, vocab_size=VOCAB))  # fmt: skip
    ref = ucp.Checkpoint(u)
    assert sorted(back.atoms) == sorted(ref.atoms)
    for atom in ref.atoms:
        for slot in ("fp32", "exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(back.read(atom, slot), ref.read(atom, slot))
    with pytest.raises(MegatronExportError, match="optimizer='fsdp'"):
        export_megatron(u, tmp_path / "x", optimizer="fsdp")
    from ucp_jax._src.llama_config import HFConfigError
    from ucp_jax.torch import export_hf

    with pytest.raises(HFConfigError, match=r"model_type 'gpt'.*export_megatron"):
        export_hf(imported["g_tp2"], tmp_path / "hf")
    assert not os.path.exists(tmp_path / "hf")


def _resave(mcore_gpt_ckpts, case: str, dst, edit) -> str:  # noqa: F811
    """The case's tensors and common state, edited, saved again as a torch_dist folder."""
    import torch.distributed.checkpoint as dcp

    sd = {k: v for k, v in _referee(mcore_gpt_ckpts, case).items() if "_extra_state" not in k}
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    edit(sd)
    dcp.save(sd, checkpoint_id=str(dst), no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))  # fmt: skip
    (dst / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return str(dst)


def test_refuses_what_the_model_does_not_compute(mcore_gpt_ckpts, tmp_path):  # noqa: F811
    """Grouped-GEMM experts, qk-layernorm and Megatron-LM args the JAX model does not compute are
    refused by name, before anything is written; so are hostile values in the args."""

    def grouped(sd: dict) -> None:
        sd["decoder.layers.mlp.experts.linear_fc1.weight0"] = sd.pop(X_ + "linear_fc1.weight")

    def qk_norm(sd: dict) -> None:
        sd[L_ + "self_attention.q_layernorm.weight"] = torch.ones(4, 8)

    def partial_rope(sd: dict) -> None:
        sd["common_state/shard_0_1"][0]["args"].rotary_percent = 0.5

    for case, edit, match in (("m_ep2", grouped, "grouped-GEMM"),
                              ("g_tp2", qk_norm, r"q_layernorm\.weight"),
                              ("g_tp2", partial_rope, "rotary_percent=0.5")):  # fmt: skip
        src = _resave(mcore_gpt_ckpts, case, tmp_path / edit.__name__, edit)
        with pytest.raises(MegatronFormatError, match=match):
            import_megatron(src, tmp_path / f"u_{edit.__name__}", heads=HEADS, top_k=TOP_K)
        assert not os.path.exists(tmp_path / f"u_{edit.__name__}")

    def hostile_args(sd: dict) -> None:  # untrusted values where the shape is read from
        args = sd["common_state/shard_0_1"][0]["args"]
        args.num_attention_heads, args.norm_epsilon = -4, float("nan")

    src = _resave(mcore_gpt_ckpts, "g_tp2", tmp_path / "hostile", hostile_args)
    with pytest.raises(MegatronFormatError, match="heads=-4; expected a positive"):
        import_megatron(src, tmp_path / "h")
    with pytest.raises(MegatronFormatError, match="norm epsilon=nan"):
        import_megatron(src, tmp_path / "h", heads=HEADS)
    with pytest.raises(MegatronFormatError, match=r"top_k=9 is not in 1\.\.4"):
        import_megatron(mcore_gpt_ckpts.path("m_ep2"), tmp_path / "h", heads=HEADS, top_k=9)
    assert not os.path.exists(tmp_path / "h")


def _with_megatron_lm_args(mcore_gpt_ckpts, dst, *flags: str) -> str:  # noqa: F811
    """g_tp2's tensors with the `args` Megatron-LM's own parse_args gives (tests/mcore/megatron_lm.py)."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "mcore", "megatron_lm.py")
    subprocess.run([sys.executable, script, "args", mcore_gpt_ckpts.torch_save("g_tp2"), str(dst),
                    *flags],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    return str(dst)


def test_args_of_megatron_lm_itself(mcore_gpt_ckpts, tmp_path):  # noqa: F811
    """The `args` that Megatron-LM's pretrain_gpt.py saves (its parse_args: an argparse.Namespace
    holding enums, AttnBackend and signal.Signals) are read, and give the config the test's own
    args give; args that change the model the JAX model does not compute are refused by name."""
    gpt = ["--add-qkv-bias"]  # the tied GPT of g_tp2: LayerNorm, GELU, biases, learned positions
    src = _with_megatron_lm_args(mcore_gpt_ckpts, tmp_path / "real", *gpt)
    got = ucp.Checkpoint(import_megatron(src, tmp_path / "u_real"))
    want = ucp.Checkpoint(import_megatron(mcore_gpt_ckpts.path("g_tp2"), tmp_path / "u_ref"))
    assert L.config_from_checkpoint(got.path) == L.config_from_checkpoint(want.path)
    assert sorted(got.atoms) == sorted(want.atoms)
    for atom in want.atoms:
        np.testing.assert_array_equal(got.read(atom, "fp32"), want.read(atom, "fp32"))
    for flags, match in ((["--window-size", "4,0"], r"window_size=\(4, 0\)"),
                         (["--quick-geglu"], "quick_geglu=True"),
                         (["--softmax-type", "off-by-one"], "softmax_type='off-by-one'")):  # fmt: skip
        src = _with_megatron_lm_args(mcore_gpt_ckpts, tmp_path / flags[0][2:], *gpt, *flags)
        with pytest.raises(MegatronFormatError, match=match):
            import_megatron(src, tmp_path / "u_bad")
        assert not os.path.exists(tmp_path / "u_bad")


def test_a_master_that_is_not_its_weight_is_refused(mcore_gpt_ckpts, tmp_path):  # noqa: F811
    """Megatron keeps the fp32 master equal to the weight (bf16: its cast), and every real
    checkpoint above passes that check; a master that is another window of the flat buffer (as
    megatron-core saves with several gradient buckets) is refused by name, not imported."""
    key = L_ + "mlp.linear_fc2.weight"

    def shifted(sd: dict) -> None:
        m = sd["optimizer.state.param." + key]
        sd["optimizer.state.param." + key] = m.reshape(-1).roll(7).reshape(m.shape)

    src = _resave(mcore_gpt_ckpts, "g_tp2pp2", tmp_path / "shifted", shifted)
    with pytest.raises(MegatronFormatError, match=r"fp32 master of 'decoder\.layers\.mlp\."
                       r"linear_fc2\.weight' does not match the model weight"):  # fmt: skip
        import_megatron(src, tmp_path / "u")
    assert not os.path.exists(tmp_path / "u")


def test_megatron_lm_finds_the_export_and_the_import_takes_its_save_folder(imported, tmp_path):
    """An export into <save>/iter_XXXXXXX points <save>'s latest_checkpointed_iteration.txt at it:
    Megatron-LM's own lookup (`--load <save>`) finds and loads it (without the tracker it would
    start from random weights); the importer takes <save> too, reading the iteration it names."""
    import json
    import subprocess
    import sys

    save = tmp_path / "save"
    out = export_megatron(imported["g_tp2"], save / "iter_0000002")
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "2"
    script = os.path.join(os.path.dirname(__file__), "mcore", "megatron_lm.py")
    run = subprocess.run([sys.executable, script, "lookup", str(save)], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {
        "found": out, "loaded": True, "content_metadata": None}  # fmt: skip
    # the distributed optimizer's layout: Megatron-LM read none, so took dp_zero_gather_scatter
    dist = export_megatron(
        imported["g_tp2"], tmp_path / "d" / "iter_0000002", optimizer="distributed"
    )
    run = subprocess.run([sys.executable, script, "lookup", str(tmp_path / "d")], capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"found": dist, "loaded": True,
        "content_metadata": {"distrib_optim_sharding_type": "fully_reshardable",
                             "distrib_optim_fully_reshardable_mem_efficient": False}}  # fmt: skip
    back = ucp.Checkpoint(import_megatron(save, tmp_path / "u", heads=HEADS, vocab_size=VOCAB))
    ref = ucp.Checkpoint(imported["g_tp2"])
    for atom in ref.atoms:
        np.testing.assert_array_equal(back.read(atom, "fp32"), ref.read(atom, "fp32"))
    (save / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(MegatronFormatError, match=r"names iteration 7, but .*iter_0000007 is "
                       r"missing \(iteration folders there: \['iter_0000002'\]\)"):  # fmt: skip
        import_megatron(save, tmp_path / "u7", heads=HEADS)
    with pytest.raises(ucp.NotACheckpointError, match="does not exist"):
        import_megatron(tmp_path / "nowhere", tmp_path / "u8", heads=HEADS)
    for bad in (0, 32, -5):  # below the vocabulary (60)
        with pytest.raises(MegatronExportError, match=rf"padded_vocab={bad} \(--padded-vocab\)"):
            export_megatron(imported["g_tp2"], tmp_path / f"v{bad}", padded_vocab=bad)
        assert not os.path.exists(tmp_path / f"v{bad}")


def test_a_weights_only_export_writes_no_optimizer_state(tmp_path, caplog):
    """A Hugging Face model (weights, no Adam moments) exported to Megatron: no optimizer tensors,
    no optimizer param groups (Megatron would ask for moments that are not there), a warning
    naming how to load it; the weights are transformers' (read back by torch's DCP)."""
    import logging

    transformers = pytest.importorskip("transformers")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ucp_jax.torch import import_hf

    cfg = transformers.LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "hf")
    u = import_hf(tmp_path / "hf", tmp_path / "u")
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        export_megatron(u, tmp_path / "m")
    assert "no Adam moments" in caplog.text and "--no-load-optim" in caplog.text
    dcp_to_torch_save(str(tmp_path / "m"), str(tmp_path / "m.pt"))
    sd = torch.load(tmp_path / "m.pt", weights_only=False)
    assert not [k for k in sd if "optimizer" in k]
    assert "optimizer" not in sd["common_state/shard_0_1"][0]
    emb = sd["embedding.word_embeddings.weight"][:60]
    assert torch.equal(emb, model.model.embed_tokens.weight.detach())
