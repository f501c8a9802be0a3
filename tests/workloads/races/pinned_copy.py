"""A seeded race: a non-blocking copy into pinned host memory read by the host before the stream
that copies is synchronised. `synchronized` waits for the stream first (correct)."""

import sys

import torch

x = torch.ones(4096, device="cuda")
pinned = torch.empty(4096, pin_memory=True)
# The copy is queued on the current stream: non_blocking=True returns before it is done, which is
# the point of it (the host goes on issuing work).
pinned.copy_(x, non_blocking=True)  # the GPU writes it when the stream gets there
if "synchronized" in sys.argv:
    torch.cuda.current_stream().synchronize()
print("result", pinned.sum().item())  # the host reads it
