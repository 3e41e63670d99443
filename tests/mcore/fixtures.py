"""Session fixture: real Megatron-Core torch_dist checkpoints of a tiny Llama-like GPT, built once
with `torchrun` (gloo, CPU) and cached under .pytest_cache, with torch's own `dcp_to_torch_save`
of each (the referee of the import).

Cases (name: TP, PP, dtype, optimizer layout), all SwiGLU + GQA + RMSNorm + RoPE, no biases:
  tp2 (2, 1, fp32, plain), tp2pp2_bf16 (2, 2, bf16, plain), tp2dp2_full (2, 1 x DP2, fp32,
  distributed fully_reshardable), tp2dp2_bf16_dp (2, 1 x DP2, bf16, distributed dp_reshardable;
  the same state also saved fully_reshardable as tp2dp2_bf16_dp_asfull), pp2dp2_dp (1, 2 x DP2,
  fp32, dp_reshardable, and pp2dp2_dp_asfull).
Each trains 2 steps, saves, records reference logits (PP=1) and trains 2 more steps (the losses a
resumed job must reproduce).

Export: tp2 and tp2pp2_bf16 are imported (padding rows kept) and written back by export_megatron
(x_tp2, x_tp2pp2_bf16); Megatron then resumes 2 steps from each export and from its own checkpoint
at other layouts (RESUMES: name -> (tp, pp, dtype, checkpoint)). The cache key hashes these
scripts, the importer / exporter modules and the versions.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import time

import pytest
from fixture_cache import built_once, source_key
from fixture_cache import torchrun as run_script

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS2 = ["tp2:2:1:fp32:plain"]
JOBS4 = ["tp2pp2_bf16:2:2:bf16:plain", "tp2dp2_full:2:1:fp32:full", "tp2dp2_bf16_dp:2:1:bf16:dp",
         "pp2dp2_dp:1:2:fp32:dp"]  # fmt: skip
CASES = [j.split(":")[0] for j in JOBS2 + JOBS4]
HEADS, VOCAB = 4, 60  # the script's HEADS and TRUE_VOCAB
EXPORTS = {"x_tp2": ("tp2", "fp32"), "x_tp2pp2_bf16": ("tp2pp2_bf16", "bf16")}
RESUMES = {  # name: (tp, pp, dtype, checkpoint folder); own_* load Megatron's own checkpoint
    "own_tp2_at_tp1": (1, 1, "fp32", "tp2"), "ours_tp2_at_tp1": (1, 1, "fp32", "x_tp2"),
    "own_bf16_at_tp1": (1, 1, "bf16", "tp2pp2_bf16"),
    "ours_bf16_at_tp1": (1, 1, "bf16", "x_tp2pp2_bf16"),
    "own_tp2_at_tp2pp2": (2, 2, "fp32", "tp2"), "ours_tp2_at_tp2pp2": (2, 2, "fp32", "x_tp2"),
    "ours_nosrc_at_tp1": (1, 1, "fp32", "x_nosrc"),
}  # fmt: skip
# x_tp2's imported state as a JAX trainer saves it (restored onto ucp_jax.models.llama, saved by ucp.save:
# no Megatron provenance, no parameter groups), exported with the loading job's hyperparameters
JAX_EXPORTS = {"x_nosrc": ("x_tp2", {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)})}
# megatron-core 0.16.1 (the Makefile installs it beside the venv's packages) writes the legacy
# layout: common.pt and two files per rank; the case v016_tp2 is built with it.
LEGACY = os.path.join(sys.prefix, "mcore-0.16.1")
LEGACY_CASE = "v016_tp2"
_SOURCES = ("common.py", "config.py", "read.py", "buckets.py", "export.py")


@dataclasses.dataclass
class MegatronCheckpoints:
    root: str
    results: dict

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def torch_save(self, name: str) -> str:
        """torch's dcp_to_torch_save of the checkpoint (one .pt of global tensors)."""
        return os.path.join(self.root, name + ".pt")


def torchrun(
    nproc: int, args: list[str], cwd: str, timeout: int = 600, path: str | None = None
) -> None:
    """Run train_mcore.py under torchrun; `path`: another megatron-core, ahead of the venv's."""
    script = os.path.join(HERE, "train_mcore.py")
    run_script(script, nproc, args, cwd, timeout=timeout, pythonpath=path)


def cache_key(extra: tuple[str, ...] = ()) -> str:
    from importlib.metadata import version

    lib = os.path.join(HERE, "..", "..", "ucp_jax", "_src", "frameworks", "megatron")
    paths = [os.path.join(HERE, f) for f in ("train_mcore.py", "fixtures.py", *extra)]
    versions = f"{version('torch')} {version('megatron-core')} {os.path.isdir(LEGACY)}"
    return source_key(paths + [os.path.join(lib, f) for f in _SOURCES], versions)


def build(root: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    os.makedirs(root, exist_ok=True)
    t0 = time.time()
    torchrun(2, ["--root", root, *JOBS2], root)
    torchrun(4, ["--root", root, *JOBS4], root)
    legacy = os.path.isdir(os.path.join(LEGACY, "megatron"))
    if legacy:
        torchrun(2, ["--root", root, f"{LEGACY_CASE}:2:1:fp32:plain"], root, path=LEGACY)
    asfull = [c + "_asfull" for c in CASES if c.endswith("_dp")]
    for name in [*CASES, *asfull, *([LEGACY_CASE] if legacy else [])]:
        dcp_to_torch_save(os.path.join(root, name), os.path.join(root, name + ".pt"))
    from ucp_jax._src.frameworks.megatron.export import export_megatron
    from ucp_jax._src.frameworks.megatron.read import import_megatron

    for x, (src, dtype) in EXPORTS.items():
        u = import_megatron(os.path.join(root, src), os.path.join(root, "u_" + x), heads=HEADS)
        export_megatron(u, os.path.join(root, x), dtype=dtype)
    for x, (src, hyper) in JAX_EXPORTS.items():
        u = saved_by_jax(os.path.join(root, "u_" + src), os.path.join(root, "u_" + x))
        export_megatron(u, os.path.join(root, x), **hyper)
    for nproc in (1, 4):
        jobs = [f"{n}:{tp}:{pp}:{dt}:plain:load={os.path.join(root, c)}"
                for n, (tp, pp, dt, c) in RESUMES.items() if tp * pp == nproc]  # fmt: skip
        torchrun(nproc, ["--root", root, *jobs], root)
    results = {}
    for name in [*CASES, *RESUMES, *([LEGACY_CASE] if legacy else [])]:
        with open(os.path.join(root, name + ".json")) as f:
            results[name] = json.load(f)
    results["_build_seconds"] = time.time() - t0
    return results


def saved_by_jax(src: str, dst: str) -> str:
    """`src` restored onto the JAX model (weights and Adam moments) and saved by `ucp.save`."""
    import ucp_jax as ucp
    from ucp_jax.demo import Layout
    from ucp_jax.models import llama as L

    cfg = L.config_from_checkpoint(src)
    layout = Layout(tensor=2)
    rules = L.ucp_rules(cfg, layout)
    target = L.abstract_params(cfg, layout, L.make_mesh(layout))
    params, moments = ucp.restore(src, target, {"mu": target, "nu": target}, rules=rules)
    ucp.save(dst, params, moments, step=ucp.open(src).step, extra=L.ucp_extra(cfg), rules=rules)
    return dst


def get(cache_dir: str) -> MegatronCheckpoints:
    """The cached checkpoints, built on first use (process-safe)."""
    return MegatronCheckpoints(*built_once(cache_dir, cache_key(), build))


def megatron_available() -> bool:
    try:  # find_spec of a submodule raises where the parent package is missing
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="session")
def mcore_ckpts(request: pytest.FixtureRequest) -> MegatronCheckpoints:
    """Real Megatron-Core checkpoints (and torch's dcp_to_torch_save of each), cached."""
    pytest.importorskip("torch")
    if not megatron_available():
        if os.environ.get("CI"):  # CI installs it (Makefile): a skip there would pass wrongly
            raise RuntimeError("CI needs megatron-core 0.19.2 installed (make test does it)")
        pytest.skip("megatron-core is not installed (see the Makefile's install step)")
    return get(str(request.config.cache.mkdir("mcore_ckpts")))
