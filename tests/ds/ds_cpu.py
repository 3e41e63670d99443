"""DeepSpeed's training scripts on the suite's CPUs: one shim, applied before init_distributed.

DeepSpeed's torch backend JIT-compiles its shared-memory all-reduce op (`deepspeed_shm_comm`,
C++ through ninja) when it starts on a CPU: about 100 s of CPU on a clean 2-core machine (CI),
for an op used only by `inference_all_reduce`, never in training (ZeRO's collectives go through
torch.distributed, gloo here). Training is unchanged without it.
"""

from __future__ import annotations


def skip_the_inference_shm_op() -> None:
    """Start DeepSpeed's torch backend without building `deepspeed_shm_comm`."""
    import importlib

    # by module name: the attribute `deepspeed.comm.torch` is torch itself (comm imports torch)
    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None
