"""A seeded race: an async all_reduce's tensor used before work.wait(). On a GPU the all-reduce
runs on NCCL's stream while the compute stream goes on, so writing its input (`write`) or
reading its output (`read`) before the wait races with it; `functional` reads a functional
collective's output before wait_tensor; `ddp-hook` is a DDP comm hook that scales the bucket
while its all-reduce runs; `ordered` waits first (correct). Rank 0 prints the result; every
rank's is world * (world - 1) / 2 + 1 when nothing races."""

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
elif sys.argv[1] == "functional":
    work.wait()
    summed = torch.ops._c10d_functional.all_reduce(grads, "sum", dist.group.WORLD.group_name)
    doubled = summed * 2    # the bug: the collective may still be writing it
    torch.ops._c10d_functional.wait_tensor(summed)
    grads.add_(1)
elif sys.argv[1] == "ddp-hook":
    work.wait()
    grads.add_(1)

    def scale_then_sum(state, bucket):
        future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        bucket.buffer().div_(world)  # the bug: the all-reduce may still be reading it
        return future.then(lambda done: done.value()[0])

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8).cuda())
    model.register_comm_hook(None, scale_then_sum)
    model(torch.ones(4, 8, device="cuda")).sum().backward()
else:
    work.wait()
    grads.add_(1)
expected = world * (world - 1) / 2 + 1
if rank == 0:
    print("result", grads[0].item(), "expected", expected)
dist.destroy_process_group()
