"""Running MaxText 0.2.5 itself (its own venv, Python 3.12) from this project's Python.

The MaxText venv is `$REF_DIR/mt-venv` (default `/tmp/ucp-referees`); `setup.sh` builds it.
Every run is the tiny Llama the referees use: synthetic data, float32 weights, CPU devices.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REF_DIR = Path(os.environ.get("REF_DIR", "/tmp/ucp-referees"))
VENV = REF_DIR / "mt-venv"
PY = VENV / "bin" / "python"

# the model of the referees' runs (shared/referees/maxtext.sh): 2 layers, d=128, 4 heads of 32
MODEL = {
    "base_emb_dim": 128, "base_num_query_heads": 4, "base_num_kv_heads": 4, "base_mlp_dim": 256,
    "base_num_decoder_layers": 2, "head_dim": 32, "vocab_size": 256, "max_target_length": 64,
}  # fmt: skip
# the committed fixtures' model (tests/data/maxtext): GQA (2 kv heads), smaller
TINY = {
    "base_emb_dim": 64, "base_num_query_heads": 4, "base_num_kv_heads": 2, "base_mlp_dim": 128,
    "base_num_decoder_layers": 2, "head_dim": 16, "vocab_size": 128, "max_target_length": 32,
}  # fmt: skip
COMMON = {
    "run_name": "x", "hardware": "cpu", "dataset_type": "synthetic", "per_device_batch_size": 1,
    "learning_rate": 1e-3, "attention": "dot_product", "skip_jax_distributed_system": True,
    "async_checkpointing": False,
}  # fmt: skip


def base_yml() -> str:
    site = VENV / "lib" / "python3.12" / "site-packages"
    return str(site / "maxtext" / "configs" / "base.yml")


def env(ndev: int) -> dict[str, str]:
    e = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu")
    e.pop("PYTHONPATH", None)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ndev}"
    return e


def args_of(cfg: dict) -> list[str]:
    return [f"{k}={v}" for k, v in cfg.items()]


def require_venv() -> None:
    if not PY.exists():
        sys.exit(f"no MaxText venv at {VENV}: run referees/maxtext/setup.sh (REF_DIR={REF_DIR})")


def train(
    out: Path,
    model: dict,
    *,
    steps: int,
    ndev: int = 1,
    period: int = 2,
    log: Path | None = None,
    **over: object,
) -> list[float]:
    """MaxText's trainer into `out/x/checkpoints`; returns the loss of every step it ran."""
    require_venv()
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cfg = {**COMMON, **model, "steps": steps, "enable_checkpointing": True,
           "checkpoint_period": period, "base_output_directory": str(out),
           "metrics_file": str(metrics), **over}  # fmt: skip
    cmd = [str(PY), "-m", "maxtext.trainers.pre_train.train", base_yml(), *args_of(cfg)]
    log = log or out / "train.log"
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(["nice", *cmd], stdout=f, stderr=subprocess.STDOUT, env=env(ndev))
    if r.returncode:
        sys.exit(f"MaxText training failed ({r.returncode}); see {log}")
    return losses(metrics)


def losses(metrics: Path) -> list[float]:
    """{step: loss} of a MaxText metrics file, as a list in step order."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["learning/loss"] for r in sorted(rows, key=lambda r: r["step"])]


def steps_of(metrics: Path) -> list[int]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return sorted(int(r["step"]) for r in rows)


def resume(
    run: Path,
    ckpt_dir: Path,
    step_dir: int,
    model: dict,
    *,
    steps: int,
    ndev: int = 1,
    **over: object,
) -> tuple[list[int], list[float]]:
    """MaxText resumes from `ckpt_dir` (a `<step>/` folder) copied as `run/x/checkpoints/<step>`."""
    shutil.rmtree(run, ignore_errors=True)
    dst = run / "x" / "checkpoints" / str(step_dir)
    dst.parent.mkdir(parents=True)
    shutil.copytree(ckpt_dir, dst)
    out = train(run, model, steps=steps, ndev=ndev, **over)
    return steps_of(run / "metrics.jsonl"), out


def forward(items: Path, tokens: Path, out: Path, model: dict, **over: object) -> None:
    """MaxText's float32 logits of `tokens` with the parameters of `items` (mt_forward.py)."""
    require_venv()
    cfg = {"run_name": "fwd", "hardware": "cpu", "skip_jax_distributed_system": True,
           "attention": "dot_product", "dtype": "float32", "matmul_precision": "highest",
           "enable_checkpointing": False, "base_output_directory": str(out.parent / "fwd-out"),
           "load_parameters_path": str(items), **model, **over}  # fmt: skip
    import numpy as np

    cfg["per_device_batch_size"] = int(np.load(tokens).shape[0])
    cmd = [str(PY), str(HERE / "mt_forward.py"), str(out), str(tokens), *args_of(cfg)]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        r = subprocess.run(["nice", *cmd], stdout=f, stderr=subprocess.STDOUT, env=env(1))
    if r.returncode:
        sys.exit(f"MaxText forward failed ({r.returncode}); see {log}")
