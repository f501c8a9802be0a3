"""A test suite's pattern in one session: ten "tests" in a row, each spawning fresh ranks that
create the default group (named '0' every time), run collectives of shapes of their own, and
destroy it. DESYNC_IN=k makes rank 1 of test k all-reduce a tensor of another size.
Prints `test k ok` per test and `sequential_ok` at the end."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
DESYNC_IN = int(os.environ.get("DESYNC_IN", "-1"))


def one_test(rank: int, test: int, store_path: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    numel = 10 + test  # every test its own shapes
    if test == DESYNC_IN and rank == 1:
        numel += 1
    t = torch.full((numel,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((numel,), 3.0, device="cuda")), t
    out = torch.empty(WORLD * (test + 1), device="cuda")
    dist.all_gather_into_tensor(out, torch.full((test + 1,), float(rank), device="cuda"))
    dist.broadcast(t, src=test % WORLD)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    for test in range(10):
        with tempfile.TemporaryDirectory() as scratch:
            mp.spawn(one_test, args=(test, os.path.join(scratch, "store")), nprocs=WORLD)
        print(f"test {test} ok", flush=True)
    print("sequential_ok")
    sys.exit(0)
