"""Workloads for tests/test_faults.py, run under `mirage run --fault ...`. MODE selects one.

    oom        allocates device tensors until the injected OOM; prints what torch raised
    collect    N all_reduces over NCCL under torchrun, each rank printing its restart count
    stall      2 ranks with a 3 s NCCL timeout; rank 1 is stalled by the fault, rank 0 prints
               the error its collective ended with
"""

import datetime
import json
import os
import sys

import torch

MODE = sys.argv[1]


def oom() -> None:
    kept = []
    try:
        for i in range(100):
            kept.append(torch.empty(2**20, device="cuda"))
    except torch.cuda.OutOfMemoryError as err:
        print(json.dumps({"allocated": len(kept), "error": str(err).splitlines()[0]}))


def collect() -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    t = torch.ones(4, device="cuda")
    for _ in range(10):
        dist.all_reduce(t)
    print(json.dumps({"rank": dist.get_rank(), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                      "sum": t[0].item()}), flush=True)
    dist.destroy_process_group()


def stall() -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    try:
        dist.all_reduce(t)  # rank 1's second collective is held by the fault
        torch.cuda.synchronize()
        print(json.dumps({"rank": rank, "error": None}), flush=True)
    except Exception as err:  # what a peer of a stuck rank sees
        print(json.dumps({"rank": rank, "error": type(err).__name__, "message": str(err)[:300]}), flush=True)
    os._exit(0)


{"oom": oom, "collect": collect, "stall": stall}[MODE]()
