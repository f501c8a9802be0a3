"""Workloads for tests/test_faults.py, run under `mirage run --fault ...`. MODE selects one.

    oom        allocates device tensors until the injected OOM; prints what torch raised
    collect    N all_reduces over NCCL under torchrun, each rank printing its restart count and
               when (time.time()) its work began
    stall      2 ranks with a 3 s NCCL timeout; rank 1 is stalled by the fault, rank 0 prints
               the error its collective ended with
    train      2 ranks of a DDP step loop; each rank prints what its steps raised (a lost GPU's
               rank: torch.AcceleratorError) and exits 1 on an error, as a training script does
    survive    the same, but a rank that saw an error exits 0, so the launcher leaves its peer
               running and the peer's own fate (NCCL's error, its watchdog) shows
"""

import datetime
import json
import os
import sys
import time

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

    began = time.time()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    t = torch.ones(4, device="cuda")
    for _ in range(10):
        dist.all_reduce(t)
    print(json.dumps({"rank": dist.get_rank(), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                      "sum": t[0].item(), "began": began}), flush=True)
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


def train() -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16).cuda())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(20):
            model(torch.randn(8, 16, device="cuda")).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
    except Exception as err:
        print(json.dumps({"rank": rank, "step": step, "error": type(err).__name__, "message": str(err)[:300]}),
              flush=True)
        sys.exit(0 if MODE == "survive" else 1)
    print(json.dumps({"rank": rank, "error": None}), flush=True)
    dist.destroy_process_group()


{"oom": oom, "collect": collect, "stall": stall, "train": train, "survive": train}[MODE]()
