"""Under torchrun, 2 gloo ranks: `dcp.load` a DCP folder into DTensors sharded on dim 0 (plain
tensors for scalars) and compare every tensor with torch's merge of it; rank r appends r to
dcp_load_2.ok in the working directory when all are equal.

    torchrun --nproc_per_node 2 dcp_load_2.py FOLDER MERGED.pt
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh


def main() -> None:
    folder, ref = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))

    def flat(d: dict, p: str = "") -> dict:
        r: dict = {}
        for k, v in d.items():
            r |= flat(v, f"{p}{k}.") if isinstance(v, dict) else {p + k: v}
        return r

    want = flat(torch.load(ref, weights_only=False))
    sd = {}
    for k, v in want.items():
        z = torch.zeros_like(v)
        sd[k] = distribute_tensor(z, mesh, [Shard(0)]) if v.ndim and v.shape[0] % 2 == 0 else z
    dcp.load(sd, checkpoint_id=folder)
    for k, v in want.items():
        got = sd[k].full_tensor() if hasattr(sd[k], "full_tensor") else sd[k]
        if not torch.equal(got, v):
            raise SystemExit(f"rank {rank}: {k} differs")
    dist.barrier()
    for r in range(2):  # rank 0 starts the file afresh: a retried run (fixture_cache.torchrun,
        if r == rank:  # after torch's own teardown abort) leaves only its own ranks there
            with open("dcp_load_2.ok", "w" if rank == 0 else "a") as f:
                f.write(f"{rank}\n")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
