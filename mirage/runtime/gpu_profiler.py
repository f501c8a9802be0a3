"""torch.profiler's CUDA activity on the emulated GPUs.

A CUDA build of torch lists ProfilerActivity.CUDA among `torch.profiler.supported_activities()`
when it sees a GPU, and then Kineto records the GPU side through CUPTI. A CPU build lists only
CPU, so torch.profiler would fall back to timing each op with CUDA events (no kernel rows, no
flows in the exported trace). Here the emulated GPUs count as GPUs: the list names CUDA, and the
shim's Kineto plugin (mirage/shim/profiler_activities.cpp) supplies what CUPTI would. This module
only reports the activity as supported and describes the profiled GPUs to the plugin; the
activities themselves come from the shim's op path and the emulated NCCL.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from mirage import profiles
from mirage.runtime.unprofiled import unprofiled


def _device_properties(index: int, device: Any, profile: profiles.Profile) -> dict[str, Any]:
    """One entry of the trace's deviceProperties, with the fields Kineto writes from CUDA's."""
    return {
        "id": index, "name": device.name, "totalGlobalMem": device.total_memory,
        "computeMajor": device.major, "computeMinor": device.minor,
        "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": device.max_threads_per_multi_processor,
        "regsPerBlock": device.regs_per_multiprocessor, "warpSize": device.warp_size,
        "sharedMemPerBlock": device.shared_memory_per_block, "numSms": profile.compute_units,
        "regsPerMultiprocessor": device.regs_per_multiprocessor,
    }


def install(torch: ModuleType, profile: profiles.Profile, devices: Sequence[Any]) -> None:
    """Report ProfilerActivity.CUDA as supported (where torch looks it up, including the names
    torch.autograd bound at import) and describe `devices` to the shim's Kineto plugin."""
    cpu_builds = torch._C._autograd._supported_activities

    def supported_activities() -> set:
        activities = set(cpu_builds())
        if devices:
            activities.add(torch.profiler.ProfilerActivity.CUDA)
        return activities

    supported = unprofiled(supported_activities, "_supported_activities")
    torch._C._autograd._supported_activities = supported
    torch.autograd._supported_activities = supported
    torch.autograd.profiler._supported_activities = supported
    properties = ",".join(json.dumps(_device_properties(i, d, profile)) for i, d in enumerate(devices))
    torch.ops.mirage.profiler_describe_devices(properties, profile.arch, profile.is_amd)
