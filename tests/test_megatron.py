"""Megatron-Core torch_dist checkpoints -> universal atoms, checked against torch's own
`dcp_to_torch_save` of the same folders, then restored onto the JAX Llama model on two meshes
(logits equal Megatron's forward)."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mcore.fixtures import (  # noqa: E402, F401
    CASES,
    EXPORTS,
    HEADS,
    JAX_EXPORTS,
    LEGACY_CASE,
    RESUMES,
    VOCAB,
    mcore_ckpts,
)

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main as ucp_main  # noqa: E402
from ucp_jax._src.frameworks.common.torch_arrays import to_numpy  # noqa: E402
from ucp_jax._src.frameworks.dcp.read import import_dcp  # noqa: E402
from ucp_jax._src.frameworks.megatron.common import MegatronFormatError  # noqa: E402
from ucp_jax._src.frameworks.megatron.export import MegatronExportError, export_megatron  # noqa: E402
from ucp_jax._src.frameworks.megatron.read import import_megatron  # noqa: E402
from ucp_jax.demo import Layout  # noqa: E402
from ucp_jax.models import llama as L  # noqa: E402

QPG, HD, GROUPS = 2, 8, 2  # the script's GQA: 4 heads of 8 in 2 query groups
L_ = "decoder.layers."


def reference(sd: dict, name: str, layer: int | None) -> np.ndarray:
    """What atom `name` must hold, from the merged global tensor, by Megatron's documented
    layouts (written independently of the importer: per-group row ranges, half splits)."""
    w = sd[name].float().numpy()
    if layer is not None:
        w = w[layer]
    if name.endswith("linear_qkv.weight"):
        per = (QPG + 2) * HD
        q = [
            w[g * per + h * HD : g * per + (h + 1) * HD] for g in range(GROUPS) for h in range(QPG)
        ]
        k = [w[g * per + QPG * HD : g * per + (QPG + 1) * HD] for g in range(GROUPS)]
        v = [w[g * per + (QPG + 1) * HD : (g + 1) * per] for g in range(GROUPS)]
        return np.concatenate(q + k + v, 0).T
    if name in ("embedding.word_embeddings.weight",):
        return w[:VOCAB]
    if name == "output_layer.weight":
        return w[:VOCAB].T
    return w.T if w.ndim == 2 else w


ATOMS = {
    "embedding.word_embeddings.weight": "embed.embedding",
    "output_layer.weight": "unembed.kernel",
    "decoder.final_layernorm.weight": "ln_f.scale",
    L_ + "self_attention.linear_qkv.layer_norm_weight": "ln1.scale",
    L_ + "self_attention.linear_qkv.weight": "attn.qkv.kernel",
    L_ + "self_attention.linear_proj.weight": "attn.out.kernel",
    L_ + "mlp.linear_fc1.layer_norm_weight": "ln2.scale",
    L_ + "mlp.linear_fc1.weight": "mlp.gate_up.kernel",
    L_ + "mlp.linear_fc2.weight": "mlp.down.kernel",
}


def _slots(sd: dict, name: str) -> dict[str, str]:
    """slot -> the key of the merged state dict holding it (fp32 master where there is one)."""
    master = next(
        (p + name for p in ("optimizer.state.fp32_param.", "optimizer.state.param.")
         if p + name in sd), name)  # fmt: skip
    return {"fp32": master, "exp_avg": "optimizer.state.exp_avg." + name,
            "exp_avg_sq": "optimizer.state.exp_avg_sq." + name}  # fmt: skip


def _need(mcore_ckpts, case: str) -> None:  # noqa: F811
    if case not in mcore_ckpts.results:  # only the legacy case can be absent
        if os.environ.get("CI"):
            raise RuntimeError("CI needs megatron-core 0.16.1 in .venv/mcore-0.16.1 (Makefile)")
        pytest.skip("megatron-core 0.16.1 is not installed in <venv>/mcore-0.16.1 (Makefile)")


@pytest.mark.parametrize("case", [*CASES, LEGACY_CASE])
def test_import_matches_dcp_to_torch_save(mcore_ckpts, tmp_path, case):  # noqa: F811
    """Every weight and Adam moment after import equals torch's merge of the same checkpoint
    (for dp_reshardable: Megatron's own fully_reshardable save of the same state; v016_tp2: the
    0.16.1 layout, common.pt and two files per rank)."""
    _need(mcore_ckpts, case)
    if case == LEGACY_CASE:
        files = sorted(os.listdir(mcore_ckpts.path(case)))
        assert "common.pt" in files and "__1_1.distcp" in files, files
    ref = case + "_asfull" if case.endswith("_dp") else case
    sd = torch.load(mcore_ckpts.torch_save(ref), weights_only=False)
    ck = ucp.Checkpoint(import_megatron(mcore_ckpts.path(case), tmp_path / "u", heads=HEADS,
                                        vocab_size=VOCAB))  # fmt: skip
    assert ck.step == 2
    seen = 0
    for name, atom in ATOMS.items():
        for slot, key in _slots(sd, name).items():
            assert key in sd, key
            for layer in range(4) if name.startswith(L_) else [None]:
                a = atom if layer is None else f"blocks.{layer}.{atom}"
                got, want = ck.read(a, slot), reference(sd | {name: sd[key]}, name, layer)
                assert got.dtype == np.float32 and got.shape == want.shape, (a, slot)
                np.testing.assert_array_equal(got, want, err_msg=f"{case} {a} {slot}")
                seen += 1
    assert seen == 3 * (3 + 6 * 4)
    assert sorted(ck.atoms) == sorted(
        [a for n, a in ATOMS.items() if not n.startswith(L_)]
        + [f"blocks.{i}.{a}" for n, a in ATOMS.items() if n.startswith(L_) for i in range(4)]
    )


def test_dcp_importer_reads_megatron_metadata(mcore_ckpts, tmp_path):  # noqa: F811
    """`ucp convert dcp` accepts the planner classes Megatron's .metadata pickles; every tensor
    equals torch's dcp_to_torch_save."""
    sd = torch.load(mcore_ckpts.torch_save("tp2pp2_bf16"), weights_only=False)
    ck = ucp.Checkpoint(import_dcp(mcore_ckpts.path("tp2pp2_bf16"), tmp_path / "d"))
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    assert len(tensors) > 20
    for k, v in tensors.items():
        got = ck.read(k)
        np.testing.assert_array_equal(got, to_numpy(v), err_msg=k)
        assert got.dtype == to_numpy(v).dtype


def _logits(ckpt: str, layout: Layout, tokens: np.ndarray) -> np.ndarray:
    cfg = L.config_from_checkpoint(ckpt)
    mesh = L.make_mesh(layout)
    params, _ = ucp.restore(
        ckpt, L.abstract_params(cfg, layout, mesh), rules=L.ucp_rules(cfg, layout), cast=True
    )
    return np.asarray(L.make_logits_fn(cfg, layout, mesh)(params, tokens))


def test_restore_computes_megatrons_forward(mcore_ckpts, tmp_path):  # noqa: F811
    """The Llama model restored from the TP2 fp32 Megatron checkpoint on two meshes gives the
    logits Megatron's own forward gave on the same batch (<= 1e-5 relative)."""
    g = torch.Generator().manual_seed(7)  # the script's ref_tokens()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g).numpy()
    cases = {"tp2": (Layout(tensor=2), Layout(stages=2, data=2, tensor=2))}
    if LEGACY_CASE in mcore_ckpts.results:
        cases[LEGACY_CASE] = (Layout(fsdp=2, tensor=2),)
    for case, layouts in cases.items():
        ckpt = import_megatron(mcore_ckpts.path(case), tmp_path / case, heads=HEADS,
                               vocab_size=VOCAB)  # fmt: skip
        ref = np.asarray(mcore_ckpts.results[case]["logits"], np.float32)[..., :VOCAB]
        for layout in layouts:
            out = _logits(ckpt, layout, tokens)
            err = float((np.abs(out - ref).max(-1) / np.abs(ref).max(-1)).max())
            assert err <= 1e-5, (case, layout, err)


def test_cli_convert_megatron(mcore_ckpts, tmp_path, capsys):  # noqa: F811
    dst = tmp_path / "cli"
    src = mcore_ckpts.path("tp2dp2_full")
    rc = ucp_main(["convert", "megatron", src, str(dst), "--heads", "4", "--vocab-size", "60"])
    assert rc in (0, None)
    ck = ucp.Checkpoint(str(dst))
    assert ck.atom("blocks.3.attn.qkv.kernel").shape == (32, 64)
    assert ck.atom("embed.embedding").shape == (60, 32)
    assert L.config_from_checkpoint(str(dst)).n_kv_heads == 2


def test_refusals(mcore_ckpts, tmp_path):  # noqa: F811
    src = mcore_ckpts.path("tp2")
    with pytest.raises(MegatronFormatError, match="heads"):
        import_megatron(src, tmp_path / "a")  # no args in the common state: heads unknown
    with pytest.raises(MegatronFormatError, match="heads=3"):
        import_megatron(src, tmp_path / "b", heads=3)
    with pytest.raises(MegatronFormatError, match="vocab_size=65"):
        import_megatron(src, tmp_path / "c", heads=4, vocab_size=65)
    with pytest.raises(ucp.NotACheckpointError):
        import_megatron(str(tmp_path), tmp_path / "d", heads=4)
    assert not os.path.exists(tmp_path / "b")


@pytest.mark.parametrize("name", sorted(n for n in RESUMES if n.startswith("ours_")))
def test_megatron_resumes_from_export(mcore_ckpts, name):  # noqa: F811
    """Megatron-Core loads our export at another TP/PP than wrote the source (TP1; TP2xPP2) and
    its next losses equal those of Megatron resumed from its own checkpoint at that layout.

    ours_nosrc: the same state saved by a JAX trainer (no Megatron parameter groups), exported
    with the job's lr, weight decay and betas: Megatron's optimizer takes betas from the
    checkpoint, and the export's (0.9, 0.999) had changed the next loss (2.2257 for 2.2343)."""
    ours = mcore_ckpts.results[name]["resumed"]
    own = mcore_ckpts.results[name.replace("ours_", "own_").replace("nosrc", "tp2")]["resumed"]
    assert len(ours) == 2 and ours == own, (ours, own)
    export = RESUMES[name][3]
    export = JAX_EXPORTS[export][0] if export in JAX_EXPORTS else export  # (x_nosrc: x_tp2's)
    src = mcore_ckpts.results[EXPORTS[export][0]]
    np.testing.assert_allclose(ours, src["resumed"], rtol=2e-2)  # the job that never stopped


@pytest.mark.parametrize("x", sorted(EXPORTS))
def test_export_equals_source_tensors(mcore_ckpts, tmp_path, x):  # noqa: F811
    """import -> export gives back every tensor of the source checkpoint (torch's merge of both)."""
    src = torch.load(mcore_ckpts.torch_save(EXPORTS[x][0]), weights_only=False)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(tmp_path / "x.pt")
    dcp_to_torch_save(mcore_ckpts.path(x), out)
    got = torch.load(out, weights_only=False)
    want = {k: v for k, v in src.items() if isinstance(v, torch.Tensor)}
    assert sorted(k for k, v in got.items() if isinstance(v, torch.Tensor)) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k
    assert got["common_state/shard_0_1"][0]["iteration"] == 2


def _groups(folder: str) -> list[dict]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder + ".pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)["common_state/shard_0_1"][0]["optimizer"][
        "param_groups"]  # fmt: skip


def test_hyperparameters_of_a_source_without_groups(mcore_ckpts, tmp_path, caplog):  # noqa: F811
    """A JAX-saved source records no parameter groups: the export names what Megatron will load
    when left at Adam's defaults; the CLI's flags set them; a beta of 1 is refused."""
    u = mcore_ckpts.path("u_x_nosrc")
    with caplog.at_level("WARNING"):
        export_megatron(u, tmp_path / "d")
    assert "lr/min_lr/weight_decay/betas/eps" in caplog.text and "--betas" in caplog.text
    assert {g["betas"] for g in _groups(str(tmp_path / "d"))} == {(0.9, 0.999)}
    caplog.clear()
    args = ["export", "megatron", u, str(tmp_path / "c"), "--lr", "0.01", "--weight-decay", "0.1",
            "--betas", "0.9", "0.95", "--eps", "1e-6", "--min-lr", "0.001"]  # fmt: skip
    with caplog.at_level("WARNING"):
        assert ucp_main(args) in (0, None)
    assert "records no Megatron parameter groups" not in caplog.text
    for g in _groups(str(tmp_path / "c")):
        assert (g["lr"], g["max_lr"], g["min_lr"], g["weight_decay"], g["betas"], g["eps"]) == (
            0.01, 0.01, 0.001, 0.1, (0.9, 0.95), 1e-6)  # fmt: skip
    with pytest.raises(MegatronExportError, match=r"betas=\(0.9, 1.0\)"):
        export_megatron(u, tmp_path / "x", betas=(0.9, 1.0))
    # a Megatron source's groups are kept, with what is given put in
    g = _groups(export_megatron(mcore_ckpts.path("u_x_tp2"), tmp_path / "m", eps=1e-5))
    assert {(x["betas"], x["eps"], x["max_lr"]) for x in g} == {((0.9, 0.95), 1e-5, 0.01)}


def test_export_cli_and_refusals(mcore_ckpts, tmp_path):  # noqa: F811
    u = import_megatron(mcore_ckpts.path("tp2"), tmp_path / "u", heads=HEADS, vocab_size=VOCAB)
    assert ucp_main(["export", "megatron", u, str(tmp_path / "m"), "--padded-vocab", "64"]) in (
        0, None)  # fmt: skip
    back = ucp.Checkpoint(import_megatron(str(tmp_path / "m"), tmp_path / "b", heads=HEADS,
                                          vocab_size=VOCAB))  # fmt: skip
    ref = ucp.Checkpoint(u)
    for atom in ref.atoms:
        for slot in ("fp32", "exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(back.read(atom, slot), ref.read(atom, slot))
    with pytest.raises(MegatronExportError, match="dtype"):
        export_megatron(u, tmp_path / "x", dtype="fp16")
    with pytest.raises(FileExistsError):
        export_megatron(u, tmp_path / "m")


def test_refuses_unsafe_pickles_and_other_models(mcore_ckpts, tmp_path):  # noqa: F811
    """A pickle naming a global outside the allow-list is refused before anything runs; a
    tensor the GPT mapping does not know (here a qk-layernorm) is refused by name."""
    import fractions
    import shutil

    from ucp_jax.torch import UnsafePickleError

    bad = tmp_path / "bad"
    shutil.copytree(mcore_ckpts.path("tp2"), bad)
    torch.save(
        {"iteration": fractions.Fraction(1, 3)}, bad / "common.pt"
    )  # the legacy common state
    with pytest.raises(UnsafePickleError, match=r"fractions\.Fraction"):
        import_megatron(str(bad), tmp_path / "u", heads=HEADS)
    assert not os.path.exists(tmp_path / "u")

    import torch.distributed.checkpoint as dcp

    sd = torch.load(mcore_ckpts.torch_save("tp2"), weights_only=False)
    sd = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    sd["decoder.layers.self_attention.q_layernorm.weight"] = torch.ones(4, 8)
    dcp.save(sd, checkpoint_id=str(tmp_path / "qk"), no_dist=True)
    (tmp_path / "qk" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    with pytest.raises(MegatronFormatError, match=r"q_layernorm\.weight"):
        import_megatron(str(tmp_path / "qk"), tmp_path / "v", heads=HEADS)


def test_dp_reshardable_refuses_several_buckets(mcore_ckpts):  # noqa: F811
    """Several buckets per buffer are refused by name (their saved windows lose elements)."""
    from ucp_jax._src.frameworks.common.dcp_files import read_metadata, read_objects
    from ucp_jax._src.frameworks.megatron.buckets import bucket_tensors
    from ucp_jax._src.frameworks.megatron.config import infer_config

    folder = mcore_ckpts.path("tp2dp2_bf16_dp")
    md = read_metadata(folder)
    objects = read_objects(folder, md)
    key = "optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded"
    ((dtypes, sizes),) = objects[key][0].items()
    objects[key] = [{dtypes: [sizes[0] - 64, 64]}]
    shapes = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    cfg = infer_config(shapes, None, folder, heads=HEADS)
    with pytest.raises(MegatronFormatError, match="2 buckets"):
        bucket_tensors(folder, md, objects, shapes, cfg)


@pytest.mark.parametrize(
    "content, match",
    [
        (b"{" + b" " * (2 << 20) + b"}", "more than the 1048576 accepted"),
        (b"[" * 100_000 + b"]" * 100_000, "nests 100000 levels deep"),
        (b'{"a": ' + b"[" * 80 + b"]" * 80 + b"}", "nests 81 levels deep"),
        (b'["torch_dist"]', "is a JSON array, expected a JSON object"),
        (b"\xff\xfe", "is not UTF-8 text"),
        (b'{"sharded_backend": "zarr"}', "sharded_backend is 'zarr'"),
    ],
    ids=["huge", "deep-for-python", "deep", "not-an-object", "not-utf8", "zarr"],
)
def test_hostile_metadata_json(tmp_path, content, match):
    """metadata.json is untrusted input: bounded in size and depth, refused with the file named."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "metadata.json").write_bytes(content)
    with pytest.raises(MegatronFormatError, match=match) as e:
        import_megatron(str(src), tmp_path / "dst", heads=4)
    assert str(src / "metadata.json") in str(e.value)
    assert not (tmp_path / "dst").exists()


def test_metadata_json_symlink_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "elsewhere.json").write_text('{"sharded_backend": "torch_dist"}')
    (src / "metadata.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(MegatronFormatError, match="symbolic link"):
        import_megatron(str(src), tmp_path / "dst", heads=4)
