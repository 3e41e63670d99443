"""DeepSpeed mixture-of-experts ZeRO checkpoints -> universal atoms (`ucp convert deepspeed`).

The referee is the DeepSpeed engine itself: DeepSpeed's ds_to_universal cannot convert MoE
checkpoints, so the training script dumped every parameter's fp32 master and Adam moments from the
engine (safe_get_full_*) at the save. Every expert is its own atom under its global index.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds.moe_fixtures import CASES, STEPS, TAG, ds_moe_ckpts  # noqa: E402, F401

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main as ucp_main  # noqa: E402
from ucp_jax._src.torch.deepspeed import DeepSpeedFormatError, import_deepspeed  # noqa: E402

EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts.{e}.{p}"


@pytest.fixture(scope="module")
def imported(ds_moe_ckpts, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("moe_imported")
    return {n: import_deepspeed(ds_moe_ckpts.zero(n), root / n, progress=False) for n in CASES}


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


def test_moe_without_zero_is_refused(ds_moe_ckpts, tmp_path):  # noqa: F811
    src, folder = _copy(ds_moe_ckpts, tmp_path)
    torch.save({"optimizer": {}}, folder / "expp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(DeepSpeedFormatError, match="without ZeRO"):
        import_deepspeed(src, tmp_path / "out", progress=False)
