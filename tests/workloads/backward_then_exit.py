"""A backward pass on a device, then exit: the script is correct and must exit 0.

Pinned to one CPU, and with the main thread keeping the GIL (a long switch interval), autograd's
device thread is reliably the one left holding the pass's last reference when the interpreter
starts finalizing: the condition under which torch 2.13 aborts with `terminate called without
an active exception` unless the runtime drains that thread at exit (mirage/runtime/autograd_threads.py).
"""

import os
import sys

import torch

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
sys.setswitchinterval(1000)
weights = torch.ones(1000, device="cuda", requires_grad=True)
(weights * 2).sum().backward()
print("backward_done", weights.grad.sum().item(), flush=True)
