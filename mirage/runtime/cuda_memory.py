"""torch.cuda.memory's view of the caching allocator: memory_snapshot, _snapshot, _dump_snapshot
and _record_memory_history, from the shim's allocator model (mirage/shim/caching_allocator.h).

A snapshot lists each device's segments and blocks, and (while history is recorded) every
allocator action with the Python stack that caused it, in the real allocator's format, so that
PyTorch's own tools (torch.cuda._memory_viz, the memory viewer at pytorch.org/memory_viz) read
it. Stacks are Python frames: the C++ frames a GPU build can add (stacks="all") are not gathered.
"""

import sys
from types import ModuleType

# the order of mirage::TraceAction
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "segment_map",
            "segment_unmap")


def _history(torch: ModuleType, device: int) -> tuple[list[dict], dict[int, list[dict]]]:
    """The device's trace entries and the allocation stack of each live block, by address."""
    entries, blocks, stacks, files, names, lines = torch.ops.mirage.memory_history(device)
    frames = [{"filename": f, "name": n, "line": line} for f, n, line in zip(files, names, lines)]
    # torch's snapshots list the innermost frame first, as CapturedTraceback symbolizes them
    stack_frames = [[frames[i] for i in stack] for stack in stacks]

    def stack(index: int) -> list[dict]:
        return stack_frames[index] if index >= 0 else []

    free_bytes = None
    trace = []
    for action, address, size, stream, time_us, stack_index in entries:
        entry = {"action": _ACTIONS[action], "addr": address, "size": size, "stream": stream,
                 "time_us": time_us, "frames": stack(stack_index), "pool_id": (0, 0)}
        if _ACTIONS[action] == "oom":
            if free_bytes is None:
                free_bytes = torch.cuda.mem_get_info(device)[0]
            entry["device_free"] = free_bytes
            del entry["addr"]
        trace.append(entry)
    return trace, {address: stack(index) for address, index in blocks}


def _segments(torch: ModuleType, device: int, block_stacks: dict[int, list[dict]]) -> list[dict]:
    """The device's segments as torch._C._cuda_memorySnapshot lists them."""
    by_address: dict[int, dict] = {}
    for (segment_address, total_size, stream, is_small, address, size, requested, allocated, pool0,
         pool1, is_expandable) in torch.ops.mirage.memory_segments(device):
        segment = by_address.setdefault(segment_address, {
            "device": device, "address": segment_address, "total_size": total_size,
            "allocated_size": 0, "active_size": 0, "requested_size": 0, "stream": stream,
            "segment_type": "small" if is_small else "large", "segment_pool_id": (pool0, pool1),
            "is_expandable": bool(is_expandable), "frames": [], "blocks": [],
        })
        segment["blocks"].append({"address": address, "size": size, "requested_size": requested if allocated else 0,
                                  "state": "active_allocated" if allocated else "inactive",
                                  "frames": block_stacks.get(address, []) if allocated else []})
        if allocated:
            segment["allocated_size"] += size
            segment["active_size"] += size
            segment["requested_size"] += requested
    return list(by_address.values())


def install(torch: ModuleType) -> None:
    """Binds torch._C's memory snapshot and history entry points to the emulated allocator."""
    C = torch._C

    def memory_snapshot(pool_and_traces=None) -> dict:
        """All segments, or with (id0, id1, include_traces) other than (0, 0, ...) a MemPool's."""
        include_traces = pool_and_traces is None or bool(pool_and_traces[2])
        pool = None if pool_and_traces is None or tuple(pool_and_traces[:2]) == (0, 0) else tuple(pool_and_traces[:2])
        count = torch.cuda.device_count()
        segments, traces = [], []
        for device in range(count):
            trace, block_stacks = _history(torch, device)
            segments.extend(s for s in _segments(torch, device, block_stacks)
                            if pool is None or s["segment_pool_id"] == pool)
            traces.append(trace if include_traces else [])
        return {"segments": segments, "device_traces": traces,
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": C._accelerator_getAllocatorSettings()}}

    def record_memory_history(enabled, context="all", stacks="all", max_entries=sys.maxsize, clear_history=False,
                              *_compile_and_annotation_options) -> None:
        if enabled not in (None, "state", "all"):
            raise ValueError(f"expected enabled to be one of None, 'state', 'all', got {enabled!r}")
        if context not in (None, "state", "alloc", "all"):
            raise ValueError(f"expected context to be one of None, 'state', 'alloc', 'all', got {context!r}")
        if stacks not in ("python", "all"):
            raise ValueError(f"expected stacks to be 'python' or 'all', got {stacks!r}")
        torch.ops.mirage.record_memory_history(enabled is not None, context is not None,
                                               max_entries if enabled == "all" else 0, clear_history)

    def record_memory_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                                     trace_alloc_record_context=False, record_context_cpp=False,
                                     clear_history=False, *_compile_and_annotation_options) -> None:
        torch.ops.mirage.record_memory_history(bool(enabled), bool(record_context or trace_alloc_record_context),
                                               trace_alloc_max_entries, clear_history)

    C._cuda_memorySnapshot = memory_snapshot
    C._cuda_record_memory_history = record_memory_history
    C._cuda_record_memory_history_legacy = record_memory_history_legacy
