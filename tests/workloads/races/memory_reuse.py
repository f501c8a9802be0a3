"""A seeded race: a tensor allocated on the default stream, read on a side stream, and freed with no
record_stream. The caching allocator hands its block to the next allocation of the default
stream at once, whose kernel overwrites it while the side stream may still be reading it.
`recorded` calls x.record_stream(side) first (correct)."""

import sys

import torch

side = torch.cuda.Stream()
x = torch.randn(1 << 16, device="cuda")
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    y = x * 2                       # the side stream reads x
if "recorded" in sys.argv:
    x.record_stream(side)
del x                               # freed while the side stream may still use it
z = torch.zeros(1 << 16, device="cuda")  # the default stream reuses the block
torch.cuda.current_stream().wait_stream(side)
print("result", float(y.abs().sum() > 0), float(z.sum()))
