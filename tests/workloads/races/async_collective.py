"""A seeded race: an async all_reduce's tensor used before work.wait(). On a GPU the all-reduce
runs on NCCL's stream while the compute stream goes on, so writing its input (`write`) or
reading its output (`read`) before the wait races with it; `ordered` waits first (correct).
Rank 0 prints the result; every rank's is world * (world - 1) / 2 + 1 when nothing races."""

import os
import sys

import torch
import torch.distributed as dist

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
grads = torch.full((4096,), float(rank), device="cuda")
work = dist.all_reduce(grads, async_op=True)
if sys.argv[1] == "write":
    grads.add_(1)           # the bug: the collective may still be reading it
    work.wait()
elif sys.argv[1] == "read":
    scaled = grads * 2      # the bug: the collective may still be writing it
    work.wait()
    grads.add_(1)
else:
    work.wait()
    grads.add_(1)
expected = world * (world - 1) / 2 + 1
if rank == 0:
    print("result", grads[0].item(), "expected", expected)
dist.destroy_process_group()
