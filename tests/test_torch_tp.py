"""Megatron-style tensor-parallel ZeRO checkpoints: the TP merge patterns of
`universal_checkpoint_info` (vocabulary padding, TP-replicated, row-parallel, averaged, two fused
sub-params, sub-params with shard widths), checked against DeepSpeed's own ds_to_universal.

The TP=2 x DP=2 checkpoint is written here, in DeepSpeed's ZeRO-1 file layout (with DeepSpeed's
own classes in the pickles), from the tensors of a real run, split the way Megatron splits them.
"""

from __future__ import annotations

import collections
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from ds.fixtures import ds_ckpts, to_universal  # noqa: E402, F401
from test_torch_deepspeed import ds_universal_tensors  # noqa: E402

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.zero import import_deepspeed  # noqa: E402

TP, DP, VOCAB, PADDED = 2, 2, 53, 54
QKV_W, QKV_B = r"blocks\.\d+\.qkv\.weight", r"blocks\.\d+\.qkv\.bias"
UC = {
    "universal_checkpoint_version": 0.4,
    "original_vocab_size": VOCAB,
    "padded_vocab_size": PADDED,
    "vocabulary_parameter_patterns": [r"emb\.weight", r"head\.weight"],
    "tp_replicated_parameter_patterns": [r"pos", r"blocks\.\d+\.ln\d\.", r"ln_f\."],
    "parameter_with_row_parallelism_patterns": [r"blocks\.\d+\.(proj|fc2)\.weight"],
    "parameter_to_average_patterns": [r"blocks\.\d+\.(proj|fc2)\.bias"],
    "parameter_with_2_sub_params_cat_dim_0": [r"blocks\.\d+\.fc1\."],
    "parameter_with_sub_params": [
        {"patterns": [QKV_W], "shape": ((24, 24, 24), 24), "partition_dim": 0},
        {"patterns": [QKV_B], "shape": ((24, 24, 24),), "partition_dim": 0},
    ],
    "sub_param_shard_widths": {QKV_W: [[12, 12]] * 3, QKV_B: [[12, 12]] * 3},
}


def tp_slices(name: str, full: np.ndarray, r: int, slot: str) -> np.ndarray:
    """Rank r's TP slice of a full parameter, split the Megatron way."""
    if name in ("emb.weight", "head.weight"):
        padded = np.concatenate([full, np.zeros((PADDED - VOCAB, full.shape[1]), full.dtype)])
        return np.split(padded, TP)[r]
    if name == "pos" or ".ln" in name or name.startswith("ln_f"):
        return full
    if name.endswith(("proj.weight", "fc2.weight")):
        return np.split(full, TP, axis=1)[r]
    if name.endswith(("proj.bias", "fc2.bias")):  # averaged: the ranks hold different values
        return (full * (1.0 + 0.5 * r) + r).astype(full.dtype)
    if ".fc1." in name:
        gate, up = np.split(full, 2)
        return np.concatenate([np.split(gate, TP)[r], np.split(up, TP)[r]])
    if ".qkv." in name:
        return np.concatenate([np.split(s, TP)[r] for s in np.split(full, 3)])
    raise AssertionError(name)


def write_zero1(folder: str, ranks: dict[int, dict[str, dict[str, np.ndarray]]], uc: dict,
                tp: int, pp: int) -> None:  # fmt: skip
    """DeepSpeed ZeRO-1 files (fp32, DP=2, uneven partitions, padded last rank) for a grid of
    model-parallel ranks mp = pp_index * tp + tp_index, each holding `ranks[mp]` (name -> slots)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    tag = os.path.join(folder, "global_step3")
    os.makedirs(tag)
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write("global_step3")
    cfg = {"train_batch_size": 4, "zero_optimization": {"stage": 1}}
    for r, sl in ranks.items():
        names = list(sl)
        shapes = collections.OrderedDict((n, torch.Size(sl[n]["fp32"].shape)) for n in names)
        torch.save({
            "module": collections.OrderedDict((n, torch.from_numpy(sl[n]["fp32"])) for n in names),
            "buffer_names": [], "optimizer": None, "param_shapes": [shapes],
            "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
            "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "skipped_steps": 0,
            "global_steps": 3, "global_samples": 12, "dp_world_size": DP, "mp_world_size": tp * pp,
            "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp},
            "ds_config": cfg, "ds_version": "0.19.8", "universal_checkpoint_info": uc,
        }, os.path.join(tag, f"mp_rank_{r:02d}_model_states.pt"))  # fmt: skip
        flat = {s: np.concatenate([sl[n][s].reshape(-1) for n in names]) for s in sl[names[0]]}
        total = flat["fp32"].size
        part = 2 * math.ceil(total / (2 * DP))  # aligned partitions; the last one is padded
        starts = np.cumsum([0] + [sl[n]["fp32"].size for n in names])
        for d in range(DP):
            lo, hi = d * part, min((d + 1) * part, total)
            pad = (d + 1) * part - hi
            mapping = collections.OrderedDict()
            for n, a, b in zip(names, starts[:-1], starts[1:]):
                if max(a, lo) < min(b, hi):
                    mapping[n] = fragment_address(numel=int(min(b, hi) - max(a, lo)),
                                                  start=int(max(a, lo) - lo))  # fmt: skip

            def padded(x, lo=lo, hi=hi, pad=pad):
                return torch.from_numpy(np.concatenate([x[lo:hi], np.zeros(pad, x.dtype)]))

            osd = {
                "loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False, "overflow": False,
                "clip_grad": 1.0,
                "base_optimizer_state": {
                    "state": {0: {"step": torch.tensor(3.0), "exp_avg": padded(flat["exp_avg"]),
                                  "exp_avg_sq": padded(flat["exp_avg_sq"])}},
                    "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8,
                                      "weight_decay": 0.1, "params": [0]}],
                },
                "single_partition_of_fp32_groups": [torch.from_numpy(flat["fp32"][lo:hi].copy())],
                "zero_stage": ZeroStageEnum.optimizer_states, "group_paddings": [pad],
                "param_alignment_paddings": [[0] * len(names)], "partition_count": [DP],
                "ds_version": "0.19.8", "param_slice_mappings": [mapping],
            }  # fmt: skip
            torch.save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.19.8"},
                       os.path.join(tag, f"zero_pp_rank_{d}_mp_rank_{r:02d}_optim_states.pt"))  # fmt: skip


def write_tp_checkpoint(folder: str, full: dict[str, dict[str, np.ndarray]]) -> None:
    """TP=2 x DP=2, every parameter split the Megatron way."""
    ranks = {r: {n: {s: tp_slices(n, a, r, s) for s, a in full[n].items()} for n in full}
             for r in range(TP)}  # fmt: skip
    write_zero1(folder, ranks, UC, tp=TP, pp=1)


def full_tensors(ds_ckpts) -> dict[str, dict[str, np.ndarray]]:  # noqa: F811
    from ds.tiny_model import TinyGPT

    ref = ds_universal_tensors(ds_ckpts.universal("z1_fp32"))
    m = TinyGPT()
    return {n: {s: ref[n][s].reshape(m.get_parameter(n).shape)
                for s in ("fp32", "exp_avg", "exp_avg_sq")} for n, _ in m.named_parameters()}  # fmt: skip


@pytest.fixture(scope="module")
def tp_ckpt(ds_ckpts, tmp_path_factory):  # noqa: F811
    """A TP=2 x DP=2 checkpoint, its ds_to_universal conversion and our import."""
    root = tmp_path_factory.mktemp("tp")
    full = full_tensors(ds_ckpts)
    write_tp_checkpoint(str(root / "tp"), full)
    to_universal([(str(root / "tp" / "global_step3"), str(root / "u" / "global_step3"))], str(root))
    ours = import_deepspeed(root / "tp", root / "ours", progress=False)
    return full, ds_universal_tensors(str(root / "u" / "global_step3")), ucp.open(ours)


def test_tp_merge_equals_ds_to_universal(tp_ckpt):
    _, ref, ck = tp_ckpt
    assert sorted(ref) == sorted(ck.atoms)
    for name, slots in ref.items():
        for slot, want in slots.items():
            got = ck.read(name, slot)
            assert got.dtype == want.dtype, (name, slot)
            assert got.shape == want.shape or slot == "step", (name, slot, got.shape, want.shape)
            assert got.tobytes() == want.tobytes(), (name, slot)


def test_tp_merge_recovers_the_full_parameters(tp_ckpt):
    full, _, ck = tp_ckpt
    src = ck.manifest.source["deepspeed"]
    assert (src["tp_degree"], src["dp_degree"]) == (TP, DP)
    for name, slots in full.items():
        for slot, want in slots.items():
            got = ck.read(name, slot)
            if name.endswith(("proj.bias", "fc2.bias")):
                want = ((want + (want * 1.5 + 1).astype(want.dtype)) / 2).astype(want.dtype)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {slot}")
    pats = {n: [p["type"] for p in a.pattern] for n, a in ck.atoms.items()}
    assert pats["emb.weight"] == ["VocabPadded", "Partitioned"]
    assert pats["blocks.0.proj.weight"] == ["Partitioned"]
    assert ck.atoms["blocks.0.proj.weight"].pattern[0]["axis"] == 1
    assert pats["blocks.0.ln1.weight"] == ["Replicated"]
    assert pats["blocks.1.fc2.bias"] == ["Averaged"]


def test_pipeline_stages_with_a_tied_embedding(ds_ckpts, tmp_path):  # noqa: F811
    """PP=2 x DP=2 (mp_rank_00 = stage 0, mp_rank_01 = stage 1): stage 1 also holds the tied
    embedding, which `pipeline_replicated_parameter_patterns` says to take from stage 0 only."""
    full = full_tensors(ds_ckpts)
    stage0 = [n for n in full if n in ("emb.weight", "pos") or n.startswith("blocks.0.")]
    stage1 = [n for n in full if n not in stage0]
    tied = {s: (a + 100).astype(a.dtype) for s, a in full["emb.weight"].items()}  # a stale copy
    ranks = {
        0: {n: full[n] for n in stage0},
        1: {"emb.weight": tied, **{n: full[n] for n in stage1}},
    }
    uc = {"pipeline_replicated_parameter_patterns": [r"emb\.weight"]}
    write_zero1(str(tmp_path / "pp"), ranks, uc, tp=1, pp=2)
    to_universal([(str(tmp_path / "pp" / "global_step3"), str(tmp_path / "u" / "global_step3"))],
                 str(tmp_path))  # fmt: skip
    ref = ds_universal_tensors(str(tmp_path / "u" / "global_step3"))
    ck = ucp.open(import_deepspeed(tmp_path / "pp", tmp_path / "ours", progress=False))
    assert sorted(ref) == sorted(ck.atoms) == sorted(full)
    assert ck.manifest.source["deepspeed"]["pp_degree"] == 2
    for name, slots in ref.items():
        for slot, want in slots.items():
            assert ck.read(name, slot).tobytes() == want.tobytes(), (name, slot)
        for slot, want in full[name].items():
            np.testing.assert_array_equal(ck.read(name, slot), want, err_msg=f"{name} {slot}")
