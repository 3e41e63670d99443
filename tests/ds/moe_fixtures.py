"""Session fixture: real DeepSpeed mixture-of-experts checkpoints (tests/ds/train_moe.py), built
once with `torchrun` (gloo, CPU) and cached under .pytest_cache apart from the dense ones.

Cases (name: ZeRO stage, dtype, expert-parallel size, ranks): m_z1_fp32 (1, fp32, EP 2, 4 ranks:
EP 2 x expert-DP 2), m_z2_bf16 (2, bf16, EP 2, 4 ranks), m_z1_fp32_dp3 (1, fp32, EP 1, 3 ranks),
m_z1_mixed_ep (1, fp32, a block at EP 2 and one of 8 experts at EP 4, 4 ranks) and
m_z1_frozen_experts (as m_z1_fp32, every expert's fc2 frozen).
Each trains 3 steps, saves tag global_step3 under <root>/<name> with every rank's engine state
beside it (engine_rank<R>.pt: the referee, since DeepSpeed's ds_to_universal cannot convert MoE
checkpoints), then trains 2 more steps (the losses a resumed job must reproduce).
The cache key hashes these scripts and the versions.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import time

import pytest
from fixture_cache import built_once, source_key

from .fixtures import torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = {4: ["m_z1_fp32:1:fp32:2", "m_z2_bf16:2:bf16:2"], 3: ["m_z1_fp32_dp3:1:fp32:1"]}
CASES = {j.split(":")[0]: (int(j.split(":")[1]), j.split(":")[2], int(j.split(":")[3]), n)
         for n, jobs in JOBS.items() for j in jobs}  # fmt: skip
# a second MoE block of 8 experts at expert-parallel 4: two MoE param groups, which DeepSpeed
# orders differently on different ranks (kept out of CASES: not every test applies)
MIXED = "m_z1_mixed_ep"
JOBS[4].append(f"{MIXED}:1:fp32:2+4")
FROZEN = "m_z1_frozen_experts"  # every expert's fc2 frozen (requires_grad=False)
JOBS[4].append(f"{FROZEN}:1:fp32:2")
STEPS = 3
TAG = f"global_step{STEPS}"


@dataclasses.dataclass
class MoECheckpoints:
    root: str
    losses: dict

    def zero(self, name: str) -> str:
        """The DeepSpeed checkpoint directory (with `latest`)."""
        return os.path.join(self.root, name)

    def engine_state(self, name: str) -> dict[str, dict]:
        """{global parameter name: {"fp32", "exp_avg", "exp_avg_sq"}} as the engine held them."""
        import torch

        out: dict[str, dict] = {}
        for f in sorted(glob.glob(os.path.join(self.zero(name), "engine_rank*.pt"))):
            for k, v in torch.load(f)["params"].items():
                if k in out:  # replicas on other ranks hold the same values
                    assert all(torch.equal(out[k][s], v[s]) for s in v), (f, k)
                out[k] = v
        return out


def cache_key() -> str:
    from importlib.metadata import version

    files = ("moe_model.py", "train_moe.py", "moe_fixtures.py")
    versions = f"{version('torch')} {version('deepspeed')}"
    return source_key([os.path.join(HERE, f) for f in files], versions)


def build(root: str) -> dict:
    os.makedirs(root, exist_ok=True)
    t0 = time.time()
    losses: dict = {}
    for nproc, jobs in JOBS.items():
        out = os.path.join(root, f"losses_{nproc}.json")
        args = ["--root", root, "--steps", str(STEPS), "--result", out, *jobs]
        torchrun(nproc, args, root, script="train_moe.py")
        with open(out) as f:
            losses.update(json.load(f))
    losses["_build_seconds"] = time.time() - t0
    return losses


def get(cache_dir: str) -> MoECheckpoints:
    """The cached checkpoints, built on first use (process-safe)."""
    return MoECheckpoints(*built_once(cache_dir, cache_key(), build))


@pytest.fixture(scope="session")
def ds_moe_ckpts(request: pytest.FixtureRequest) -> MoECheckpoints:
    """Real DeepSpeed MoE checkpoints and the engine's state at the save, cached between runs."""
    pytest.importorskip("torch")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install deepspeed==0.19.8)")
    return get(str(request.config.cache.mkdir("ds_moe_ckpts")))
