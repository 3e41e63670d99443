"""torchtitan checkpoints in and out, and plain DCP out, on checkpoints torchtitan 0.3.0 wrote.

The fixtures (tests/data/torchtitan, made by tests/torchtitan/make_fixtures.py) are a tiny Llama 3
(4 heads in 2 KV groups, 2 layers) trained 2 steps on 1 process and on 2-rank FSDP, a model-only
save, and torchtitan's float32 logits and next losses on fixed batches. Nothing here runs
torchtitan: the resumes are in test_torchtitan_referee.py (`make referees`).
"""

from __future__ import annotations

import base64
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import optax  # noqa: E402
from fixture_cache import torchrun  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main as ucp_main  # noqa: E402
from ucp_jax.demo import Layout  # noqa: E402
from ucp_jax.models import llama as L  # noqa: E402
from ucp_jax.torch import (  # noqa: E402
    DCPFormatError,
    TorchtitanFormatError,
    UnsafePickleError,
    export_dcp,
    export_torchtitan,
    import_dcp,
    import_torchtitan,
)

DATA = os.path.join(os.path.dirname(__file__), "data", "torchtitan")
HEADS, KV, HD, D = 4, 2, 8, 32
with open(os.path.join(DATA, "records.json")) as _f:
    RECORDS = json.load(_f)


def merged(folder: str, tmp) -> dict:
    """torch's own merge of a DCP folder (dcp_to_torch_save), flattened to DCP's keys."""
    out = str(tmp / (os.path.basename(folder) + f"-{abs(hash(folder))}.pt"))
    dcp_to_torch_save(folder, out)

    def flat(d: dict, p: str = "") -> dict:
        r: dict = {}
        for k, v in d.items():
            r |= flat(v, f"{p}{k}.") if isinstance(v, dict) else {p + k: v}
        return r

    return flat(torch.load(out, weights_only=False))


def half(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's conversion permute (torchtitan's Llama3StateDictAdapter._permute)."""
    return w.reshape(heads, -1, 2, w.shape[1]).transpose(0, 2, 1, 3).reshape(w.shape)


def expected_atoms(sd: dict, slot: str) -> dict[str, np.ndarray]:
    """What each atom's slot must hold, written from torchtitan's documented layouts."""
    key = (lambda p: p) if slot == "fp32" else (lambda p: f"optimizer.state.{p}.{slot}")
    g = lambda p: sd[key(p)].numpy()  # noqa: E731
    out = {"embed.embedding": g("tok_embeddings.weight"), "ln_f.scale": g("norm.weight"),
           "unembed.kernel": g("lm_head.weight").T}  # fmt: skip
    for i in range(2):
        p = f"layers.{i}."
        if slot == "fp32":
            q, k, v = (g(p + f"attention.qkv_linear.{w}.weight") for w in ("wq", "wk", "wv"))
        else:  # the fused wqkv: per KV group, 2 query heads, 1 key head, 1 value head
            per = g(p + "attention.qkv_linear.wqkv.weight").reshape(KV, 4, HD, D)
            q, k, v = (per[:, :2].reshape(-1, D), per[:, 2].reshape(-1, D),
                       per[:, 3].reshape(-1, D))  # fmt: skip
        b = f"blocks.{i}."
        out[b + "attn.qkv.kernel"] = np.concatenate([half(q, HEADS).T, half(k, KV).T, v.T], 1)
        out[b + "attn.out.kernel"] = g(p + "attention.wo.weight").T
        out[b + "mlp.gate_up.kernel"] = np.concatenate(
            [g(p + "feed_forward.w1.weight").T, g(p + "feed_forward.w3.weight").T], 1
        )
        out[b + "mlp.down.kernel"] = g(p + "feed_forward.w2.weight").T
        out[b + "ln1.scale"] = g(p + "attention_norm.weight")
        out[b + "ln2.scale"] = g(p + "ffn_norm.weight")
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tt")
    return {name: import_torchtitan(os.path.join(DATA, name, "step-2"), root / name, heads=HEADS)
            for name in ("np1", "np2")}  # fmt: skip


@pytest.mark.parametrize("name", ["np1", "np2"])
def test_import_every_atom_and_slot(imported, tmp_path, name):
    """Weights, both Adam moments (the fused wqkv's split to q/k/v) and step equal torch's merge
    of the checkpoint, bit for bit, on 1 process and on 2-rank FSDP; the rest is in extra."""
    sd = merged(os.path.join(DATA, name, "step-2"), tmp_path)
    ck = ucp.Checkpoint(imported[name])
    assert ck.step == 2 and len(ck.atoms) == 3 + 2 * 6
    for slot in ("fp32", "exp_avg", "exp_avg_sq"):
        for atom, want in expected_atoms(sd, slot).items():
            np.testing.assert_array_equal(ck.read(atom, slot), want, err_msg=f"{atom} {slot}")
    assert float(ck.read("blocks.1.attn.qkv.kernel", "step")) == 2.0
    tt = ck.manifest.extra["torchtitan"]
    assert tt["train_state"] == {"step": 2, "ntokens_seen": sd["train_state.ntokens_seen"]}
    assert tt["lr_scheduler"] == {"last_epoch": 2}
    ws = 2 if name == "np2" else 1
    assert tt["dataloader"]["world_size"] == ws
    for r in range(ws):
        raw = base64.b64decode(tt["dataloader"][f"dp_rank_{r}"]["base64"])
        assert raw == sd[f"dataloader.dp_rank_{r}"]
    (group,) = tt["param_groups"]
    assert group["betas"] == [0.9, 0.95] and group["weight_decay"] == 0.1
    assert ck.manifest.source["torchtitan"]["model_only"] is False


def test_model_only_and_cli(tmp_path, capsys):
    """torchtitan's model-only save imports as params alone, and the CLI says so."""
    src = os.path.join(DATA, "np1", "step-4")
    assert ucp_main(["convert", "torchtitan", src, str(tmp_path / "m"), "--heads", "4"]) == 0
    assert "model only" in capsys.readouterr().out
    ck = ucp.Checkpoint(str(tmp_path / "m"))
    assert all(set(a.slots) == {"fp32"} for a in ck.atoms.values())
    assert ck.manifest.source["torchtitan"]["model_only"] is True
    sd = merged(src, tmp_path)
    for atom, want in expected_atoms(sd, "fp32").items():
        np.testing.assert_array_equal(ck.read(atom), want)


@pytest.mark.parametrize("name", ["np1", "np2"])
def test_export_gives_back_every_entry(imported, tmp_path, name):
    """import -> export: every tensor and every pickled entry of the source step folder, equal."""
    src = os.path.join(DATA, name, "step-2")
    out = export_torchtitan(imported[name], tmp_path / "x")
    a, b = merged(src, tmp_path), merged(out, tmp_path)
    assert set(a) == set(b)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def test_export_other_world_size_leaves_the_dataloader(imported, tmp_path, capsys):
    """For another data-parallel size the data loader's per-rank state is left out, and said."""
    dst = str(tmp_path / "x2")
    assert ucp_main(["export", "torchtitan", imported["np1"], dst, "--world-size", "2"]) == 0
    assert "exclude-from-loading dataloader" in capsys.readouterr().out
    keys = set(merged(dst, tmp_path))
    assert not any(k.startswith("dataloader.") for k in keys)
    assert "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg" in keys


def test_export_dcp_world_size_1(imported, tmp_path):
    """`ucp export dcp` under the three namings, read back by dcp.load at world size 1."""
    import torch.distributed.checkpoint as dcp

    ck = ucp.Checkpoint(imported["np1"])
    src = merged(os.path.join(DATA, "np1", "step-2"), tmp_path)
    for names in ("atoms", "hf", "torchtitan"):
        out = export_dcp(imported["np1"], tmp_path / names, names=names)
        want = merged(out, tmp_path)
        sd = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(sd, checkpoint_id=out, no_dist=True)
        if names == "atoms":
            for atom in ck.atoms:
                for slot in ck.atoms[atom].slots:
                    key = f"model.{atom}" if slot == "fp32" else f"optim.state.{atom}.{slot}"
                    np.testing.assert_array_equal(sd[key].numpy(), ck.read(atom, slot))
            back = ucp.Checkpoint(import_dcp(out, tmp_path / "back"))
            np.testing.assert_array_equal(back.read("blocks.0.attn.qkv.kernel", "exp_avg"),
                                          ck.read("blocks.0.attn.qkv.kernel", "exp_avg"))  # fmt: skip
        elif names == "torchtitan":  # torchtitan's own names and layouts, wqkv state included
            for k, v in sd.items():
                tkey = k.removeprefix("model.").replace("optim.", "optimizer.")
                assert torch.equal(v, src[tkey]), k
        else:
            q = sd["model.model.layers.1.self_attn.q_proj.weight"].numpy()
            np.testing.assert_array_equal(q, half(src["layers.1.attention.qkv_linear.wq.weight"]
                                                  .numpy(), HEADS))  # fmt: skip
            assert "optim.state.model.layers.1.self_attn.k_proj.weight.exp_avg" in sd


def test_export_dcp_world_size_2(imported, tmp_path):
    """Read back by dcp.load on 2 gloo ranks into DTensors sharded on dim 0: every tensor equal."""
    for names in ("hf", "torchtitan"):
        out = export_dcp(imported["np2"], tmp_path / names, names=names)
        ref = str(tmp_path / f"{names}.pt")
        dcp_to_torch_save(out, ref)
        script = os.path.join(os.path.dirname(__file__), "torchtitan", "dcp_load_2.py")
        torchrun(script, 2, [out, ref], str(tmp_path), timeout=300)
        assert (tmp_path / "dcp_load_2.ok").read_text().split() == ["0", "1"], names
        os.remove(tmp_path / "dcp_load_2.ok")


def _restore(ck: str, layout: Layout, optimizer=None):
    cfg = L.config_from_checkpoint(ck)
    mesh = L.make_mesh(layout)
    abstract = L.abstract_params(cfg, layout, mesh)
    opt_t = None
    if optimizer is not None:
        from ucp_jax.models.placement import abstract_opt_state

        opt_t = abstract_opt_state(optimizer, abstract)
    params, state = ucp.restore(ck, abstract, opt_t, rules=L.ucp_rules(cfg, layout), cast=True)
    return cfg, mesh, params, state


@pytest.mark.parametrize("layout", [Layout(), Layout(fsdp=2, tensor=2)], ids=["1dev", "fsdp2tp2"])
def test_jax_logits_equal_torchtitans_forward(imported, layout):
    """ucp_jax.models.llama restored from the import gives torchtitan's float32 logits."""
    tokens = np.load(os.path.join(DATA, "fixed", "tokens_step3.npy"))[:, :-1].astype(np.int32)
    ref = np.load(os.path.join(DATA, "fixed", "logits.npy"))
    cfg, mesh, params, _ = _restore(imported["np1"], layout)
    out = np.asarray(L.make_logits_fn(cfg, layout, mesh)(params, tokens))
    err = float((np.abs(out - ref).max(-1) / np.abs(ref).max(-1)).max())
    assert err <= 1e-4, err


def _adamw(lr: float) -> optax.GradientTransformation:
    """torchtitan's AdamW (betas 0.9/0.95, eps 1e-8, decoupled weight decay 0.1 on every
    parameter) after its global-norm clipping at 1.0; constant lr: one optimizer per step."""
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))  # fmt: skip


@pytest.mark.parametrize("layout", [Layout(), Layout(fsdp=2, tensor=2)], ids=["1dev", "fsdp2tp2"])
def test_jax_training_follows_torchtitan(imported, layout):
    """Two JAX steps from the imported params and Adam moments (count from the step slots) give
    torchtitan's own next two losses on the same batches (<= 1e-3 relative)."""
    recs = RECORDS["fixed"]
    cfg, mesh, params, state = _restore(imported["np1"], layout, _adamw(1e-3))
    assert int(jax.tree.leaves(state)[0]) == 2  # ScaleByAdamState.count from `step`
    for rec in recs:
        tokens = np.load(os.path.join(DATA, "fixed", f"tokens_step{rec['step']}.npy"))
        step = L.make_train_step(cfg, layout, mesh, _adamw(rec["lr"]["lr/AdamW"]))
        params, state, loss = step(params, state, tokens.astype(np.int32))
        rel = abs(float(loss) - rec["loss"]) / rec["loss"]
        assert rel <= 1e-3, (rec["step"], float(loss), rec["loss"])


# --------------------------------------------------------------------------- bad input


def _copy(tmp_path, name: str = "np1") -> str:
    dst = str(tmp_path / "bad")
    shutil.copytree(os.path.join(DATA, name, "step-2"), dst)
    return dst


def test_refusals_name_what(tmp_path):
    src = os.path.join(DATA, "np1", "step-2")
    with pytest.raises(TorchtitanFormatError, match="heads="):
        import_torchtitan(src, tmp_path / "a")
    with pytest.raises(TorchtitanFormatError, match="heads=3"):
        import_torchtitan(src, tmp_path / "b", heads=3)
    import torch.distributed.checkpoint as dcp

    dcp.save({"layers.0.moe.router.weight": torch.zeros(2, 2), "tok_embeddings.weight":
              torch.zeros(4, 2)}, checkpoint_id=str(tmp_path / "moe"), no_dist=True)  # fmt: skip
    with pytest.raises(TorchtitanFormatError, match=r"layers\.0\.moe\.router\.weight"):
        import_torchtitan(str(tmp_path / "moe"), tmp_path / "c", heads=4)
    assert not os.path.exists(tmp_path / "c")


def test_unsafe_pickles_refused(tmp_path):
    """A .metadata or a bytes entry that names a global outside the allow-list is refused,
    and nothing in it runs."""
    import pickle

    bad = _copy(tmp_path)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(UnsafePickleError):
        import_torchtitan(bad, tmp_path / "u", heads=HEADS)
    # a data loader entry rewritten as a pickle that calls os.system
    import torch.distributed.checkpoint as dcp

    sd = {"tok_embeddings.weight": torch.zeros(4, 2), "dataloader.dp_rank_0": Evil()}
    dcp.save(sd, checkpoint_id=str(tmp_path / "evil"), no_dist=True)
    assert not marker.exists()
    with pytest.raises(UnsafePickleError):
        import_torchtitan(str(tmp_path / "evil"), tmp_path / "v", heads=HEADS)
    assert not marker.exists()


def test_bounded_reads(tmp_path):
    """A chunk whose offset/length points past its file is refused by name, not read."""
    from torch.distributed.checkpoint import FileSystemReader

    bad = _copy(tmp_path)
    md = FileSystemReader(bad).read_metadata()
    key = next(k for k in md.storage_data if k.fqn == "layers.1.feed_forward.w2.weight")
    info = md.storage_data[key]
    md.storage_data[key] = type(info)(info.relative_path, info.offset + (1 << 40), info.length)
    import pickle

    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(DCPFormatError, match="w2"):
        import_torchtitan(bad, tmp_path / "u", heads=HEADS)


def test_a_jax_adam_count_is_every_exported_step(imported, tmp_path):
    """One more JAX step (optax's count 2 -> 3), saved without `step=`: torchtitan's and the
    Hugging Face-named DCP export write 3 as every parameter's Adam step (they wrote the
    checkpoint's step, None -> 0: a resumed torch AdamW would redo its bias correction)."""
    cfg, mesh, params, state = _restore(imported["np1"], Layout(), _adamw(1e-3))
    rec = RECORDS["fixed"][0]
    tokens = np.load(os.path.join(DATA, "fixed", f"tokens_step{rec['step']}.npy"))
    step = L.make_train_step(cfg, Layout(), mesh, _adamw(1e-3))
    params, state, _ = step(params, state, tokens.astype(np.int32))
    ucp.save(
        tmp_path / "j", params, state, extra=L.ucp_extra(cfg), rules=L.ucp_rules(cfg, Layout())
    )
    assert ucp.open(tmp_path / "j").step is None
    export_torchtitan(tmp_path / "j", tmp_path / "tt", progress=False)
    export_dcp(tmp_path / "j", tmp_path / "hf", names="hf", progress=False)
    for out in ("tt", "hf"):
        sd = merged(str(tmp_path / out), tmp_path)
        steps = {k: float(v) for k, v in sd.items() if k.endswith(".step")}
        assert steps and set(steps.values()) == {3.0}, (
            out,
            {k: v for k, v in steps.items() if v != 3.0},
        )
