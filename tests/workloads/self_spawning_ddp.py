"""A trainer that starts its own worker processes unless LOCAL_RANK is set (as a popular
trainer's DDP strategy does), then trains DDP on every GPU: the launcher must not be taken for
a worker, so a one-process job must not carry rank variables."""

import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn

if "LOCAL_RANK" not in os.environ:
    world = torch.cuda.device_count()
    workers = [subprocess.Popen([sys.executable, __file__],
                                env=dict(os.environ, LOCAL_RANK=str(r), RANK=str(r), WORLD_SIZE=str(world)))
               for r in range(world)]
    codes = [w.wait() for w in workers]
    print("launcher: workers exited with", codes, flush=True)
    sys.exit(max(codes))

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")  # env://: MASTER_ADDR / MASTER_PORT from mirage
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1).cuda(), device_ids=[rank])
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.randn(16, 8, device="cuda") + rank
    optimizer.zero_grad()
    model(x).pow(2).mean().backward()
    optimizer.step()
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.empty_like(weights) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, weights)
if rank == 0:
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    print(f"worker 0: {dist.get_world_size()} ranks trained, identical replicas: {same}", flush=True)
dist.destroy_process_group()
