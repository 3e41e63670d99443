"""Replace the `args` of a Megatron checkpoint's common state with Megatron-LM's own.

    python real_args.py SRC.pt DST [megatron-lm flags...]

SRC.pt: torch's `dcp_to_torch_save` of a checkpoint (every tensor and the common state); DST: a
torch_dist folder of the same tensors whose `args` are what `megatron.training.arguments
.parse_args()` gives for the model's shape and the flags, as Megatron-LM's `pretrain_gpt.py`
saves them (an argparse.Namespace holding enums: `attention_backend`, `exit_signal`).
Runs in its own process: Megatron-LM's training package is imported here, never by the tests.
"""

from __future__ import annotations

import json
import sys
import types
import typing

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

# the CPU shims of train_mcore.py: the one module importing triton unconditionally, and
# `typing.override` (Python 3.12) that Megatron-LM's training package uses
_ps = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
_ps.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
_ps.paged_stash_copy_kernel = _ps.paged_stash_pop_kernel = None  # type: ignore[attr-defined]
sys.modules[_ps.__name__] = _ps
typing.override = getattr(typing, "override", lambda f: f)  # type: ignore[attr-defined]

HIDDEN, HEADS, GROUPS, FFN, LAYERS, SEQ, VOCAB = 32, 4, 2, 48, 4, 16, 64


def main() -> None:
    src, dst, *flags = sys.argv[1:]
    from megatron.training.arguments import parse_args

    argv = ["pretrain_gpt.py", "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
            "--num-attention-heads", str(HEADS), "--group-query-attention", "--num-query-groups",
            str(GROUPS), "--ffn-hidden-size", str(FFN), "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2",
            "--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist", *flags]  # fmt: skip
    sys.argv, old = argv, sys.argv
    try:
        args = parse_args()
    finally:
        sys.argv = old
    args.padded_vocab_size = VOCAB
    sd = {k: v for k, v in torch.load(src, weights_only=False).items() if "_extra_state" not in k}
    sd["common_state/shard_0_1"][0]["args"] = args
    dcp.save(sd, checkpoint_id=dst, no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))  # fmt: skip
    with open(f"{dst}/metadata.json", "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)


if __name__ == "__main__":
    main()
