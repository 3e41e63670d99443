"""`ucp convert maxtext` / `ucp export maxtext` on checkpoints MaxText 0.2.5 itself wrote.

The fixtures (tests/data/maxtext, made by referees/maxtext/make_fixtures.py) are MaxText's step
folder `2` of a 2-layer GQA Llama trained 3 steps, scanned and unscanned, with MaxText's own
float32 logits of a fixed batch. MaxText itself is not needed here: `make referees` lets it
resume from the exports.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli
from ucp_jax._src.frameworks.common.writer import AtomWriter
from ucp_jax._src.frameworks.maxtext.export import export_maxtext
from ucp_jax._src.frameworks.maxtext.layout import MaxTextFormatError
from ucp_jax._src.frameworks.maxtext.read import import_maxtext
from ucp_jax.models import llama
from ucp_jax.models.parallel import Layout

DATA = Path(__file__).parent / "data" / "maxtext"
KINDS = ("scanned", "unscanned")


def _orbax_leaves(items: Path) -> dict[str, np.ndarray]:
    """Every leaf of a MaxText `items` folder as Orbax restores it (PRNG keys as their data)."""
    with warnings.catch_warnings():  # no target: Orbax warns that it reads the saved sharding
        warnings.simplefilter("ignore", UserWarning)
        tree = ocp.PyTreeCheckpointer().restore(items.resolve())
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[jax.tree_util.keystr(path)] = np.asarray(x)
    return out


@pytest.fixture(scope="module", params=KINDS)
def converted(request, tmp_path_factory) -> tuple[str, Path]:
    dst = tmp_path_factory.mktemp("mt") / request.param
    import_maxtext(DATA / request.param / "2", dst)
    return request.param, dst


def _logits(ckpt: Path, layout: Layout) -> np.ndarray:
    cfg = llama.config_from_checkpoint(ckpt)
    mesh = llama.make_mesh(layout)
    params = ucp.restore(ckpt, llama.abstract_params(cfg, layout, mesh),
                         rules=llama.ucp_rules(cfg, layout))[0]  # fmt: skip
    with jax.default_matmul_precision("highest"):
        return np.asarray(
            llama.make_logits_fn(cfg, layout, mesh)(params, np.load(DATA / "tokens.npy"))
        )


@pytest.mark.parametrize("layout", [Layout(), Layout(fsdp=2, tensor=2), Layout(data=4, tensor=2)],
                         ids=["1dev", "fsdp2-tp2", "dp4-tp2"])  # fmt: skip
def test_llama_restored_from_maxtext_gives_maxtext_logits(converted, layout):
    kind, ckpt = converted
    want = np.load(DATA / kind / "logits.npy")
    got = _logits(ckpt, layout)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


def test_convert_maps_slots_step_counts_and_rngs(converted):
    kind, ckpt = converted
    ck = ucp.open(ckpt)
    assert ck.step == 3  # MaxText's folder 2 holds the state after steps 0, 1, 2
    assert ck.manifest.source["framework"] == "maxtext"
    blocks = [a for a in ck.atoms if a.startswith("blocks.")]
    assert len(blocks) == 2 * 6
    for name in [*blocks, "embed.embedding", "unembed.kernel", "ln_f.scale"]:
        assert set(ck.atoms[name].slots) == {"fp32", "exp_avg", "exp_avg_sq"}, name
    assert ck.atoms["opt_state.0.count"].role == "ScaleByAdamState.count"
    assert ck.atoms["opt_state.2.count"].role == "ScaleByScheduleState.count"
    assert int(ck.read("opt_state.0.count", "value")) == 3
    mt = ck.manifest.extra["maxtext"]
    assert mt["scan_layers"] == (kind == "scanned") and mt["step_dir"] == 2
    assert any(k.endswith("rngs.dropout.key") for k in mt["nnx_aux"])
    # the moments are MaxText's, per layer: down kernel of layer 1 is wo[:, 1] (scanned)
    leaves = _orbax_leaves(DATA / kind / "2" / "items")
    layer = "['layers']" if kind == "scanned" else "['layers_1']"
    for slot, field in (("fp32", "['params']['params']"), ("exp_avg", "['opt_state'][0]['mu']['params']"),
                        ("exp_avg_sq", "['opt_state'][0]['nu']['params']")):  # fmt: skip
        wo = leaves[f"{field}['decoder']{layer}['mlp']['wo']['kernel']"]
        want = wo[:, 1] if kind == "scanned" else wo
        assert np.array_equal(ck.read("blocks.1.mlp.down.kernel", slot), want), slot


def test_query_kernel_and_moments_are_rescaled(converted):
    """MaxText folds 1/sqrt(head_dim) into the query kernel: the atom holds torch's q_proj."""
    kind, ckpt = converted
    ck = ucp.open(ckpt)
    leaves = _orbax_leaves(DATA / kind / "2" / "items")
    layer = "['layers']" if kind == "scanned" else "['layers_0']"
    hd, s = 16, 4.0  # sqrt(16)
    for slot, field, factor in (("fp32", "['params']['params']", s),
                                ("exp_avg", "['opt_state'][0]['mu']['params']", 1 / s),
                                ("exp_avg_sq", "['opt_state'][0]['nu']['params']", 1 / s**2)):  # fmt: skip
        q = leaves[f"{field}['decoder']{layer}['self_attention']['query']['kernel']"]
        q = q[:, 0] if kind == "scanned" else q
        got = ck.read("blocks.0.attn.qkv.kernel", slot)[:, : 4 * hd]
        np.testing.assert_array_equal(got, q.reshape(64, -1) * np.float32(factor))


@pytest.mark.parametrize("kind", KINDS)
def test_export_gives_back_maxtexts_checkpoint_bit_for_bit(tmp_path, kind):
    ckpt = tmp_path / "ucp"
    assert cli(["convert", "maxtext", str(DATA / kind / "2"), str(ckpt)]) == 0
    args = ["export", "maxtext", str(ckpt), str(tmp_path / "mt")]
    assert cli(args + ([] if kind == "scanned" else ["--unscanned"])) == 0
    out = tmp_path / "mt" / "2"  # step 3 -> MaxText's folder 2
    meta = json.loads((out / "_CHECKPOINT_METADATA").read_text())
    assert meta["custom_metadata"] == {"scan_layers": kind == "scanned"}
    want, got = _orbax_leaves(DATA / kind / "2" / "items"), _orbax_leaves(out / "items")
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k
    assert cli(args) == 1  # the step folder exists: refused without --overwrite


def test_export_switches_scan_layers_both_ways(tmp_path, converted):
    kind, ckpt = converted
    scan = kind != "scanned"
    export_maxtext(ckpt, tmp_path / "mt", scan_layers=scan)
    again = import_maxtext(tmp_path / "mt", tmp_path / "again")
    a, b = ucp.open(ckpt), ucp.open(again)
    assert b.manifest.extra["maxtext"]["scan_layers"] == scan
    assert not b.manifest.extra["maxtext"]["nnx_aux"]  # other layer layout: MaxText starts fresh
    assert set(a.atoms) == set(b.atoms)
    for name, info in a.atoms.items():
        for slot in info.slots:
            np.testing.assert_array_equal(a.read(name, slot), b.read(name, slot), err_msg=name)


def test_llama_state_exports_to_maxtext_and_back(tmp_path):
    """A state saved by ucp_jax.models.llama's training (any layout) exports to MaxText."""
    from ucp_jax.demo import init_opt_state, make_optimizer
    from ucp_jax.models.llama_config import LlamaConfig, ucp_extra

    cfg = LlamaConfig(vocab_size=128, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                      n_layers=2, d_ff=128, norm_eps=1e-5)  # fmt: skip
    layout = Layout(fsdp=2, tensor=2)
    mesh = llama.make_mesh(layout)
    params = llama.to_layout(llama.init_canonical(cfg, 0), cfg, layout, mesh)
    opt = make_optimizer()
    opt_state = init_opt_state(opt, params)
    ucp.save(tmp_path / "ucp", params, opt_state, step=7, rules=llama.ucp_rules(cfg, layout),
             extra=ucp_extra(cfg))  # fmt: skip
    out = export_maxtext(tmp_path / "ucp", tmp_path / "mt")
    assert out.endswith("/6")
    leaves = _orbax_leaves(Path(out) / "items")
    assert int(leaves["['step']"]) == 7 and int(leaves["['opt_state'][0]['count']"]) == 0
    back = import_maxtext(tmp_path / "mt", tmp_path / "back")
    src, got = ucp.open(tmp_path / "ucp"), ucp.open(back)
    for name in (a for a in src.atoms if src.atoms[a].role is None):
        np.testing.assert_allclose(got.read(name, "fp32"), src.read(name, "fp32"), rtol=1e-6)


def test_rope_type_follows_the_models_rope_scaling(tmp_path):
    """Llama 3.1's RoPE scaling exports as MaxText's ``llama3.1`` rope and comes back scaled;
    a rope the model does not compute (given, or another scaling) is refused: an export of a
    scaled model (torchtitan's Llama 3) was written with the unscaled ``default`` rope."""
    from ucp_jax._src.frameworks.maxtext.layout import LLAMA31_SCALING, MaxTextFormatError
    from ucp_jax.models.llama_config import LlamaConfig, ucp_extra

    def saved(name: str, scaling: tuple) -> Path:
        cfg = LlamaConfig(vocab_size=128, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                          n_layers=2, d_ff=128, rope_theta=5e5, rope_scaling=scaling)  # fmt: skip
        layout = Layout(tensor=2)
        params = llama.to_layout(llama.init_canonical(cfg, 0), cfg, layout, llama.make_mesh(layout))
        from ucp_jax.demo import init_opt_state, make_optimizer

        opt = init_opt_state(make_optimizer(), params)
        ucp.save(tmp_path / name, params, opt, step=3, rules=llama.ucp_rules(cfg, layout),
                 extra=ucp_extra(cfg))  # fmt: skip
        return tmp_path / name

    scaled = saved("scaled", LLAMA31_SCALING)
    with pytest.raises(MaxTextFormatError, match=r"rope='default' \(--rope\), but the model's"):
        export_maxtext(scaled, tmp_path / "x1", rope="default")
    export_maxtext(scaled, tmp_path / "mt")
    back = import_maxtext(tmp_path / "mt", tmp_path / "back", rope="llama3.1", rope_theta=5e5)
    assert llama.config_from_checkpoint(back).rope_scaling == llama.config_from_checkpoint(
        scaled).rope_scaling  # fmt: skip
    src, got = ucp.open(scaled), ucp.open(back)
    for name in (a for a in src.atoms if src.atoms[a].role is None):
        np.testing.assert_allclose(got.read(name, "fp32"), src.read(name, "fp32"), rtol=1e-6)
    with pytest.raises(MaxTextFormatError, match=r"rope='llama3.1' \(--rope\), but the model's"):
        export_maxtext(saved("plain", ()), tmp_path / "x2", rope="llama3.1")
    linear = saved("linear", (("factor", 2.0), ("rope_type", "linear")))
    with pytest.raises(MaxTextFormatError, match=r"is not Llama 3\.1's"):
        export_maxtext(linear, tmp_path / "x3")
    assert not any((tmp_path / x).exists() for x in ("x1", "x2", "x3"))


def test_params_only_export_and_missing_moments(tmp_path, converted):
    _, ckpt = converted
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "w", {"params": {"params": {"dense": np.zeros(3, np.float32)}}})
    with pytest.raises(MaxTextFormatError, match=r"no params\.params\.decoder"):
        import_maxtext(tmp_path / "w", tmp_path / "nope")  # not MaxText: nothing written
    assert not (tmp_path / "nope").exists()
    src = ucp.open(ckpt)
    params = {n: src.read(n, "fp32") for n, a in src.atoms.items() if a.role is None}
    ucp.save(tmp_path / "p", params, step=3, extra={"hf_config": src.manifest.extra["hf_config"]})
    with pytest.raises(MaxTextFormatError, match="params_only"):
        export_maxtext(tmp_path / "p", tmp_path / "mt")
    out = export_maxtext(tmp_path / "p", tmp_path / "mt", params_only=True)
    got = _orbax_leaves(Path(out) / "items")
    assert got and all(k.startswith("['params']['params']") for k in got)
    assert len(got) == 3 + 9  # embedding, final norm, output layer; 9 stacked layer kernels


def test_query_rescaled_by_an_irrational_factor_round_trips_bit_for_bit(tmp_path):
    """head_dim 32: sqrt(32) is no power of two, so MaxText's query values ride in a slot."""
    from ucp_jax.models.llama_config import LlamaConfig, ucp_extra

    cfg = LlamaConfig(vocab_size=64, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32,
                      n_layers=2, d_ff=96, norm_eps=1e-5)  # fmt: skip
    atoms = llama.init_canonical(cfg, 1)
    rng = np.random.default_rng(0)
    opt = {n: (rng.standard_normal(a.shape).astype(np.float32),
               rng.random(a.shape).astype(np.float32)) for n, a in atoms.items()}  # fmt: skip
    with AtomWriter(tmp_path / "ucp") as w:
        for n, a in atoms.items():
            w.atom(n, a.shape)
            for slot, x in (("fp32", a), ("exp_avg", opt[n][0]), ("exp_avg_sq", opt[n][1])):
                w.write(n, slot, tuple((0, d) for d in a.shape), x)
        w.commit(step=5, source={"framework": "test"}, extra=ucp_extra(cfg))
    first = export_maxtext(tmp_path / "ucp", tmp_path / "mt1")
    back = import_maxtext(first, tmp_path / "back")
    info = ucp.open(back).atoms["blocks.0.attn.qkv.kernel"]
    assert {"maxtext_fp32", "maxtext_exp_avg"} <= set(info.slots)
    assert "maxtext_exp_avg_sq" not in info.slots  # 1 / 32 is exact
    again = export_maxtext(back, tmp_path / "mt2")
    a, b = _orbax_leaves(Path(first) / "items"), _orbax_leaves(Path(again) / "items")
    assert set(a) == set(b)
    for k, v in a.items():
        assert v.tobytes() == b[k].tobytes(), k


def test_maxtext_to_transformers_gives_maxtexts_logits(tmp_path, converted):
    """The same atoms in torch: `ucp export hf` of a MaxText import, run by transformers."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from ucp_jax._src.frameworks.hf.export import export_hf

    kind, ckpt = converted
    out = export_hf(ckpt, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.from_numpy(np.load(DATA / "tokens.npy")).long()
    with torch.no_grad():
        got = model(tokens).logits.numpy()
    want = np.load(DATA / kind / "logits.npy")
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
