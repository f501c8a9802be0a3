"""A seeded race: the host reads a tensor a side stream wrote, with no synchronisation between:
with .item() (or `cpu`: .cpu()) on the default stream, which waits for the default stream only.
`ordered` makes the default stream wait for the side stream first (correct)."""

import sys

import torch

x = torch.ones(1024, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    total = x.sum()                 # written on the side stream
if "ordered" in sys.argv:
    torch.cuda.current_stream().wait_stream(side)
print("result", total.cpu().item() if "cpu" in sys.argv else total.item())  # the host reads it
