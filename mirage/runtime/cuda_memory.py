"""torch.cuda.memory's snapshot of the caching allocator (memory_snapshot, _snapshot,
_dump_snapshot), from the shim's allocator model (mirage/shim/caching_allocator.h).

A snapshot lists each device's segments and their blocks in the real allocator's format, so
PyTorch's own tools (torch.cuda._memory_viz) read it. Blocks carry no allocation stacks: the
allocation history with stacks (_record_memory_history) is not recorded, and device_traces are
empty."""

from types import ModuleType


def _segments(torch: ModuleType, device: int) -> list[dict]:
    """The device's segments as torch._C._cuda_memorySnapshot lists them."""
    by_address: dict[int, dict] = {}
    for (segment_address, total_size, stream, is_small, address, size, requested,
         allocated) in torch.ops.mirage.memory_segments(device):
        segment = by_address.setdefault(segment_address, {
            "device": device, "address": segment_address, "total_size": total_size,
            "allocated_size": 0, "active_size": 0, "requested_size": 0, "stream": stream,
            "segment_type": "small" if is_small else "large", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": [], "blocks": [],
        })
        segment["blocks"].append({"address": address, "size": size, "requested_size": requested if allocated else 0,
                                  "state": "active_allocated" if allocated else "inactive", "frames": []})
        if allocated:
            segment["allocated_size"] += size
            segment["active_size"] += size
            segment["requested_size"] += requested
    return list(by_address.values())


def install(torch: ModuleType) -> None:
    """Binds torch._C._cuda_memorySnapshot to the emulated allocator."""
    def memory_snapshot(_pool_and_traces=None) -> dict:
        count = torch.cuda.device_count()
        return {
            "segments": [s for device in range(count) for s in _segments(torch, device)],
            "device_traces": [[] for _ in range(count)],
            "allocator_settings": {},
        }

    torch._C._cuda_memorySnapshot = memory_snapshot
