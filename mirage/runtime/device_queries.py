"""torch.cuda's NVML / amdsmi queries, answered by the emulated device: utilization,
memory_usage, temperature, power_draw, clock_rate, device_memory_used, list_gpu_processes.

On a real box torch asks pynvml (NVIDIA) or amdsmi (AMD), which have no device to talk to here.
What each returns (documented in the README):

- utilization, memory_usage: the percent of the time since the previous query (at least 1/6 s
  back, NVML's shortest sample period) during which work ran on the device, by any process of
  the session: the shim's op path times every kernel into the device's busy time. Emulated kernels are CPU loops over memory, so the two
  are the same figure.
- power_draw: a model, 15% of the profile's board power idle rising linearly to all of it at
  100% utilization; in milliwatts on NVIDIA profiles (NVML) and watts on AMD ones (amdsmi's
  socket power), as the real calls return them.
- temperature: a model, 35 C idle rising linearly to 80 C at 100% utilization.
- clock_rate: the profile's clock in MHz.
- device_memory_used: bytes in use on the device, by every process of the session.
- list_gpu_processes: torch's printout ("GPU:N", then "process PID uses X MB GPU memory" per
  process) of the session's processes holding memory on the device, from the session's device
  table (what `mirage smi` lists); without a session service (--in-process), this process alone.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType

from mirage.daemon.shared_table import SharedTable
from mirage.profiles import Profile, temperature_celsius

_SHORTEST_SAMPLE_PERIOD_S = 1 / 6  # NVML's


def install(torch: ModuleType, profile: Profile) -> None:
    cuda = torch.cuda
    started = time.monotonic()
    # The busy time is the whole session's: what a device had done before this process counts from here.
    at_start = {d: torch.ops.mirage.busy_time_ns(d) for d in range(cuda.device_count())}
    samples: dict[int, list[tuple[float, int]]] = {}  # device -> (time, busy ns) of earlier calls

    def index(device) -> int:
        return cuda._utils._get_device_index(device, optional=True)

    def busy_fraction(device) -> float:
        """Busy time over the period since the latest earlier query at least 1/6 s ago (NVML's
        shortest sample period), or since the process started. No sampling thread: one would
        have to call into torch while the interpreter shuts down."""
        d = index(device)
        now, busy = time.monotonic(), torch.ops.mirage.busy_time_ns(d)
        earlier = [s for s in samples.get(d, []) if now - s[0] >= _SHORTEST_SAMPLE_PERIOD_S]
        since, busy_then = earlier[-1] if earlier else (started, at_start.get(d, 0))
        samples[d] = [s for s in samples.get(d, []) if s[0] >= since] + [(now, busy)]
        return min(1.0, max(0.0, (busy - busy_then) / 1e9 / max(now - since, 1e-9)))

    def utilization(device=None) -> int:
        return round(100 * busy_fraction(device))

    def temperature(device=None) -> int:
        return temperature_celsius(busy_fraction(device))

    def power_draw(device=None) -> int:
        watts = profile.power_watts(busy_fraction(device))
        return round(watts if profile.is_amd else watts * 1000)

    def clock_rate(device=None) -> int:
        index(device)
        return round(profile.clock_ghz * 1000)

    def device_memory_used(device=None) -> int:
        free, total = cuda.mem_get_info(index(device))
        return total - free

    def list_gpu_processes(device=None) -> str:
        d = index(device)
        gpu = [int(g) for g in os.environ["MIRAGE_VISIBLE_GPUS"].split(",")][d]  # the node's GPU, as NVML numbers it
        if os.environ.get("MIRAGE_SHM"):
            node = int(os.environ.get("MIRAGE_NODE_RANK", "0"))
            users = [(v.pid, v.bytes_per_gpu[gpu]) for _, v in SharedTable.open(Path(os.environ["MIRAGE_SHM"])).slots()
                     if v.node == node and v.bytes_per_gpu[gpu]]
        else:
            users = [(os.getpid(), device_memory_used(d))]
        lines = [f"GPU:{gpu}"] + [f"process {pid:>10d} uses {used / 2**20:>12.3f} MB GPU memory" for pid, used in users]
        return "\n".join(lines if users else lines + ["no processes are running"])

    cuda.utilization = cuda.memory_usage = utilization
    cuda.temperature, cuda.power_draw, cuda.clock_rate = temperature, power_draw, clock_rate
    cuda.device_memory_used = device_memory_used
    cuda.list_gpu_processes = cuda.memory.list_gpu_processes = list_gpu_processes
