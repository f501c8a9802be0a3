"""An unmodified single-process GPU training script: nothing in it knows about mirage.

Run it on emulated GPUs with:  mirage run --gpus-per-node 4 -- python examples/single_gpu_train.py
"""

import os
import tempfile

import torch
from torch import nn

assert torch.cuda.is_available(), "this script needs a GPU"
print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB each")

torch.manual_seed(0)
device = torch.device("cuda", torch.cuda.device_count() - 1)
model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)).cuda(device.index)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
inputs = torch.randn(1024, 32, device=device)
targets = (inputs[:, :4].sum(dim=1, keepdim=True) * 0.5).sin()

for step in range(1, 201):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = nn.functional.mse_loss(model(inputs).float(), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if step == 1 or step % 25 == 0:
        print(f"step {step:3d}  loss {loss.item():.5f}  "
              f"({torch.cuda.memory_allocated(device) / 2**20:.1f} MiB on {device})")

with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "checkpoint.pt")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    restored = torch.load(path, map_location="cuda:0")
    model.load_state_dict(restored["model"])
    print(f"checkpoint restored onto {next(iter(restored['model'].values())).device}")
