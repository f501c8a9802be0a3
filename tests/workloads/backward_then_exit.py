"""A backward pass on a device's autograd thread, then exit: the script is correct and must exit 0.

The pass runs inside `torch.cuda.use_mem_pool`, where mirage leaves autograd's device thread
(`pt_autograd_0`) to run it, as on a GPU (mirage/runtime/autograd_threads.py: a backward while
the calling thread allocates to a private pool is left alone). Pinned to one CPU, and with the
main thread keeping the GIL (a long switch interval), that device thread is reliably the one left
holding the pass's last reference when the interpreter starts finalizing: the condition under
which torch 2.13 aborts with `terminate called without an active exception` unless the runtime
drains that thread at exit (`drain_at_exit`). Run it with `--no-fork-server`: a program the fork
server started ends with `_exit` and never finalizes.
"""

import os
import sys
from pathlib import Path

import torch

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
sys.setswitchinterval(1000)
weights = torch.ones(1000, device="cuda", requires_grad=True)
with torch.cuda.use_mem_pool(torch.cuda.MemPool()):
    (weights * 2).sum().backward()
# The pass ran on autograd's device thread, or this program shows nothing about the exit.
threads = {Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()}
assert "pt_autograd_0" in threads, threads
print("backward_done", weights.grad.sum().item(), flush=True)
