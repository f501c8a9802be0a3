"""Where autograd runs an emulated device's backward pass, and its device threads at exit.

**Backward on the calling thread.** With a CUDA device registered, autograd hands the nodes of a
device to a worker thread per device (`pt_autograd_N`). On a GPU that thread only launches
kernels; here it runs them, on the CPU, and every thread that starts an OpenMP parallel region
gets an OpenMP team of its own. Two teams (the main thread's for forward and the optimizer, the
device thread's for backward) make libgomp manage more threads than there are cores, and it then
throttles its spin-wait from 300,000 iterations to 100, so every parallel region of every small
kernel pays a futex wake-up: a small-op training step at 2 threads on 2 cores ran at 2x the native
CPU step (docs/benchmarks.md), against 1.3x at one thread. So a backward pass started from Python
runs with autograd's multithreading disabled, as `torch.autograd.set_multithreading_enabled(False)`
does: every node runs on the calling thread, one OpenMP team does all the work, as in a CPU
process. Left alone: a backward pass while the calling thread allocates to a private pool
(`torch.cuda.use_mem_pool` routes that thread's allocations only: on a GPU the backward pass's
allocations, made by the device thread, do not go there), and backward passes started from C++.

**Device threads at exit.** When a device thread did run a pass, torch 2.13 stashes a Python
object in the thread-local state every backward
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

from mirage.runtime.unprofiled import unprofiled_around


def drain_at_exit(torch: ModuleType) -> None:
    """Runs a backward pass with an empty thread-local state on each used device's autograd thread."""
    if not torch.cuda.is_initialized():
        return  # no device tensor was made: no backward pass ran on a device thread
    engine = torch.autograd.Variable._execution_engine
    for index in range(torch.cuda.device_count()):
        if not (torch.cuda.memory_allocated(index) or torch.cuda.max_memory_allocated(index)):
            continue  # never used: no pass ran there, and a drain would show in its memory figures
        try:
            leaf = torch.zeros(0, device=torch.device("cuda", index), requires_grad=True)  # allocates nothing
        except torch.AcceleratorError:
            return  # the GPU was lost (--fault lose-gpu): no pass can run there, and none is pending
        root = leaf * 1
        engine.run_backward((root,), (torch.ones_like(root),), False, False, (), True, True)


def on_calling_thread(torch: ModuleType, run_backward):
    """`run_backward` (autograd's `_engine_run_backward`) with every node on the calling thread."""
    is_enabled, set_enabled = torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled
    allocates_to_pool = torch.ops.mirage.thread_allocates_to_pool

    def on_this_thread(*args, **kwargs) -> bool:
        """Turns the device threads off for this pass (unless off already, or the pass allocates
        to a private pool); says whether it did."""
        if not is_enabled() or allocates_to_pool():
            return False
        set_enabled(False)
        return True

    def restore(turned_off: bool, returned: bool) -> None:
        if turned_off:
            set_enabled(True)

    # The pass is the program's (its profile shows it); the switching is mirage's (unprofiled.py).
    return unprofiled_around(run_backward, on_this_thread, restore)


def install(torch: ModuleType) -> None:
    """Runs Python's backward passes on the calling thread, and registers the drain; the drain runs
    after the atexit handlers registered later (LIFO), so after the process-group teardown, which
    may itself drop the last backward's objects."""
    # torch.autograd imported the function by name: both references are autograd's entry points
    # (torch.compiler patches the same two for non-strict tracing).
    wrapped = on_calling_thread(torch, torch.autograd.graph._engine_run_backward)
    torch.autograd.graph._engine_run_backward = torch.autograd._engine_run_backward = wrapped
    atexit.register(drain_at_exit, torch)
