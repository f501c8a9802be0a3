"""Hangs on purpose inside DDP: rank 1 stalls before its fourth backward, so rank 0 waits in an
all-reduce that DDP's reducer issues from C++ (no Python-level collective is in progress)."""
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
model = DistributedDataParallel(torch.nn.Linear(8, 8).cuda())
for step in range(5):
    if rank == 1 and step == 3:
        time.sleep(600)  # as if stuck loading data
    model(torch.randn(4, 8, device="cuda")).sum().backward()
