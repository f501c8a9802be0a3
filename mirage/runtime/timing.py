"""Clocked mode inside a workload process (mirage run --timing): the Python half of the shim's
predicted timeline (mirage/shim/device_clock.h).

What it adds to the shim: torch.utils.flop_counter's formulas (the shim asks for a kernel's
FLOPs through the operator mirage::flop_count, implemented here); the steps of the report (the
end of each optimizer step, or of each `torch.cuda.nvtx.mark("mirage.step")` once a program
makes one); NVTX ranges on the host's predicted clock for the trace; with --virtual-clock,
`time.time` / `perf_counter` / `monotonic` (and their _ns forms) following the predicted host
clock, the program thread's `time.sleep` advancing it; and at exit, this process's steps (and with --trace its
timeline) written for the launcher's report (mirage/launcher/timing_report.py).

Environment read: MIRAGE_TIMING (on), MIRAGE_TIMING_DIR (where reports go), MIRAGE_TRACE,
MIRAGE_VIRTUAL_CLOCK; MIRAGE_TIMING_MODEL is set by boot.py before the shim loads.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

from mirage.runtime.unprofiled import unprofiled

STEP_MARKER = "mirage.step"

_torch: ModuleType | None = None
_user_marks = False  # the program marks its own steps: optimizer steps no longer do
# Optimizer steps under way: an optimizer that steps others (torchtitan's OptimizersContainer
# is an Optimizer holding one per model part) ends one training step, not one per optimizer.
_optimizer_steps_open = 0
_ranges: list[tuple[str, int, int, int]] = []  # NVTX ranges for the trace: (name, thread, start ns, end ns)
_open_ranges = threading.local()


def enabled() -> bool:
    return bool(os.environ.get("MIRAGE_TIMING"))


def predict_only() -> bool:
    """--timing --predict-only: kernels are placed on the timeline, not run (the shim reads the
    same variable, device_clock.h's predict_only)."""
    return enabled() and bool(os.environ.get("MIRAGE_PREDICT_ONLY"))


def _flop_count(op: str, args: list, results: list) -> float:
    """torch.utils.flop_counter's count for one call of aten operator `op` ("aten::mm", or
    "aten::convolution_backward.default"-style with an overload)."""
    from torch.utils.flop_counter import flop_registry

    name, _, overload = op.partition(".")
    packet = getattr(_torch.ops.aten, name.split("::", 1)[1])
    overload_op = getattr(packet, overload or "default")
    formula = flop_registry[packet]
    positional, keywords = [], {}
    for argument, value in zip(overload_op._schema.arguments, args):
        # (the out_dtype matmuls, mm.dtype and its kin, put it where the packet's formula takes
        # its output's shape: a keyword there, which the formulas ignore)
        if argument.kwarg_only or argument.name == "out_dtype":
            keywords[argument.name] = value
        else:
            positional.append(value)
    out = results[0] if len(results) == 1 else tuple(results)
    return float(formula(*positional, out_val=out, **keywords))


def _mark_step() -> None:
    _torch.ops.mirage.clock_mark_step()


def _optimizer_step_begins(optimizer, args, kwargs) -> None:
    global _optimizer_steps_open
    _optimizer_steps_open += 1


def _optimizer_step_done(optimizer, args, kwargs) -> None:
    """The outermost optimizer step ends a training step (one that raised never reaches here,
    and ends the training loop with it)."""
    global _optimizer_steps_open
    _optimizer_steps_open = max(0, _optimizer_steps_open - 1)
    if not _user_marks and _optimizer_steps_open == 0:
        _mark_step()


def on_nvtx_mark(message: str) -> None:
    """torch.cuda.nvtx.mark: "mirage.step" ends a step (the first one discards the optimizer's)."""
    global _user_marks
    if message != STEP_MARKER or _torch is None:
        return
    if not _user_marks:
        _user_marks = True
        _torch.ops.mirage.clock_discard_steps()
    _mark_step()


def on_range_push(name: str) -> None:
    if _torch is None:
        return
    stack = getattr(_open_ranges, "stack", None)
    if stack is None:
        stack = _open_ranges.stack = []
    stack.append((name, _torch.ops.mirage.clock_host_ns()))


def on_range_pop() -> None:
    stack = getattr(_open_ranges, "stack", None)
    if _torch is None or not stack:
        return
    name, start = stack.pop()
    _ranges.append((name, threading.get_ident(), start, _torch.ops.mirage.clock_host_ns()))


def _is_torchrun_agent() -> bool:
    """torchrun's own process keeps real time: its rendezvous and monitoring loops wait on it."""
    program = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return program == "torchrun" or sys.argv[0].endswith(os.path.join("torch", "distributed", "run.py"))


def _install_virtual_clock() -> None:
    """time.time / perf_counter / monotonic follow the predicted host clock from now on; the
    program's own sleep advances it (and really sleeps, so that other processes make progress).
    The predicted host clock is the program's thread's (this one, at start-up): a background
    thread's sleep (tqdm's monitor, inductor's compile-pool timer, a heartbeat) waits in real
    time without moving it, as it does not delay the program on a GPU box. Such a thread had put
    its 30-60 s of sleep into whichever step it fell in (a torchtitan step predicted at 31 s)."""
    host_ns = _torch.ops.mirage.clock_host_ns
    advance = _torch.ops.mirage.clock_host_advance
    real_sleep = time.sleep
    program_thread = threading.current_thread()
    wall0, perf0, mono0 = time.time_ns(), time.perf_counter_ns(), time.monotonic_ns()
    start = host_ns()

    def elapsed() -> int:
        return host_ns() - start

    def sleep(seconds: float) -> None:
        real_sleep(seconds)
        if threading.current_thread() is program_thread:
            advance(int(seconds * 1e9))

    time.time = lambda: (wall0 + elapsed()) / 1e9
    time.time_ns = lambda: wall0 + elapsed()
    time.perf_counter = lambda: (perf0 + elapsed()) / 1e9
    time.perf_counter_ns = lambda: perf0 + elapsed()
    time.monotonic = lambda: (mono0 + elapsed()) / 1e9
    time.monotonic_ns = lambda: mono0 + elapsed()
    time.sleep = sleep


def _report_path() -> Path:
    return Path(os.environ["MIRAGE_TIMING_DIR"]) / f"{os.getpid()}.json"


def _write_report() -> None:
    """This process's steps, memory peaks and (with --trace) timeline, for the launcher."""
    torch = _torch
    mirage = torch.ops.mirage
    rows, flops = mirage.clock_steps()
    if not rows:  # no step marked: the whole run is one step
        mirage.clock_mark_step()
        rows, flops = mirage.clock_steps()
    devices = sorted({row[0] for row in rows})
    report = {
        "pid": os.getpid(),
        "rank": int(os.environ.get("RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "node": int(os.environ.get("MIRAGE_NODE_RANK", "0")),
        "steps_from": "marker" if _user_marks else "optimizer",
        "steps": [dict(zip(("device", "end", "duration", "compute", "memory", "collective", "exposed", "idle"), row),
                       flops=f) for row, f in zip(rows, flops)],
        "peak_memory": {str(d): {"allocated": torch.cuda.max_memory_allocated(d),
                                 "reserved": torch.cuda.max_memory_reserved(d)} for d in devices},
    }
    if os.environ.get("MIRAGE_TRACE"):
        intervals, interval_flops, names, memory = mirage.clock_timeline()
        report["timeline"] = {"intervals": intervals, "flops": interval_flops, "names": names, "memory": memory,
                              "ranges": _ranges, "visible_gpus": os.environ.get("MIRAGE_VISIBLE_GPUS", "")}
    path = _report_path()
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report))
    partial.rename(path)


def install(torch: ModuleType) -> None:
    """Arms clocked mode in this process (once torch and the shim are in)."""
    global _torch
    if not enabled():
        return
    _torch = torch
    from torch.utils.flop_counter import flop_registry
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    library = torch.library.Library("mirage", "IMPL")
    library.impl("flop_count", _flop_count, "CompositeExplicitAutograd")
    install.library = library  # kept alive with the process: dropping it unregisters the kernel
    names = [packet._qualified_op_name for packet in flop_registry if hasattr(packet, "_qualified_op_name")]
    torch.ops.mirage.clock_set_flop_ops(names)
    register_optimizer_step_pre_hook(unprofiled(_optimizer_step_begins))  # not the program's: unprofiled.py
    register_optimizer_step_post_hook(unprofiled(_optimizer_step_done))
    if os.environ.get("MIRAGE_VIRTUAL_CLOCK") and not _is_torchrun_agent():
        _install_virtual_clock()
    if not _is_torchrun_agent():
        atexit.register(_write_report)
