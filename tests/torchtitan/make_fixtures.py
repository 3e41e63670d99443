"""Write tests/data/torchtitan: checkpoints torchtitan 0.3.0 itself wrote, and what it computed.

    python tests/torchtitan/make_fixtures.py   # ~3 minutes on 2 cores; makes torchtitan's venv

- np1/step-2: 1 process, the full training state after step 2 (model, AdamW state keyed by the
  fused wqkv, lr scheduler, data loader bytes, train state); np1/step-4: the model alone
  (`--checkpoint.last-save-model-only`, torchtitan's default for a last save).
- np2/step-2: 2-rank FSDP (dp_shard=2), the full state after step 2 (two `.distcp` files).
- fixed/: torchtitan resumed from np1/step-2 on fixed batches (positions 0..s-1, causal), float32:
  `logits.npy` of its forward on step 3's batch (the step-2 state), the tokens of steps 3 and 4.
- records.json: every run's per-step loss, grad norm and lr, exact (the resume tests compare
  against `np1` / `np2`; the JAX training test against `fixed`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runner import DATA, resume, train, workdir

# the fixed-batch run computes in float32 (FSDP's default mixed precision is bfloat16), so its
# logits and losses are the float32 model's, as the JAX model computes them
FP32 = ["--training.mixed-precision-param", "float32"]


def main() -> None:
    root = workdir(tempfile.mkdtemp(prefix="ucp-tt-fixtures-"))
    records = {
        "np1": train(root, "np1", 1, ["--checkpoint.last-save-model-only"]),
        "np2": train(root, "np2", 2),
    }
    fixed = os.path.join(root, "fixed")
    records["fixed"] = resume(root, "fixed_run", os.path.join(root, "np1", "checkpoint", "step-2"),
                              1, FP32, env={"UCP_TT_FIXED": fixed})  # fmt: skip
    for name in ("np1", "np2", "fixed"):
        shutil.rmtree(os.path.join(DATA, name), ignore_errors=True)
    for name, steps in (("np1", (2, 4)), ("np2", (2,))):
        for s in steps:
            src = os.path.join(root, name, "checkpoint", f"step-{s}")
            shutil.copytree(src, os.path.join(DATA, name, f"step-{s}"))
    os.makedirs(os.path.join(DATA, "fixed"))
    for f in ("logits.npy", "tokens_step3.npy", "tokens_step4.npy"):
        shutil.copy(os.path.join(fixed, f), os.path.join(DATA, "fixed", f))
    with open(os.path.join(DATA, "records.json"), "w") as f:
        json.dump(records, f, indent=1)
    shutil.rmtree(root)
    print(json.dumps({k: [r["loss"] for r in v] for k, v in records.items()}))


if __name__ == "__main__":
    main()
