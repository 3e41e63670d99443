"""Train the tiny GPT with FSDP2 (fully_shard, CPU, gloo) and save a torch.distributed.checkpoint.

    torchrun --nproc_per_node 2 tests/ds/fsdp_dcp.py OUT

writes OUT/dcp (sharded DCP: {"model": ..., "optim": ..., "step": N}) and OUT/full.pt (rank 0:
the full, unsharded model and optimizer state, the reference for the import).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_model import BATCH, batch, init_model

STEPS = 2


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    model = init_model(0)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    per = BATCH // world
    for step in range(STEPS):
        loss = model(batch(step)[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": STEPS}, checkpoint_id=os.path.join(out, "dcp"))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    fm, fo = get_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": fm, "optim": fo}, os.path.join(out, "full.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
