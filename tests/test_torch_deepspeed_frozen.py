"""DeepSpeed ZeRO-2 and ZeRO-3 with a frozen layer (requires_grad False): DeepSpeed keeps no
optimizer state for it, only its values in the model states. Every atom equals DeepSpeed's own
ds_to_universal, the frozen layer equals the model it was initialised as, and a ZeRO-3
checkpoint that lost a rank's model states is refused naming the file (it held a part of the
frozen layer), with nothing written."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds import tiny_model  # noqa: E402
from ds.fixtures import FROZEN, STEPS, TAG, TIED, ds_ckpts  # noqa: E402, F401
from test_torch_deepspeed import ds_universal_tensors  # noqa: E402

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main as ucp_main  # noqa: E402
from ucp_jax._src.frameworks.common.torch_arrays import to_numpy  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.zero import import_deepspeed  # noqa: E402

NAMES = [j.split(":")[0] for j in FROZEN]
FROZEN_ATOMS = ("blocks.0.fc1.weight", "blocks.0.fc1.bias")


@pytest.mark.parametrize("name", NAMES)
def test_frozen_layers_import_whole(name, ds_ckpts, tmp_path):  # noqa: F811
    ck = ucp.open(import_deepspeed(ds_ckpts.zero(name), tmp_path / "ck", progress=False))
    ref = ds_universal_tensors(ds_ckpts.universal(name))
    # ds_to_universal of ZeRO-3 leaves frozen parameters out (DeepSpeed 0.19.8): the import
    # has them all the same, checked against the model below
    assert set(ref) <= set(ck.atoms) and set(ck.atoms) - set(ref) <= set(FROZEN_ATOMS)
    for atom, slots in ref.items():
        for slot, want in slots.items():
            got = ck.read(atom, slot)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (atom, slot)
    init = tiny_model.init_model(0)
    for atom in FROZEN_ATOMS:  # never trained: the values it was initialised with
        assert set(ck.atoms[atom].slots) == {"fp32"}, atom
        want = to_numpy(init.get_parameter(atom).detach())
        np.testing.assert_array_equal(ck.read(atom, "fp32"), want)
    assert ck.step == STEPS
    assert ucp_main(["verify", str(tmp_path / "ck")]) == 0


def test_zero3_without_a_ranks_model_states_is_refused(ds_ckpts, tmp_path):  # noqa: F811
    src = tmp_path / "src"
    shutil.copytree(ds_ckpts.zero("z3_fp32_frozen"), src)
    tag = next(p for p in src.iterdir() if p.is_dir())
    victim = tag / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    os.remove(victim)
    with pytest.raises(ucp.UcpError, match=r"zero_pp_rank_1_mp_rank_00_model_states\.pt: missing"):
        import_deepspeed(src, tmp_path / "ck", progress=False)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "damage", ["rank-1-optim-gone", "rank-2-left-over", "no-latest", "truncated", "empty"]
)
def test_a_damaged_zero_folder_is_named_with_what_is_wrong(ds_ckpts, tmp_path, damage):  # noqa: F811
    src = tmp_path / "src"
    shutil.copytree(ds_ckpts.zero("z3_fp32_frozen"), src)
    tag = next(p for p in src.iterdir() if p.is_dir())
    optim0 = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    if damage == "rank-1-optim-gone":
        os.remove(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        needle = r"saved 2 data-parallel ranks .* \['zero_pp_rank_1_mp_rank_00_optim_states\.pt'\]"
    elif damage == "rank-2-left-over":  # a DP-3 save of the tag, then a DP-2 one over it:
        for kind in ("optim", "model"):  # its values were cut into 3 slices (wrong, and verified)
            shutil.copy(tag / f"zero_pp_rank_1_mp_rank_00_{kind}_states.pt",
                        tag / f"zero_pp_rank_2_mp_rank_00_{kind}_states.pt")  # fmt: skip
        needle = (r"saved 2 data-parallel ranks .* but 3 have optimizer files: "
                  r"\['zero_pp_rank_2_mp_rank_00_optim_states\.pt'\] are left from another save")  # fmt: skip
    elif damage == "no-latest":
        os.remove(src / "latest")
        needle = rf"no 'latest' file naming one: pass tag= \(--tag {tag.name}\)"
    elif damage == "truncated":
        data = optim0.read_bytes()
        optim0.write_bytes(data[: len(data) // 2])
        needle = r"optim_states\.pt: truncated or damaged"
    else:
        optim0.write_bytes(b"")
        needle = r"optim_states\.pt: empty"
    with pytest.raises(ucp.UcpError, match=needle):
        import_deepspeed(src, tmp_path / "ck", progress=False)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("name", [j.split(":")[0] for j in TIED])
def test_a_tied_head_is_its_embeddings_master_weights(name, ds_ckpts, tmp_path):  # noqa: F811
    # the head tied to the embedding (shared_params): DeepSpeed's zero_to_fp32 gives it the
    # embedding's fp32 master weights. The import took the module's bf16 copy under ZeRO-2 (off
    # by up to a bf16 rounding) and left the head out under ZeRO-3.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ck = ucp.open(import_deepspeed(ds_ckpts.zero(name), tmp_path / "ck", progress=False))
    ref = get_fp32_state_dict_from_zero_checkpoint(ds_ckpts.zero(name), tag=TAG)
    assert set(ck.atoms) == set(ref)
    for atom, want in ref.items():
        got = ck.read(atom, "fp32")
        assert got.tobytes() == to_numpy(want.detach()).tobytes(), atom
    np.testing.assert_array_equal(ck.read("head.weight", "fp32"), ck.read("emb.weight", "fp32"))
    assert set(ck.atoms["head.weight"].slots) == {"fp32"}  # its statistics are the embedding's
    assert "exp_avg" in ck.atoms["emb.weight"].slots
    assert ucp_main(["verify", str(tmp_path / "ck")]) == 0
