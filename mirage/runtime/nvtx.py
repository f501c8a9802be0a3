"""NVTX (roctx on AMD) ranges and marks for torch.cuda.nvtx: accepted, and almost free.

A CPU build of torch has no `torch._C._nvtx`, so `torch.cuda.nvtx.range_push` raises "NVTX
functions not installed" and frameworks that annotate every forward (DeepSpeed's ZeRO among
them) fail on their first step. On a GPU box with no profiler attached the calls do nothing
visible either. Here each thread keeps its stack of open range names, so a push returns the
zero-based depth of the range it opened (as torch documents) and a pop the depth of the one it
closed (-1 with nothing open, as NVTX reports an unmatched pop). In clocked mode the ranges go
into the trace on the host's predicted clock, and the mark "mirage.step" ends a step.
"""

from __future__ import annotations

import itertools
import threading
from types import ModuleType, SimpleNamespace

from mirage.runtime import timing

_open = threading.local()  # .names: this thread's stack of open push/pop ranges
_started: dict[int, str] = {}  # range_start ids (may end on another thread) -> their names
_next_id = itertools.count(1)


def _names() -> list[str]:
    if not hasattr(_open, "names"):
        _open.names = []
    return _open.names


def open_ranges() -> tuple[str, ...]:
    """The names of this thread's open push/pop ranges, outermost first."""
    return tuple(_names())


def range_push(message: str) -> int:
    names = _names()
    names.append(str(message))
    timing.on_range_push(names[-1])
    return len(names) - 1


def range_pop() -> int:
    names = _names()
    if not names:
        return -1
    names.pop()
    timing.on_range_pop()
    return len(names)


def range_start(message: str) -> int:
    range_id = next(_next_id)
    _started[range_id] = str(message)
    return range_id


def range_end(range_id: int) -> None:
    _started.pop(range_id, None)


def mark(message: str) -> None:
    """A point event: in clocked mode, "mirage.step" ends a step of the report."""
    timing.on_nvtx_mark(str(message))


def device_range_start(message: str, stream: int = 0) -> int:
    return range_start(message)


def device_range_end(range_handle: int, stream: int = 0) -> None:
    range_end(range_handle)


def install(torch: ModuleType) -> None:
    """Gives torch the `_nvtx` binding a CUDA (or ROCm) build has."""
    binding = SimpleNamespace(rangePushA=range_push, rangePop=range_pop, rangeStartA=range_start,
                              rangeEnd=range_end, markA=mark, deviceRangeStart=device_range_start,
                              deviceRangeEnd=device_range_end)
    torch._C._nvtx = binding
    import torch.cuda.nvtx

    torch.cuda.nvtx._nvtx = binding
