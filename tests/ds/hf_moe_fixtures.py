"""Session fixture: a Hugging Face Mixtral fine-tuned under DeepSpeed ZeRO-3 (tests/ds/train_hf_moe.py),
2 ranks on CPU, built once with `torchrun` and cached under .pytest_cache.

Cases (name: dtype, experts): hm_fused (fp32, transformers 5's fused `gate_up_proj`), hm_fused_bf16
(bf16, fused), hm_per_expert (fp32, transformers 4's `experts.<e>.w1/w2/w3`). Each folder is what
the HF Trainer leaves: `config.json`, `latest`, `global_step3/`, plus the engine's state at the save
(engine_state.pt) and DeepSpeed's own `zero_to_fp32` consolidation (<name>.zero_to_fp32.pt), the
referees. The cache key hashes these scripts and the versions.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import time

import pytest
from fixture_cache import built_once, source_key

from .fixtures import torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = ["hm_fused:fp32:fused", "hm_fused_bf16:bf16:fused", "hm_per_expert:fp32:per_expert"]
CASES = {j.split(":")[0]: (j.split(":")[1], j.split(":")[2]) for j in JOBS}
STEPS = 3

_CONSOLIDATE = """
import sys, torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
for folder in sys.argv[1:]:
    sd = get_fp32_state_dict_from_zero_checkpoint(folder)
    torch.save({k: v.float().clone() for k, v in sd.items()}, folder + ".zero_to_fp32.pt")
"""


@dataclasses.dataclass
class HFMoECheckpoints:
    root: str
    info: dict

    def path(self, name: str) -> str:
        """The checkpoint folder (config.json, latest, global_step3/)."""
        return os.path.join(self.root, name)

    def zero_to_fp32(self, name: str) -> dict:
        import torch

        return torch.load(self.path(name) + ".zero_to_fp32.pt")

    def engine_state(self, name: str) -> dict:
        import torch

        return torch.load(os.path.join(self.path(name), "engine_state.pt"))


def cache_key() -> str:
    from importlib.metadata import version

    files = ("train_hf_moe.py", "hf_moe_fixtures.py")
    versions = f"{version('torch')} {version('deepspeed')} {version('transformers')}"
    return source_key([os.path.join(HERE, f) for f in files], versions)


def build(root: str) -> dict:
    os.makedirs(root, exist_ok=True)
    t0 = time.time()
    torchrun(2, ["--root", root, *JOBS], root, script="train_hf_moe.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-c", _CONSOLIDATE, *(os.path.join(root, n) for n in CASES)],
                       cwd=root, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    if p.returncode:
        raise RuntimeError(f"zero_to_fp32 failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return {"_build_seconds": time.time() - t0}


def get(cache_dir: str) -> HFMoECheckpoints:
    """The cached checkpoints, built on first use (process-safe)."""
    return HFMoECheckpoints(*built_once(cache_dir, cache_key(), build))


@pytest.fixture(scope="session")
def hf_moe_ckpts(request: pytest.FixtureRequest) -> HFMoECheckpoints:
    """A HF Mixtral trained under DeepSpeed ZeRO-3, its engine state and zero_to_fp32, cached."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install deepspeed==0.19.8)")
    return get(str(request.config.cache.mkdir("hf_moe_ckpts")))
