"""Desynchronised on purpose: rank 1 all-reduces a tensor of another size at the same step."""
import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
dist.all_reduce(torch.ones(4, device="cuda"))
dist.all_reduce(torch.ones(4 if rank == 0 else 8, device="cuda"))
