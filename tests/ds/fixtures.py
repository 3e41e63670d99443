"""Session fixture: real DeepSpeed checkpoints of the tiny GPT, and DeepSpeed's own universal
conversion of each, built once with `torchrun` (gloo, CPU) and cached under .pytest_cache.

Cases (name: ZeRO stage, dtype, DP size): z1_fp32 (1, fp32, 2), z2_bf16 (2, bf16, 2),
z3_bf16 (3, bf16, 2), z2_fp32_dp3 (2, fp32, 3), z1_bf16_dp3 (1, bf16, 3), z3_fp32_dp3 (3, fp32, 3);
and z2_fp32_frozen, z3_fp32_frozen (DP 2, a frozen layer); z2_bf16_tied, z3_bf16_tied (DP 2, the
head tied to the embedding; not converted by ds_to_universal).
Each trains 3 steps and saves tag global_step3 under <root>/<name>; DeepSpeed's ds_to_universal
writes <root>/u_<name>/global_step3. The cache key hashes these scripts and the versions.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
from fixture_cache import built_once, source_key
from fixture_cache import torchrun as run_script

HERE = os.path.dirname(os.path.abspath(__file__))
DP2 = ["z1_fp32:1:fp32", "z2_bf16:2:bf16", "z3_bf16:3:bf16"]
DP3 = ["z2_fp32_dp3:2:fp32", "z1_bf16_dp3:1:bf16", "z3_fp32_dp3:3:fp32"]
# with the first block's fc1 frozen (requires_grad False), DP 2; kept out of CASES (whose tests
# expect optimizer state in every atom)
FROZEN = ["z2_fp32_frozen:2:fp32", "z3_fp32_frozen:3:fp32"]
# the head tied to the embedding (DeepSpeed's shared_params), bf16 (its module copy is rounded)
TIED = ["z2_bf16_tied:2:bf16", "z3_bf16_tied:3:bf16"]
CASES = {j.split(":")[0]: (int(j.split(":")[1]), j.split(":")[2], 2) for j in DP2} | {
    j.split(":")[0]: (int(j.split(":")[1]), j.split(":")[2], 3) for j in DP3
}
STEPS = 3
TAG = f"global_step{STEPS}"


@dataclasses.dataclass
class DSCheckpoints:
    root: str
    losses: dict

    def zero(self, name: str) -> str:
        """The DeepSpeed checkpoint directory (with `latest`)."""
        return os.path.join(self.root, name)

    def universal(self, name: str) -> str:
        """DeepSpeed's ds_to_universal output folder (the tag folder holding zero/)."""
        return os.path.join(self.root, f"u_{name}", TAG)


def torchrun(
    nproc: int, args: list[str], cwd: str, timeout: int = 600, script: str = "train_ds.py"
) -> None:
    """Run a tests/ds script (train_ds.py) under torchrun; raise with its output on failure."""
    run_script(os.path.join(HERE, script), nproc, args, cwd, timeout=timeout)


def to_universal(pairs: list[tuple[str, str]], cwd: str) -> None:
    args = [x for pair in pairs for x in pair]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, os.path.join(HERE, "to_universal.py"), *args], cwd=cwd,
                       env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    if p.returncode:
        raise RuntimeError(f"ds_to_universal failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")


def cache_key() -> str:
    from importlib.metadata import version

    files = ("tiny_model.py", "train_ds.py", "to_universal.py", "fixtures.py")
    versions = f"{version('torch')} {version('deepspeed')}"
    return source_key([os.path.join(HERE, f) for f in files], versions)


def build(root: str) -> dict:
    """Train and save every case, then convert each with ds_to_universal."""
    os.makedirs(root, exist_ok=True)
    t0 = time.time()
    losses: dict = {}
    for nproc, jobs in ((2, DP2 + FROZEN + TIED), (3, DP3)):
        out = os.path.join(root, f"losses_dp{nproc}.json")
        torchrun(nproc, ["--root", root, "--steps", str(STEPS), "--result", out, *jobs], root)
        with open(out) as f:
            losses.update(json.load(f))
    to_universal(
        [(os.path.join(root, n, TAG), os.path.join(root, f"u_{n}", TAG))
         for n in [*CASES, *(j.split(":")[0] for j in FROZEN)]],
        root,
    )  # fmt: skip
    losses["_build_seconds"] = time.time() - t0
    return losses


def get(cache_dir: str) -> DSCheckpoints:
    """The cached checkpoints, built on first use (process-safe)."""
    return DSCheckpoints(*built_once(cache_dir, cache_key(), build))


@pytest.fixture(scope="session")
def ds_ckpts(request: pytest.FixtureRequest) -> DSCheckpoints:
    """Real DeepSpeed checkpoints (and their ds_to_universal folders), cached between runs."""
    pytest.importorskip("torch")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install deepspeed==0.19.8)")
    cache = str(request.config.cache.mkdir("ds_ckpts"))
    return get(cache)
