"""A training loop that checkpoints and resumes, as a job under torchrun --max-restarts does.

2+ ranks of DDP (a small MLP, AdamW), STEPS steps; every CHECKPOINT_EVERY steps the model and the
optimizer are saved with torch.distributed.checkpoint into DIR. A (re)started worker loads the
newest checkpoint and continues from the step after it. The batch of each step comes from a
generator seeded by the step, so an attempt that resumes sees what an unfaulted run saw. Rank 0
prints one JSON line per step: {"step", "loss", "restart"}.

    python resume.py DIR [STEPS] [CHECKPOINT_EVERY]
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

folder = Path(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 12
every = int(sys.argv[3]) if len(sys.argv) > 3 else 3

dist.init_process_group("nccl")
rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).cuda())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

done = sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*") if (p / ".metadata").exists())
start = 0
if done:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder / f"step-{done[-1]}")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    start = done[-1] + 1

for step in range(start, steps):
    batch = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=batch).cuda()
    y = x.sum(dim=1, keepdim=True).sin()
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    reduced = loss.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
    if rank == 0:
        print(json.dumps({"step": step, "loss": reduced.item(),
                          "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}), flush=True)
    if step % every == every - 1:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / f"step-{step}")
dist.destroy_process_group()
