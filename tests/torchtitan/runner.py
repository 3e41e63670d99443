"""Running torchtitan 0.3.0 (in its own virtualenv) on the tiny Llama 3 of `tt_train.py`.

The virtualenv is `$UCP_TT_VENV`, else `$REF_DIR/tt-venv` (default `/tmp/ucp-referees/tt-venv`,
where `shared/referees/torchtitan.sh` puts it); `ensure_venv` makes it with pip when it is missing
(torchtitan, torch 2.13 CPU and triton, which torchtitan imports: ~2.5 GB, a few minutes). A work
folder holds what torchtitan reads relative to its working directory: the test tokenizer (from
torchtitan's repository, committed in tests/data/torchtitan/assets) and synthetic c4_test text.

Used by `make_fixtures.py` (which writes tests/data/torchtitan) and the referee tests
(`make referees`), never by `make test`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data", "torchtitan")
SCRIPT = os.path.join(HERE, "tt_train.py")
sys.path.insert(0, os.path.join(HERE, ".."))
from mp.runner import free_port  # noqa: E402

# torchtitan's llama3_debugmodel recipe at 4 steps, a checkpoint every 2 (the referee's flags)
ARGS = ["--module", "llama3", "--config", "llama3_ucp_tiny", "--training.steps", "4",
        "--training.local-batch-size", "2", "--training.seq-len", "128", "--checkpoint.enable",
        "--checkpoint.interval", "2", "--validator.no-enable", "--metrics.no-enable-tensorboard",
        "--debug.seed", "0"]  # fmt: skip
FSDP = ["--parallelism.spmd-backend", "partial_dtensor"]  # 2 ranks: FSDP (dp_shard=2) on gloo
LAST = ["activation-checkpoint:none"]  # a tyro subcommand: must come last


def venv() -> str:
    if os.environ.get("UCP_TT_VENV"):
        return os.environ["UCP_TT_VENV"]
    return os.path.join(os.environ.get("REF_DIR", "/tmp/ucp-referees"), "tt-venv")


def ensure_venv() -> str:
    """torchtitan's virtualenv, made with pip if it is missing; returns its folder."""
    v = venv()
    if not os.path.exists(os.path.join(v, "bin", "torchrun")):
        subprocess.run(["python3", "-m", "venv", v], check=True)
        pip = [os.path.join(v, "bin", "pip"), "install", "-q"]
        subprocess.run([*pip, "torchtitan==0.3.0", "torch==2.13.0"], check=True)
        subprocess.run([*pip, "triton"], check=True)  # imported by torchtitan, never run on CPU
    return v


def workdir(root: str) -> str:
    """A folder torchtitan runs in: tests/assets/{tokenizer, c4_test} as it expects them."""
    os.makedirs(root, exist_ok=True)
    tok = os.path.join(root, "tests", "assets", "tokenizer")
    if not os.path.isdir(tok):
        shutil.copytree(os.path.join(DATA, "assets", "tokenizer"), tok)
    c4 = os.path.join(root, "tests", "assets", "c4_test")
    if not os.path.isfile(os.path.join(c4, "data.json")):
        os.makedirs(c4, exist_ok=True)
        r = random.Random(0)
        w = [
            "the",
            "of",
            "and",
            "to",
            "in",
            "is",
            "was",
            "for",
            "on",
            "that",
            "with",
            "as",
            "by",
            "at",
            "from",
            "his",
            "her",
            "an",
            "which",
        ]
        with open(os.path.join(c4, "data.json"), "w") as f:
            for _ in range(2000):
                f.write(json.dumps({"text": " ".join(r.choice(w) for _ in range(300))}) + "\n")
    return root


def train(
    root: str, dump: str, nproc: int, extra: list[str] = (), env: dict[str, str] | None = None,
    timeout: int = 900,
) -> list[dict]:  # fmt: skip
    """Run torchtitan in `root` with dump folder `dump` (relative to root); the per-step records
    (loss, grad norm, lr) it wrote. Resumes from `dump`/checkpoint/step-N if there is one."""
    v = ensure_venv()
    record = os.path.join(root, dump + ".steps.jsonl")
    if os.path.exists(record):
        os.remove(record)
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", UCP_TT_RECORD=record,
             **(env or {}))  # fmt: skip
    for k in ("XLA_FLAGS", "PYTHONPATH", "VIRTUAL_ENV"):
        e.pop(k, None)
    cmd = [os.path.join(v, "bin", "torchrun"), "--nproc_per_node", str(nproc), "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"localhost:{free_port()}", SCRIPT, "--dump-folder",
           dump, *ARGS, *(FSDP if nproc > 1 else []), *extra, *LAST]  # fmt: skip
    p = subprocess.run(cmd, cwd=root, env=e, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                           f"{p.stderr[-6000:]}")  # fmt: skip
    with open(record) as f:
        return [json.loads(line) for line in f]


def resume(
    root: str, dump: str, ckpt: str, nproc: int, extra: list[str] = (),
    env: dict[str, str] | None = None,
) -> list[dict]:  # fmt: skip
    """torchtitan resumed from the step-2 folder `ckpt` (copied in as `dump`/checkpoint/step-2)."""
    d = os.path.join(root, dump)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "checkpoint"))
    shutil.copytree(ckpt, os.path.join(d, "checkpoint", "step-2"))
    return train(root, dump, nproc, extra, env)
