"""An elastic job's worker (torchrun --nnodes=MIN:MAX): steps of an all_reduce over however many
ranks the current rendezvous formed, resumed after each restart from the step count rank 0
keeps in FOLDER. Each rank prints one JSON line per step: {"step", "world", "node", "restart"}.

    python elastic.py FOLDER [STEPS]

Without a GPU (plain CPU torch, the control run of tests/elastic_rejoin_control.py) it uses gloo on
the CPU, so the same job runs with and without mirage.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

progress = Path(sys.argv[1]) / "step"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
if torch.cuda.is_available():
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = "cuda"
else:
    dist.init_process_group("gloo")
    device = "cpu"
start = torch.tensor([int(progress.read_text()) if progress.exists() else 0], device=device)
dist.broadcast(start, 0)  # every rank resumes where rank 0 left off
for step in range(int(start.item()), steps):
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    print(json.dumps({"step": step, "world": int(t.item()), "node": int(os.environ["MIRAGE_NODE_RANK"]),
                      "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}), flush=True)
    if dist.get_rank() == 0:
        progress.write_text(str(step + 1))
    time.sleep(0.25)
dist.destroy_process_group()
