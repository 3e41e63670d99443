"""Session fixture: real Megatron-Core checkpoints of GPT-style and mixture-of-experts models, built
once with `torchrun` (gloo, CPU) by tests/mcore/train_mcore.py and cached under .pytest_cache
apart from the Llama-like ones (fixtures.py), with torch's own `dcp_to_torch_save` of each.

Cases (name: TP, PP, DP, EP, dtype, optimizer layout, model):
  g_tp2        (2, 1, 1, -, fp32, plain, gpt: LayerNorm, GELU, biases, tied, learned positions;
                Megatron-LM's `args` in the common state)
  g_tp2pp2     (2, 2, 1, -, bf16, distributed fully_reshardable, gpt; args)
  g_tp2dp2_dp  (2, 1, 2, -, fp32, distributed dp_reshardable (+ _asfull), gpt_rope: RoPE, untied)
  m_ep2        (1, 1, 2, 2, fp32, plain: a ChainedOptimizer, moe: 4 SequentialMLP SwiGLU experts)
  m_etp2       (1, 1, 2, 1 with expert_tensor_parallel_size 2, fp32, plain, moe)
  m_ep2pp2     (1, 2, 2, 2, fp32, distributed fully_reshardable, moe)
Each trains 2 steps, saves, records the loss of a fixed batch (`eval`), reference logits (PP=1)
and trains 2 more steps.

Exports (EXPORTS: name -> (source, dtype, optimizer layout, expert_parallel)) are imported with
their padding rows and written back by export_megatron; Megatron then loads each at another
layout (RESUMES: name -> (tp, pp, ep, dtype, optimizer, model, checkpoint); own_* load Megatron's
own checkpoint), records `eval` and trains 2 steps. Megatron cannot load its own EP=2
checkpoints' optimizer at EP=1 (one optimizer there, a ChainedOptimizer at EP>1): only ours run
there. The cache key hashes the scripts, the Megatron framework modules and the versions.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from fixture_cache import built_once

from .fixtures import MegatronCheckpoints, cache_key, megatron_available, torchrun

JOBS2 = ["g_tp2:2:1:fp32:plain:model=gpt:args=1", "m_ep2:1:1:fp32:plain:model=moe:ep=2",
         "m_etp2:1:1:fp32:plain:model=moe:etp=2"]  # fmt: skip
JOBS4 = ["g_tp2pp2:2:2:bf16:full:model=gpt:args=1",
         "g_tp2dp2_dp:2:1:fp32:dp:model=gpt_rope:args=1",
         "m_ep2pp2:1:2:fp32:full:model=moe:ep=2"]  # fmt: skip
CASES = [j.split(":")[0] for j in JOBS2 + JOBS4]
MODELS = {j.split(":")[0]: j.split("model=")[1].split(":")[0] for j in JOBS2 + JOBS4}
HEADS, VOCAB, TOP_K = 4, 60, 2
EXPORTS = {  # name: (source, dtype, optimizer layout, expert_parallel of the loading job)
    "x_g_tp2": ("g_tp2", "fp32", "plain", None),
    "x_g_tp2pp2": ("g_tp2pp2", "bf16", "distributed", None),
    "x_g_dp": ("g_tp2dp2_dp", "fp32", "distributed", None),
    "x_m_ep2_ep1": ("m_ep2", "fp32", "plain", 1),
    "x_m_ep2": ("m_ep2", "fp32", "plain", 4),
    "x_m_ep2pp2_ep1": ("m_ep2pp2", "fp32", "distributed", 1),
    "x_m_ep2pp2": ("m_ep2pp2", "fp32", "distributed", 4),
}
RESUMES = {  # name: (tp, pp, ep, dtype, optimizer, checkpoint); world = tp * pp * dp
    "ours_g_tp2_at_tp1": (1, 1, 1, "fp32", "plain", "x_g_tp2"),
    "ours_g_tp2pp2_at_tp1": (1, 1, 1, "bf16", "full", "x_g_tp2pp2"),
    "own_g_tp2pp2_at_tp1": (1, 1, 1, "bf16", "full", "g_tp2pp2"),
    "ours_m_ep2_at_ep1": (1, 1, 1, "fp32", "plain", "x_m_ep2_ep1"),  # DP 2
    "ours_m_ep2pp2_at_ep1": (1, 1, 1, "fp32", "full", "x_m_ep2pp2_ep1"),  # DP 2
    "ours_g_tp2_at_tp2pp2": (2, 2, 1, "fp32", "plain", "x_g_tp2"),
    "own_g_tp2_at_tp2pp2": (2, 2, 1, "fp32", "plain", "g_tp2"),
    "ours_g_dp_at_pp2": (1, 2, 1, "fp32", "full", "x_g_dp"),  # DP 2
    "own_g_dp_at_pp2": (1, 2, 1, "fp32", "full", "g_tp2dp2_dp_asfull"),
    "ours_m_ep2_at_ep4": (1, 1, 4, "fp32", "plain", "x_m_ep2"),  # DP 4
    "own_m_ep2_at_ep4": (1, 1, 4, "fp32", "plain", "m_ep2"),
    "ours_m_ep2pp2_at_ep4": (1, 1, 4, "fp32", "full", "x_m_ep2pp2"),  # DP 4
    "own_m_ep2pp2_at_ep4": (1, 1, 4, "fp32", "full", "m_ep2pp2"),
}
WORLD = {"ours_m_ep2_at_ep1": 2, "ours_m_ep2pp2_at_ep1": 2, "ours_g_dp_at_pp2": 4,
         "own_g_dp_at_pp2": 4}  # fmt: skip


def _model(checkpoint: str) -> str:
    name = EXPORTS[checkpoint][0] if checkpoint in EXPORTS else checkpoint
    return MODELS[name.removesuffix("_asfull")]


def _world(name: str) -> int:
    tp, pp, ep, *_ = RESUMES[name]
    return WORLD.get(name, max(tp * pp, ep))


def build(root: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ucp_jax._src.frameworks.megatron.export import export_megatron
    from ucp_jax._src.frameworks.megatron.read import import_megatron

    os.makedirs(root, exist_ok=True)
    t0 = time.time()
    torchrun(2, ["--root", root, *JOBS2], root)
    torchrun(4, ["--root", root, *JOBS4], root)
    asfull = [c + "_asfull" for c in CASES if c.endswith("_dp")]
    for name in [*CASES, *asfull]:
        dcp_to_torch_save(os.path.join(root, name), os.path.join(root, name + ".pt"))
    for x, (src, dtype, optimizer, ep) in EXPORTS.items():
        u = import_megatron(os.path.join(root, src), os.path.join(root, "u_" + x), heads=HEADS,
                            top_k=TOP_K)  # fmt: skip
        export_megatron(u, os.path.join(root, x), dtype=dtype, optimizer=optimizer,
                        expert_parallel=ep)  # fmt: skip
    for nproc in (1, 2, 4):
        jobs = [f"{n}:{tp}:{pp}:{dt}:{opt}:model={_model(c)}:ep={ep}:load={os.path.join(root, c)}"
                for n, (tp, pp, ep, dt, opt, c) in RESUMES.items() if _world(n) == nproc]  # fmt: skip
        torchrun(nproc, ["--root", root, *jobs], root)
    results = {}
    for name in [*CASES, *RESUMES]:
        with open(os.path.join(root, name + ".json")) as f:
            results[name] = json.load(f)
    results["_build_seconds"] = time.time() - t0
    return results


def get(cache_dir: str) -> MegatronCheckpoints:
    """The cached checkpoints, built on first use (process-safe)."""
    return MegatronCheckpoints(*built_once(cache_dir, cache_key(("gpt_fixtures.py",)), build))


@pytest.fixture(scope="session")
def mcore_gpt_ckpts(request: pytest.FixtureRequest) -> MegatronCheckpoints:
    """Real Megatron-Core GPT and MoE checkpoints (and dcp_to_torch_save of each), cached."""
    pytest.importorskip("torch")
    if not megatron_available():
        if os.environ.get("CI"):  # CI installs it (Makefile): a skip there would pass wrongly
            raise RuntimeError("CI needs megatron-core 0.19.2 installed (make test does it)")
        pytest.skip("megatron-core is not installed (see the Makefile's install step)")
    return get(str(request.config.cache.mkdir("mcore_gpt_ckpts")))
