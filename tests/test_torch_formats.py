"""safetensors (single, sharded + index, presets) and torch.distributed.checkpoint (FSDP2) imports."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from ds.fixtures import torchrun  # noqa: E402

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.frameworks.dcp.read import import_dcp  # noqa: E402
from ucp_jax._src.frameworks.hf.safetensors import AtomFrom, import_safetensors  # noqa: E402
from ucp_jax._src.untrusted.safetensors import SafetensorsError  # noqa: E402
from ucp_jax.demo.model import GPTConfig, abstract_params, ucp_rules  # noqa: E402
from ucp_jax.models.parallel import Layout, make_mesh  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CFG = GPTConfig(vocab_size=50, d_model=16, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=32,
                vocab_multiple=8)  # fmt: skip


def hf_llama(cfg: GPTConfig, tied: bool = False) -> dict[str, torch.Tensor]:
    """A Llama state dict in Hugging Face names and torch layouts ([out, in] Linears)."""
    g = torch.Generator().manual_seed(0)
    d, hd = cfg.d_model, cfg.head_dim

    def r(*shape):
        return torch.randn(*shape, generator=g)

    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, d), "model.norm.weight": r(d)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": r(d),
            p + "self_attn.q_proj.weight": r(cfg.n_heads * hd, d),
            p + "self_attn.k_proj.weight": r(cfg.n_kv_heads * hd, d),
            p + "self_attn.v_proj.weight": r(cfg.n_kv_heads * hd, d),
            p + "self_attn.o_proj.weight": r(d, cfg.n_heads * hd),
            p + "post_attention_layernorm.weight": r(d),
            p + "mlp.gate_proj.weight": r(cfg.d_ff, d),
            p + "mlp.up_proj.weight": r(cfg.d_ff, d),
            p + "mlp.down_proj.weight": r(d, cfg.d_ff),
            p + "self_attn.rotary_emb.inv_freq": r(hd // 2),
        }
    if not tied:
        sd["lm_head.weight"] = r(cfg.vocab_size, d)
    return sd


def canonical(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, np.ndarray]:
    """The demo's canonical atoms from HF tensors, by hand (numpy)."""
    n = {k: v.numpy() for k, v in sd.items()}
    out = {"embed.embedding": n["model.embed_tokens.weight"], "ln_f.scale": n["model.norm.weight"],
           "unembed.kernel": n.get("lm_head.weight", n["model.embed_tokens.weight"]).T}  # fmt: skip
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        qkv = [n[p + f"self_attn.{x}_proj.weight"].T for x in "qkv"]
        out |= {
            f"blocks.{i}.ln1.scale": n[p + "input_layernorm.weight"],
            f"blocks.{i}.attn.qkv.kernel": np.concatenate(qkv, axis=1),
            f"blocks.{i}.attn.out.kernel": n[p + "self_attn.o_proj.weight"].T,
            f"blocks.{i}.ln2.scale": n[p + "post_attention_layernorm.weight"],
            f"blocks.{i}.mlp.gate_up.kernel": np.concatenate(
                [n[p + "mlp.gate_proj.weight"].T, n[p + "mlp.up_proj.weight"].T], axis=1
            ),
            f"blocks.{i}.mlp.down.kernel": n[p + "mlp.down_proj.weight"].T,
        }
    return out


def save_sharded(sd: dict[str, torch.Tensor], folder, parts: int = 2) -> None:
    names = sorted(sd)
    wmap = {}
    for k in range(parts):
        fname = f"model-{k + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: sd[n].contiguous() for n in names[k::parts]}
        st.save_file(chunk, os.path.join(folder, fname), metadata={"format": "pt"})
        wmap |= dict.fromkeys(chunk, fname)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": wmap}, f)


def test_single_file_no_preset_keeps_names_and_dtypes(tmp_path):
    sd = {"a.weight": torch.randn(3, 4), "b": torch.randn(5).to(torch.bfloat16),
          "c": torch.arange(6, dtype=torch.int32).reshape(2, 3), "e": torch.zeros(0, 2)}  # fmt: skip
    st.save_file(sd, tmp_path / "m.safetensors")
    ck = ucp.open(import_safetensors(tmp_path / "m.safetensors", tmp_path / "u"))
    assert sorted(ck.atoms) == sorted(sd)
    for k, t in sd.items():
        got = ck.read(k)
        want = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        assert got.shape == tuple(t.shape)
        assert (
            got.view(np.int16).tobytes() == want.tobytes()
            if t.dtype == torch.bfloat16
            else (np.array_equal(got, want))
        )
    assert ck.atoms["b"].slots["fp32"].dtype == "bfloat16"


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_llama_preset_onto_demo_atoms(tmp_path, sharded, tied):
    sd = hf_llama(CFG, tied=tied)
    if sharded:
        save_sharded(sd, tmp_path)
        src = tmp_path
    else:
        st.save_file(sd, tmp_path / "model.safetensors")
        src = tmp_path / "model.safetensors"
    ck = ucp.open(import_safetensors(src, tmp_path / "u", preset="llama-demo"))
    want = canonical(sd, CFG)
    assert sorted(ck.atoms) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(ck.read(k), v, err_msg=k)
    qkv = ck.atoms["blocks.0.attn.qkv.kernel"]
    assert qkv.fused == [{"sizes": [16, 8, 8], "axis": 1}]


@pytest.mark.parametrize("layout", [Layout(data=2, tensor=2), Layout(data=4, tensor=1)])
def test_llama_preset_restores_into_demo_model(tmp_path, layout):
    """The demo model restores the import with its own rules, on a TP=2 and a DP-only layout."""
    from ucp_jax.demo.layouts import from_layout

    sd = hf_llama(CFG)
    st.save_file(sd, tmp_path / "model.safetensors")
    path = import_safetensors(tmp_path / "model.safetensors", tmp_path / "u", preset="llama-demo")
    mesh = make_mesh(layout)
    params, _ = ucp.restore(path, abstract_params(CFG, layout, mesh), rules=ucp_rules(CFG, layout))
    got = from_layout(params, CFG, layout)
    for k, v in canonical(sd, CFG).items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_preset_errors(tmp_path):
    sd = hf_llama(CFG)
    sd["extra.weight"] = torch.ones(2)
    st.save_file(sd, tmp_path / "m.safetensors")
    with pytest.raises(SafetensorsError, match=r"extra\.weight"):
        import_safetensors(tmp_path / "m.safetensors", tmp_path / "u", preset="llama-demo")
    with pytest.raises(SafetensorsError, match="no preset"):
        import_safetensors(tmp_path / "m.safetensors", tmp_path / "u", preset="nope")
    custom = {"x": AtomFrom(("missing.weight",))}
    with pytest.raises(SafetensorsError, match=r"missing\.weight"):
        import_safetensors(tmp_path / "m.safetensors", tmp_path / "u", preset=custom)
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(SafetensorsError):
        import_safetensors(tmp_path / "bad.safetensors", tmp_path / "u")
    assert not os.path.exists(tmp_path / "u")


def test_dcp_single_process(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 5))
    o = torch.optim.AdamW(m.parameters())
    m(torch.ones(2, 4)).sum().backward()
    o.step()
    msd, osd = get_state_dict(m, o)
    with pytest.warns(UserWarning):
        dcp.save(
            {"model": msd, "optim": osd, "step": 5}, checkpoint_id=tmp_path / "d", no_dist=True
        )
    ck = ucp.open(import_dcp(tmp_path / "d", tmp_path / "u", progress=False))
    assert ck.step == 5
    for k, t in msd.items():
        np.testing.assert_array_equal(ck.read(k), t.numpy())
        for f, v in osd["state"][k].items():
            np.testing.assert_array_equal(ck.read(k, f), v.numpy())
    assert ck.manifest.source["dcp"]["objects"]["optim.param_groups.0.lr"] == 1e-3


def _bits(t: torch.Tensor) -> bytes:
    """A tensor's bytes (any dtype, float8s included)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
def test_dcp_float8_and_bfloat16_import_and_export_bit_exact(tmp_path, monkeypatch, layout):
    """torch.distributed.checkpoint holding float8 and bfloat16 tensors: imported atoms hold their
    bits, and torch's own dcp.load reads the export back bit for bit (torch's .numpy() and
    from_numpy take neither type: they cross as same-width integer views)."""
    import torch.distributed.checkpoint as dcp

    from ucp_jax.torch import export_dcp

    monkeypatch.setenv("UCP_LAYOUT", layout)
    g = torch.Generator().manual_seed(0)
    sd = {
        "e4m3": torch.randn(16, 8, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(24, generator=g).to(torch.float8_e5m2),
        "bf16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "f32": torch.randn(3, generator=g),
    }
    with pytest.warns(UserWarning):
        dcp.save({"model": sd, "step": 7}, checkpoint_id=tmp_path / "d", no_dist=True)
    ck = ucp.open(import_dcp(tmp_path / "d", tmp_path / "u", progress=False))
    for k, t in sd.items():
        a = ck.read(k)
        assert a.dtype.name == str(t.dtype).removeprefix("torch."), k
        assert a.tobytes() == _bits(t), k
    export_dcp(tmp_path / "u", tmp_path / "e")
    back = {"model": {k: torch.zeros_like(t) for k, t in sd.items()}}
    with pytest.warns(UserWarning):
        dcp.load(back, checkpoint_id=tmp_path / "e", no_dist=True)
    for k, t in sd.items():
        assert back["model"][k].dtype == t.dtype and _bits(back["model"][k]) == _bits(t), k


def test_safetensors_float8_import_bit_exact(tmp_path):
    """A safetensors file (the library's own writer) of F8_E4M3, F8_E5M2 and BF16 tensors: the
    imported atoms hold their bits and restore (their zarr.json has no endian, as int8's)."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "e4m3": torch.randn(16, 8, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(24, generator=g).to(torch.float8_e5m2),
        "bf16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
    }
    st.save_file(sd, tmp_path / "m.safetensors")
    ck = ucp.open(import_safetensors(tmp_path / "m.safetensors", tmp_path / "u"))
    for k, t in sd.items():
        assert ck.read(k).tobytes() == _bits(t), k


def test_dcp_fsdp2_sharded(tmp_path):
    """A real FSDP2 run on 2 ranks (chunked DTensors) imports equal to its full state dict."""
    torchrun(2, [str(tmp_path)], str(tmp_path), script="fsdp_dcp.py")
    ck = ucp.open(import_dcp(tmp_path / "dcp", tmp_path / "u", progress=False))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert ck.step == 2
    for k, t in full["model"].items():
        np.testing.assert_array_equal(ck.read(k), t.numpy(), err_msg=k)
        for f, v in full["optim"]["state"][k].items():
            np.testing.assert_array_equal(ck.read(k, f), v.numpy(), err_msg=f"{k} {f}")
    assert ucp.open(tmp_path / "u").atoms["emb.weight"].shape == (53, 24)


def test_dcp_malicious_metadata_refused(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ucp.UcpError, match="system"):
        import_dcp(tmp_path / "d", tmp_path / "u")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
def test_import_is_durable_before_commit(tmp_path, monkeypatch, layout):
    """Imports write files without a sync each, then fsync every file and folder before COMMIT.

    aggregated (format version 3): the files of the import's process database (`ocdbt.p0/`);
    the root database is written at commit by the merge, through the syncing context.
    per-array (format version 2): every chunk file and zarr.json under `atoms/`.
    """
    monkeypatch.setenv("UCP_LAYOUT", layout)
    synced: list[str] = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    from ucp_jax._src.format import commit as commit_protocol

    at_commit: list[int] = []
    commit = commit_protocol.Staging.commit

    def recording_commit(self, manifest):  # type: ignore[no-untyped-def]
        at_commit.append(len(synced))  # the manifest and COMMIT are written from here on
        return commit(self, manifest)

    monkeypatch.setattr(commit_protocol.Staging, "commit", recording_commit)
    sd = {f"w{i}": torch.randn(64, 48) for i in range(5)} | {"s": torch.tensor(3.0)}
    st.save_file(sd, tmp_path / "m.safetensors")
    out = import_safetensors(tmp_path / "m.safetensors", tmp_path / "u")
    staging = str(tmp_path / ".u.ucp-tmp")
    data = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs]
    # every data file was fsynced, at its staging path, before the manifest and COMMIT were written
    before = {p.replace(staging, out) for p in synced[: at_commit[0]]}
    if layout == "per-array":
        chunk_files = [p for p in data if "/atoms/" in p]
        assert len(chunk_files) >= 12  # 6 atoms: zarr.json + one chunk file each
    else:
        chunk_files = [p for p in data if "/ocdbt.p0/" in p]
        assert len(chunk_files) >= 2  # its manifest and at least one data file
        assert ucp.open(out).manifest.version == 3
    assert set(chunk_files) <= before, sorted(set(chunk_files) - before)[:3]
    assert ucp.open(out).read("w3").tobytes() == sd["w3"].numpy().tobytes()


def test_failed_import_leaves_nothing_behind(tmp_path, monkeypatch):
    """An import that dies midway (here: the third write) drops its staging folder."""
    from ucp_jax._src.frameworks.common import writer

    sd = {f"w{i}": torch.randn(8, 4) for i in range(5)}
    st.save_file(sd, tmp_path / "m.safetensors")
    write, calls = writer.AtomWriter.write, []

    def failing(self, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk on fire")
        return write(self, *a, **k)

    monkeypatch.setattr(writer.AtomWriter, "write", failing)
    with pytest.raises(OSError, match="disk on fire"):
        import_safetensors(tmp_path / "m.safetensors", tmp_path / "u")
    assert not (tmp_path / "u").exists() and not (tmp_path / ".u.ucp-tmp").exists()
    monkeypatch.undo()
    assert sorted(
        ucp.open(import_safetensors(tmp_path / "m.safetensors", tmp_path / "u")).atoms
    ) == sorted(sd)


def test_dcp_round_trip_resumes_model_and_optimizer(tmp_path):
    """DCP -> ucp -> DCP: torch's own dcp.load + set_state_dict resume the model and an AdamW
    with two param groups (lr, weight decay, amsgrad), a BatchNorm, a frozen bias, the step and
    user entries; every tensor and every param-group field equals the source (torch referee)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ucp_jax.torch import export_dcp

    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.Linear(7, 3))  # fmt: skip
        m[2].bias.requires_grad_(False)
        o = torch.optim.AdamW([{"params": [m[0].weight, m[2].weight], "lr": 1e-2,
                                "weight_decay": 0.1},
                               {"params": [m[0].bias, m[1].weight, m[1].bias], "lr": 3e-3,
                                "weight_decay": 0.0}], amsgrad=True)  # fmt: skip
        for _ in range(2):
            m(torch.randn(4, 5)).sum().backward()
            o.step()
            o.zero_grad()
        return m, o

    m, o = make(0)
    msd, osd = get_state_dict(m, o)
    extra = {"epoch": 3, "name": "run-α", "nested": {"a": [1, 2.5, "x"], "c": True}}
    dcp.save({"model": msd, "optim": osd, "step": 2, "extra": extra},
             checkpoint_id=str(tmp_path / "src"), no_dist=True)  # fmt: skip
    ck = import_dcp(tmp_path / "src", tmp_path / "u", progress=False)
    assert ucp.open(ck).step == 2
    export_dcp(ck, tmp_path / "out", progress=False)
    m2, o2 = make(1)  # another model and optimizer state, overwritten by the load
    msd2, osd2 = get_state_dict(m2, o2)
    back = {"model": msd2, "optim": osd2, "step": 0,
            "extra": {"epoch": 0, "name": "", "nested": {"a": [0, 0.0, ""], "c": False}}}  # fmt: skip
    dcp.load(back, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=back["model"], optim_state_dict=back["optim"])
    for k, t in m.state_dict().items():
        assert torch.equal(t, m2.state_dict()[k]), k
    want, got = o.state_dict(), o2.state_dict()
    for g1, g2 in zip(want["param_groups"], got["param_groups"]):
        assert g1 == g2 and type(g2["betas"]) is tuple  # the entries' bytes are written back
    for pid, st in want["state"].items():
        for slot, t in st.items():
            assert torch.equal(t, got["state"][pid][slot]), (pid, slot)
    assert back["step"] == 2 and back["extra"] == extra


def test_dcp_entries_of_every_kind_come_back_as_saved(tmp_path):
    """A data loader's bytes, a ReduceLROnPlateau's `best = inf`, an RNG state tensor, a tensor
    `lr` and a tensor `step` outside the model: DCP -> ucp -> DCP gives each back as torch saved
    it (bytes as bytes, inf as a float, tensors under their own keys), and the scheduler and
    optimizer resume from it (torch's dcp.load + set_state_dict are the referee)."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ucp_jax.torch import export_dcp

    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Linear(4, 3)
        o = torch.optim.Adam(m.parameters(), lr=torch.tensor(0.01))
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(o)
        for _ in range(2):
            m(torch.randn(2, 4)).sum().backward()
            o.step()
            o.zero_grad()
        return m, o, plateau

    m, o, plateau = make(0)
    msd, osd = get_state_dict(m, o)
    loader = pickle.dumps({"epoch": 1, "offset": 37})
    state = {"model": msd, "optim": osd, "step": torch.tensor(7),
             "sched": plateau.state_dict(), "extra": {"loader": loader, "rng": torch.get_rng_state()}}  # fmt: skip
    dcp.save(state, checkpoint_id=str(tmp_path / "src"), no_dist=True)
    ck = import_dcp(tmp_path / "src", tmp_path / "u", progress=False)
    assert ucp.open(ck).step == 7  # a tensor step is the checkpoint's step
    export_dcp(ck, tmp_path / "out", progress=False)
    m2, o2, plateau2 = make(1)
    msd2, osd2 = get_state_dict(m2, o2)
    back = {"model": msd2, "optim": osd2, "step": torch.tensor(0), "sched": plateau2.state_dict(),
            "extra": {"loader": b"", "rng": torch.zeros_like(torch.get_rng_state())}}  # fmt: skip
    dcp.load(back, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=back["model"], optim_state_dict=back["optim"])
    plateau2.load_state_dict(back["sched"])
    assert (
        back["extra"]["loader"] == loader and pickle.loads(back["extra"]["loader"])["offset"] == 37
    )
    assert torch.equal(back["extra"]["rng"], state["extra"]["rng"])
    assert torch.equal(back["step"], torch.tensor(7))
    assert plateau2.best == float("inf") and isinstance(plateau2.best, float)
    plateau2.step(1.0)  # (a string 'inf' here raised TypeError)
    assert torch.equal(o2.param_groups[0]["lr"], torch.tensor(0.01))
    for k, t in m.state_dict().items():
        assert torch.equal(t, m2.state_dict()[k]), k


def _dcp_saved(make, folder):
    """A torch model and optimizer from `make(0)`, saved as DCP {"model", "optim"} in `folder`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = make(0)
    msd, osd = get_state_dict(m, o)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder), no_dist=True)
    return m, o


def test_dcp_of_a_model_whose_own_names_start_with_the_prefix(tmp_path):
    """Hugging Face's *ForCausalLM keeps its layers under `model.`: the model's DCP entries are
    `model.model.<...>`, the optimizer's `optim.state.model.<...>`; both land on one atom, and the
    export resumes in torch (its exp_avg equal)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ucp_jax.torch import export_dcp

    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Module()
        m.model = torch.nn.Module()
        m.model.proj = torch.nn.Linear(4, 3)
        m.lm_head = torch.nn.Linear(3, 5, bias=False)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m.lm_head(m.model.proj(torch.randn(2, 4))).sum().backward()
        o.step()
        return m, o

    _, o = _dcp_saved(make, tmp_path / "src")
    ck = ucp.open(import_dcp(tmp_path / "src", tmp_path / "u", progress=False))
    assert sorted(ck.atoms) == ["lm_head.weight", "model.proj.bias", "model.proj.weight"]
    for atom in ck.atoms.values():
        assert sorted(atom.slots) == ["exp_avg", "exp_avg_sq", "fp32", "step"]
    export_dcp(ck.path, tmp_path / "out", progress=False)
    m2, o2 = make(1)
    msd2, osd2 = get_state_dict(m2, o2)
    back = {"model": msd2, "optim": osd2}
    dcp.load(back, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=back["model"], optim_state_dict=back["optim"])
    for pid, st in o.state_dict()["state"].items():
        for slot, t in st.items():
            assert torch.equal(t, o2.state_dict()["state"][pid][slot]), (pid, slot)


def test_jax_adam_state_exported_to_dcp_resumes_torch_adam(tmp_path):
    """A torch model trained 3 Adam steps -> DCP -> ucp -> restored into JAX with optax.adam ->
    ucp.save -> export_dcp(param_group=...) -> torch's dcp.load + set_state_dict: torch gets its
    weights, moments and step (optax's count) back, and its next step equals the job that never
    stopped."""
    import jax
    import optax
    import torch.distributed.checkpoint as dcp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ucp_jax.torch import export_dcp

    def make(seed, steps=3):
        torch.manual_seed(seed)
        m = torch.nn.Sequential()
        m.add_module("fc1", torch.nn.Linear(4, 6))
        m.add_module("fc2", torch.nn.Linear(6, 2))
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
        for i in range(steps):
            torch.manual_seed(100 + i)
            m(torch.randn(3, 4)).pow(2).sum().backward()
            o.step()
            o.zero_grad()
        return m, o

    m, o = _dcp_saved(make, tmp_path / "dcp")
    ck = ucp.open(import_dcp(tmp_path / "dcp", tmp_path / "u", progress=False))
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    target: dict = {}
    for name, info in ck.atoms.items():
        a, b = name.split(".")
        spec = P("x") if info.shape[0] % 2 == 0 else P()
        target.setdefault(a, {})[b] = jax.ShapeDtypeStruct(info.shape, np.float32,
                                                           sharding=NamedSharding(mesh, spec))  # fmt: skip
    tx = optax.adam(1e-2)
    opt_t = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=NamedSharding(mesh, P())),
                         jax.eval_shape(tx.init, target))  # fmt: skip
    params, state = ucp.restore(ck, target, opt_t)
    assert int(state[0].count) == 3
    ucp.save(tmp_path / "jax", params, state)  # no step given: the count is optax's
    group = {k: v for k, v in o.state_dict()["param_groups"][0].items() if k != "params"}
    export_dcp(tmp_path / "jax", tmp_path / "exp", param_group=group, progress=False)
    m2, o2 = make(1, steps=1)
    msd2, osd2 = get_state_dict(m2, o2)
    back = {"model": msd2, "optim": osd2}
    dcp.load(back, checkpoint_id=str(tmp_path / "exp"), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=back["model"], optim_state_dict=back["optim"])
    want, got = o.state_dict(), o2.state_dict()
    for pid, st in want["state"].items():
        for slot, t in st.items():
            assert torch.equal(t, got["state"][pid][slot]), (pid, slot)
    for mm, oo in ((m, o), (m2, o2)):  # one more step of each: the same weights
        torch.manual_seed(200)
        mm(torch.randn(3, 4)).pow(2).sum().backward()
        oo.step()
    for k, t in m.state_dict().items():
        assert torch.equal(t, m2.state_dict()[k]), k


def test_dcp_state_under_a_key_of_its_own(tmp_path):
    """torch's DCP tutorial saves {"app": {"model": ..., "optim": ...}}: with the model prefix
    `app.model.`, the optimizer's `app.optim.state.*` are the atoms' slots (they were atoms of
    their own), and an export with both prefixes loads back (torch referee)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ucp_jax.torch import export_dcp

    def make(seed):
        torch.manual_seed(seed)
        m = torch.nn.Linear(4, 3)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(torch.randn(2, 4)).sum().backward()
        o.step()
        return m, o

    m, o = make(0)
    msd, osd = get_state_dict(m, o)
    dcp.save({"app": {"model": msd, "optim": osd}}, checkpoint_id=str(tmp_path / "src"),
             no_dist=True)  # fmt: skip
    ck = ucp.open(import_dcp(tmp_path / "src", tmp_path / "u", model_prefix="app.model.",
                             progress=False))  # fmt: skip
    assert sorted(ck.atoms) == ["bias", "weight"]
    assert sorted(ck.atoms["weight"].slots) == ["exp_avg", "exp_avg_sq", "fp32", "step"]
    export_dcp(ck.path, tmp_path / "out", model_prefix="app.model.", optim_prefix="app.optim.",
               progress=False)  # fmt: skip
    m2, o2 = make(1)
    msd2, osd2 = get_state_dict(m2, o2)
    back = {"app": {"model": msd2, "optim": osd2}}
    dcp.load(back, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=back["app"]["model"],
                   optim_state_dict=back["app"]["optim"])  # fmt: skip
    for pid, st in o.state_dict()["state"].items():
        for slot, t in st.items():
            assert torch.equal(t, o2.state_dict()["state"][pid][slot]), (pid, slot)
    assert o.state_dict()["param_groups"] == o2.state_dict()["param_groups"]


@pytest.mark.parametrize("agree", [True, False])
def test_adam_count_from_per_parameter_steps(tmp_path, agree):
    """torch's Adam keeps a step per parameter; an optax count restored from a DCP import takes
    them when they agree, and is refused, naming the count leaf and the steps, when they do not
    (a parameter that joined training later)."""
    import jax
    import optax
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 5))
    o = torch.optim.Adam(m.parameters())
    for _ in range(3):
        m(torch.ones(2, 4)).sum().backward()
        o.step()
    msd, osd = get_state_dict(m, o)
    if not agree:
        osd["state"]["1.bias"]["step"] = torch.tensor(2.0)
    with pytest.warns(UserWarning):
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "d", no_dist=True)
    path = import_dcp(tmp_path / "d", tmp_path / "u", progress=False)
    params = {k: np.zeros(tuple(t.shape), np.float32) for k, t in msd.items()}
    tx = optax.adam(1e-3)
    state = jax.tree.map(np.asarray, tx.init(params))
    if agree:
        got_params, got_state = ucp.restore(path, params, state)
        assert int(got_state[0].count) == 3
        np.testing.assert_array_equal(got_params["0.weight"], msd["0.weight"].numpy())
        np.testing.assert_array_equal(got_state[0].mu["1.bias"], osd["state"]["1.bias"]["exp_avg"])
    else:
        with pytest.raises(ucp.MismatchError, match=r"count.*differ.*2\.0.*3\.0"):
            ucp.restore(path, params, state)
