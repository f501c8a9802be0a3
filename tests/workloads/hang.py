"""Hangs on purpose: rank 1 never joins the second all_reduce."""
import os
import time

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
dist.all_reduce(torch.ones(4, device="cuda"))
if rank == 0:
    dist.all_reduce(torch.ones(4, device="cuda"))
else:
    time.sleep(600)
