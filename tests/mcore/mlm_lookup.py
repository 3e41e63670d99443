"""Megatron-LM's own checkpoint lookup on a save folder (what `--load DIR` does first).

    python mlm_lookup.py DIR

Prints one JSON line: the folder `megatron.training.checkpointing._load_base_checkpoint` found
(null: none, Megatron-LM would start from random weights) and whether its state dict loaded.
Runs in its own process: Megatron-LM's training package is imported here, never by the tests.
"""

from __future__ import annotations

import json
import sys
import types
import typing

# the CPU shims of train_mcore.py (see real_args.py)
_ps = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
_ps.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
_ps.paged_stash_copy_kernel = _ps.paged_stash_pop_kernel = None  # type: ignore[attr-defined]
sys.modules[_ps.__name__] = _ps
typing.override = getattr(typing, "override", lambda f: f)  # type: ignore[attr-defined]


def main() -> None:
    load = sys.argv[1]
    sys.argv = ["pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "32",
                "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings",
                "16", "--micro-batch-size", "2", "--ckpt-format", "torch_dist", "--load", load]  # fmt: skip
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args

    args = parse_args()
    state, name, _release, _kind = checkpointing._load_base_checkpoint(load, args, rank0=True)
    print(json.dumps({"found": name, "loaded": state is not None}))


if __name__ == "__main__":
    main()
