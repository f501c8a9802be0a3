"""Lets autograd's device threads finish with the last backward pass before Python finalizes.

With a CUDA device registered, autograd runs a backward pass on a worker thread per device
(`pt_autograd_N`). torch 2.13 stashes a Python object in the thread-local state every backward
captures (`_engine_run_backward`: the contextvars context), so whichever thread drops a pass's
last reference must take the GIL to release it. When that is the device thread, and it has not
yet got the GIL when the main thread starts finalizing, Python ends the thread with
`pthread_exit` inside a C++ destructor: `terminate called without an active exception`, SIGABRT,
a correct training script failing after its last line (seen: 1 run in about 40 of the DDP demo
on 2 cores; the core shows `ThreadLocalState::~ThreadLocalState` -> `take_gil` ->
`PyThread_exit_thread` on `pt_autograd_0`).

`drain_at_exit` (an atexit handler, so it runs while the main thread still holds a live
interpreter) runs one tiny backward pass on every device the process used, straight through the engine without
the stash. A device thread handles its queue in order and releases each pass before it takes
the next, and the main thread waits with the GIL released, so once each pass returns the
previous one is gone, and this one holds nothing that needs the GIL.
"""

from __future__ import annotations

import atexit
from types import ModuleType


def drain_at_exit(torch: ModuleType) -> None:
    """Runs a backward pass with an empty thread-local state on each used device's autograd thread."""
    if not torch.cuda.is_initialized():
        return  # no device tensor was made: no backward pass ran on a device thread
    engine = torch.autograd.Variable._execution_engine
    for index in range(torch.cuda.device_count()):
        if not (torch.cuda.memory_allocated(index) or torch.cuda.max_memory_allocated(index)):
            continue  # never used: no pass ran there, and a drain would show in its memory figures
        leaf = torch.zeros(0, device=torch.device("cuda", index), requires_grad=True)  # allocates nothing
        root = leaf * 1
        engine.run_backward((root,), (torch.ones_like(root),), False, False, (), True, True)


def install(torch: ModuleType) -> None:
    """Registers the drain; it runs after the atexit handlers registered later (LIFO), so after
    the process-group teardown, which may itself drop the last backward's objects."""
    atexit.register(drain_at_exit, torch)
