"""DeepSpeed mixture-of-experts ZeRO checkpoints -> universal atoms (`ucp convert deepspeed`) and
back out (`ucp export deepspeed-universal`), which a DeepSpeed MoE job resumes.

The referee is the DeepSpeed engine itself: DeepSpeed's ds_to_universal cannot convert MoE
checkpoints, so the training script dumped every parameter's fp32 master and Adam moments from the
engine (safe_get_full_*) at the save, and kept training 2 steps (the losses a resumed job must
reproduce). Every expert is its own atom under its global index.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds.fixtures import torchrun  # noqa: E402
from ds.moe_fixtures import CASES, FROZEN, MIXED, STEPS, TAG, ds_moe_ckpts  # noqa: E402, F401

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main as ucp_main  # noqa: E402
from ucp_jax._src.errors import MismatchError  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.export import export_deepspeed_universal  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.zero import DeepSpeedFormatError, import_deepspeed  # noqa: E402

EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts.{e}.{p}"


@pytest.fixture(scope="module")
def imported(ds_moe_ckpts, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("moe_imported")
    return {n: import_deepspeed(ds_moe_ckpts.zero(n), root / n, progress=False)
            for n in [*CASES, MIXED]}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_expert_equals_the_engine(name, ds_moe_ckpts, imported):  # noqa: F811
    """Every atom (experts under their global index) and slot equals what the engine held."""
    ref = ds_moe_ckpts.engine_state(name)
    ck = ucp.open(imported[name])
    assert set(ck.atoms) == set(ref)
    experts = {n for n in ref if ".deepspeed_experts." in n}
    assert experts == {EXPERT.format(e=e, p=p) for e in range(4)
                       for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")}  # fmt: skip
    for atom, slots in ref.items():
        for slot, want in slots.items():
            got = ck.read(atom, slot)
            assert got.dtype == np.float32 and got.shape == tuple(want.shape), (atom, slot)
            np.testing.assert_array_equal(got, want.numpy(), err_msg=f"{atom}/{slot}")
        assert float(ck.read(atom, "step")) == STEPS
    # the experts are really different from one another (a swap would be seen)
    w = [ck.read(EXPERT.format(e=e, p="fc1.weight")) for e in range(4)]
    assert all(not np.array_equal(w[i], w[j]) for i in range(4) for j in range(i))
    assert ck.step == STEPS
    assert ck.manifest.source["deepspeed"]["dp_degree"] == CASES[name][3]
    groups = ck.manifest.source["deepspeed"]["param_groups"]
    assert [g.get("moe", False) for g in groups] == [False, True]
    assert groups[1]["name"] == f"ep_size_{CASES[name][2]}"


def test_moe_layers_of_two_expert_parallel_sizes(ds_moe_ckpts, tmp_path):  # noqa: F811
    """A block of 4 experts at EP 2 and one of 8 at EP 4 (a pyramid MoE): DeepSpeed orders the two
    MoE param groups from a set, so the rank files list them in different orders; every atom and
    slot still equals the engine (the groups are matched by name, not by position)."""
    orders = set()
    for r in range(4):
        path = os.path.join(
            ds_moe_ckpts.zero(MIXED), TAG, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        )
        osd = torch.load(path, weights_only=False)["optimizer_state_dict"]
        orders.add(tuple(g.get("name") for g in osd["base_optimizer_state"]["param_groups"]))
    assert len(orders) > 1, orders  # (else this fixture no longer shows what it is for)
    ref = ds_moe_ckpts.engine_state(MIXED)
    ck = ucp.open(import_deepspeed(ds_moe_ckpts.zero(MIXED), tmp_path / "u", progress=False))
    assert set(ck.atoms) == set(ref)
    assert len([n for n in ref if n.startswith("moe2.") and n.endswith("fc1.weight")]) == 8
    for atom, slots in ref.items():
        for slot, want in slots.items():
            np.testing.assert_array_equal(
                ck.read(atom, slot), want.numpy(), err_msg=f"{atom}/{slot}"
            )


def test_frozen_expert_parameters_come_from_their_expert_files(ds_moe_ckpts, tmp_path):  # noqa: F811
    """Experts whose fc2 is frozen: DeepSpeed keeps fc2 out of the optimizer and saves it only in
    the expert files; it is imported from there (weights, no moments), the rest as usual."""
    ref = ds_moe_ckpts.engine_state(FROZEN)
    ck = ucp.open(import_deepspeed(ds_moe_ckpts.zero(FROZEN), tmp_path / "u", progress=False))
    assert set(ck.atoms) == set(ref)
    frozen = [n for n in ref if ".fc2." in n and "deepspeed_experts" in n]
    assert len(frozen) == 8
    for atom, slots in ref.items():
        assert set(ck.atoms[atom].slots) - {"step"} == set(slots), atom
        for slot, want in slots.items():
            np.testing.assert_array_equal(
                ck.read(atom, slot), want.numpy(), err_msg=f"{atom}/{slot}"
            )


def test_expert_files_match_the_optimizer(ds_moe_ckpts, imported):  # noqa: F811
    """DeepSpeed's per-expert model files (bf16 module weights) agree with the imported masters."""
    folder = os.path.join(ds_moe_ckpts.zero("m_z2_bf16"), TAG)
    ck = ucp.open(imported["m_z2_bf16"])
    for e in range(4):
        sd = torch.load(os.path.join(folder, f"layer_0_expert_{e}_mp_rank_00_model_states.pt"))
        for key, t in sd.items():
            assert t.dtype == torch.bfloat16
            master = torch.from_numpy(ck.read(key)).to(torch.bfloat16)
            assert torch.equal(master, t), key


def test_cli_converts_moe(ds_moe_ckpts, tmp_path):  # noqa: F811
    assert (
        ucp_main(["convert", "deepspeed", ds_moe_ckpts.zero("m_z1_fp32"), str(tmp_path / "c")]) == 0
    )
    assert ucp_main(["verify", str(tmp_path / "c")]) == 0
    assert EXPERT.format(e=3, p="fc2.bias") in ucp.open(str(tmp_path / "c")).atoms


def _copy(ds_moe_ckpts, tmp_path, name="m_z1_fp32"):  # noqa: F811
    src = tmp_path / "src"
    shutil.copytree(ds_moe_ckpts.zero(name), src)
    return src, src / TAG


def test_missing_expert_file_is_named(ds_moe_ckpts, tmp_path):  # noqa: F811
    src, folder = _copy(ds_moe_ckpts, tmp_path)
    os.remove(folder / "layer_0_expert_2_mp_rank_00_model_states.pt")
    with pytest.raises(DeepSpeedFormatError, match=r"no expert model file holds.*experts\.2\."):
        import_deepspeed(src, tmp_path / "out", progress=False)


def test_expert_file_of_another_layout_is_refused(ds_moe_ckpts, tmp_path):  # noqa: F811
    """An expert file naming an expert the optimizer's groups do not have: no silent import."""
    src, folder = _copy(ds_moe_ckpts, tmp_path)
    f = folder / "layer_0_expert_3_mp_rank_00_model_states.pt"
    sd = torch.load(f)
    torch.save({k.replace("experts.3.", "experts.3.inner."): v for k, v in sd.items()}, f)
    with pytest.raises(DeepSpeedFormatError, match="not an expert parameter"):
        import_deepspeed(src, tmp_path / "out", progress=False)


def test_experts_swapped_between_files_are_refused(ds_moe_ckpts, tmp_path):  # noqa: F811
    """Expert files whose weights are another expert's (a layout other than DeepSpeed's default
    rank -> EP rank order would read so): the import fails before it commits anything."""
    src, folder = _copy(ds_moe_ckpts, tmp_path)
    f1, f2 = (folder / f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in (1, 2))
    sd1, sd2 = torch.load(f1), torch.load(f2)
    torch.save({k.replace("experts.2.", "experts.1."): v for k, v in sd2.items()}, f1)
    torch.save({k.replace("experts.1.", "experts.2."): v for k, v in sd1.items()}, f2)
    with pytest.raises(DeepSpeedFormatError, match=r"expert_1_.*differs from the optimizer"):
        import_deepspeed(src, tmp_path / "out", progress=False)
    with pytest.raises(ucp.NotACheckpointError):
        ucp.open(str(tmp_path / "out"))


def test_moe_without_zero_is_refused(ds_moe_ckpts, tmp_path):  # noqa: F811
    src, folder = _copy(ds_moe_ckpts, tmp_path)
    torch.save({"optimizer": {}}, folder / "expp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(DeepSpeedFormatError, match="without ZeRO"):
        import_deepspeed(src, tmp_path / "out", progress=False)


def test_moe_with_tensor_parallel_is_refused(ds_moe_ckpts, tmp_path):  # noqa: F811
    """Megatron-DeepSpeed MoE with TP: whether experts are TP slices or replicas is not recorded
    (DeepSpeed 0.19.8 does not run MoE with TP on CPU: its token gather fails on gloo)."""
    src, folder = _copy(ds_moe_ckpts, tmp_path)
    model = folder / "mp_rank_00_model_states.pt"
    sd = torch.load(model, weights_only=False)
    sd["checkpoint_parallel_dimensions"] = {"tp_degree": 2, "pp_degree": 1}
    torch.save(sd, model)
    for f in sorted(os.listdir(folder)):
        if "mp_rank_00" in f and not f.startswith("layer_"):
            shutil.copy(folder / f, folder / f.replace("mp_rank_00", "mp_rank_01"))
    with pytest.raises(DeepSpeedFormatError, match=r"2 tensor/pipeline-parallel ranks.*not record"):
        import_deepspeed(src, tmp_path / "out", progress=False)
    assert not os.path.exists(tmp_path / "out")


# ------------------------------------------------------------------- export and DeepSpeed resume

# job: (imported case, expert-parallel size of the resuming job and of the export, ZeRO, dtype)
RESUME = {
    "r_ep2": ("m_z1_fp32", 2, 2, "1:fp32"),  # same layout
    "r_ep1": ("m_z1_fp32", 1, 1, "1:fp32"),  # EP 2 -> EP 1 (experts replicated over 4 ranks)
    "r_z2": ("m_z2_bf16", 2, 2, "2:bf16"),
    "r_dp3": ("m_z1_fp32_dp3", 2, 2, "1:fp32"),  # DP 3 x EP 1 -> DP 4 x EP 2
    "r_wrong": ("m_z1_fp32", 2, 1, "1:fp32"),  # control: EP-1 layout loaded at EP 2
    # EP 2 and EP 4 blocks, each laid out at its own size (as the import recorded them)
    "r_mixed": (MIXED, "2+4", None, "1:fp32"),
}


@pytest.fixture(scope="module")
def resumed(ds_moe_ckpts, imported, tmp_path_factory):  # noqa: F811
    """Our exports, and one 4-rank torchrun in which DeepSpeed MoE jobs resume from each."""
    root = tmp_path_factory.mktemp("moe_resume")
    jobs = []
    for job, (case, ep_job, ep_export, zero) in RESUME.items():
        out = root / job / TAG
        export_deepspeed_universal(imported[case], out, expert_parallel=ep_export, progress=False)
        jobs.append(f"{job}:{zero}:{ep_job}:{out.parent}")
    result = root / "losses.json"
    torchrun(4, ["--universal", "--steps", "2", "--result", str(result), *jobs], str(root),
             script="train_moe.py")  # fmt: skip
    import json

    return root, json.loads(result.read_text())


def test_export_lays_experts_out_for_the_job(resumed, imported):
    """EP 2: zero/<local expert i>/ holds global experts i and 2 + i, one row per EP rank."""
    root, _ = resumed
    zero = root / "r_ep2" / TAG / "zero"
    ck = ucp.open(imported["m_z1_fp32"])
    assert sorted(p.name for p in zero.iterdir() if "experts" in p.name) == sorted(
        EXPERT.format(e=i, p=p)
        for i in range(2)
        for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    )
    for i in range(2):
        for slot in ("fp32", "exp_avg", "exp_avg_sq"):
            d = torch.load(
                zero / EXPERT.format(e=i, p="fc1.weight") / f"{slot}.pt", weights_only=True
            )
            assert d["is_expert_param"] is True and d["ep_num_experts"] == 2
            for r in range(2):
                want = ck.read(EXPERT.format(e=r * 2 + i, p="fc1.weight"), slot)
                np.testing.assert_array_equal(d["param"][r].numpy(), want)


@pytest.mark.parametrize("job", ["r_ep2", "r_ep1", "r_z2", "r_mixed"])
def test_deepspeed_moe_resumes_with_the_same_losses(job, resumed, ds_moe_ckpts):  # noqa: F811
    """The resumed job's losses are the ones the original job had after its save (same DP split)."""
    _, res = resumed
    case = RESUME[job][0]
    assert res[job]["start"] == STEPS and res[job]["global_steps"] == STEPS + 2
    want = ds_moe_ckpts.losses[case]["more"]
    np.testing.assert_allclose(res[job]["losses"], want, rtol=1e-6, atol=0)


def test_deepspeed_moe_resumes_on_another_layout(resumed, ds_moe_ckpts):  # noqa: F811
    """A DP 3 x EP 1 run resumed on DP 4 x EP 2 continues its curve (the per-rank gate loss sees
    other micro-batches, so equal to ~1e-5, not bit for bit)."""
    _, res = resumed
    want = ds_moe_ckpts.losses["m_z1_fp32_dp3"]["more"]
    np.testing.assert_allclose(res["r_dp3"]["losses"], want, rtol=1e-4)


def test_wrong_expert_layout_changes_the_losses(resumed, ds_moe_ckpts):  # noqa: F811
    """Control: an export laid out for EP 1 loaded by an EP-2 job gives both EP ranks experts 0
    and 1, and the losses leave the curve (so the tests above would see a layout mistake)."""
    _, res = resumed
    want = ds_moe_ckpts.losses["m_z1_fp32"]["more"]
    assert abs(res["r_wrong"]["losses"][0] - want[0]) > 1e-3


def test_export_of_layers_at_two_expert_parallel_sizes(imported, tmp_path):
    """DeepSpeed's universal loader slices every expert file by the rank in its largest expert
    group (EP 4 here): the EP-2 block's files stack, per EP-4 rank q, the expert rank q holds at
    EP 2 (global 2 * (q % 2) + i); a size per layer can be given, and one that leaves a layer out
    is refused by name."""
    ck = ucp.open(imported[MIXED])
    out = export_deepspeed_universal(ck.path, tmp_path / "m" / TAG, progress=False)
    first = "moe.deepspeed_moe.experts.deepspeed_experts."
    d = torch.load(os.path.join(out, "zero", f"{first}1.fc1.weight", "fp32.pt"), weights_only=True)
    assert d["ep_num_experts"] == 4
    for q in range(4):
        want = ck.read(f"{first}{2 * (q % 2) + 1}.fc1.weight")
        np.testing.assert_array_equal(d["param"][q].numpy(), want)
    sizes = {first: 2, "moe2.deepspeed_moe.experts.deepspeed_experts.": 4}
    again = export_deepspeed_universal(ck.path, tmp_path / "n" / TAG, expert_parallel=sizes,
                                       progress=False)  # fmt: skip
    e = torch.load(
        os.path.join(again, "zero", f"{first}1.fc1.weight", "fp32.pt"), weights_only=True
    )
    assert torch.equal(d["param"], e["param"])
    with pytest.raises(MismatchError, match=r"no size for the experts moe2\."):
        export_deepspeed_universal(ck.path, tmp_path / "x" / TAG, expert_parallel={first: 2})


def test_export_expert_parallel_must_divide_the_experts(imported, tmp_path):
    with pytest.raises(MismatchError, match="expert_parallel=3"):
        export_deepspeed_universal(imported["m_z1_fp32"], tmp_path / "x", expert_parallel=3)
    assert not (tmp_path / "x").exists()


def test_cli_exports_moe(imported, tmp_path):
    dst = tmp_path / "cli" / TAG
    argv = [
        "export",
        "deepspeed-universal",
        imported["m_z1_fp32"],
        str(dst),
        "--expert-parallel",
        "1",
    ]
    assert ucp_main(argv) == 0
    d = torch.load(dst / "zero" / EXPERT.format(e=3, p="fc2.bias") / "fp32.pt", weights_only=True)
    assert "is_expert_param" not in d and tuple(d["param"].shape) == (16,)
