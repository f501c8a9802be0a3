"""A seeded race: a parameter written on the default stream and read on a side stream with no
wait_stream between. `ordered` makes the side stream wait first (correct)."""

import sys

import torch
from torch import nn

model = nn.Linear(64, 64, bias=False).cuda()
side = torch.cuda.Stream()
with torch.no_grad():
    model.weight.fill_(1 / 64)      # written on the default stream
if "ordered" in sys.argv:
    side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    y = model(torch.ones(2, 64, device="cuda"))  # read on the side stream
torch.cuda.current_stream().wait_stream(side)
print("result", y.sum().item())
