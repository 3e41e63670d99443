"""Megatron-LM itself (its training package, not megatron-core alone), for two referees:

    python megatron_lm.py args SRC.pt DST [megatron-lm flags...]
    python megatron_lm.py lookup DIR

`args`: SRC.pt is torch's `dcp_to_torch_save` of a checkpoint (every tensor and the common
state); DST becomes a torch_dist folder of the same tensors whose `args` are what
`megatron.training.arguments.parse_args()` gives for the model's shape and the flags, as
Megatron-LM's `pretrain_gpt.py` saves them (an argparse.Namespace holding enums:
`attention_backend`, `exit_signal`).
`lookup`: Megatron-LM's own checkpoint lookup on a save folder (what `--load DIR` does first);
prints one JSON line: the folder `checkpointing._load_base_checkpoint` found (null: none, so
Megatron-LM would start from random weights), whether its state dict loaded, and the content
metadata Megatron-LM builds the optimizer's layout from (`dist_checkpointing.load_content_metadata`).
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


def lookup(load: str) -> None:
    sys.argv = ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "32",
                "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings",
                "16", "--micro-batch-size", "2", "--ckpt-format", "torch_dist", "--load", load]  # fmt: skip
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args

    args = parse_args()
    state, name, _release, _kind = checkpointing._load_base_checkpoint(load, args, rank0=True)
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_content_metadata(preloaded_state_dict=state) if state else None
    print(json.dumps({"found": name, "loaded": state is not None, "content_metadata": meta}))


def with_args(src: str, dst: str, *flags: str) -> None:
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
    if sys.argv[1] == "lookup":
        lookup(sys.argv[2])
    else:
        with_args(*sys.argv[2:])
