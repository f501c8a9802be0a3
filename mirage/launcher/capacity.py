"""Whether the machine can hold the session's processes, checked before anything starts.

A job with more ranks than memory would otherwise end by the kernel's OOM killer, minutes in,
taking a random process with it. The estimate is a floor: each process's own memory after
`import torch` and its process group (what bench/scale.py measures as a process's unique
memory), times the processes the request will start, against what the kernel says is
available (MemAvailable, or the cgroup's limit if lower). The workload's own tensors come on top.
"""

from __future__ import annotations

import os
from pathlib import Path

MIB = 1 << 20
# A rank's unique memory (smaps_rollup Private_Dirty + Private_Clean) once it has run a
# collective, measured by bench/scale.py (docs/benchmarks.md), with a margin: started on its own
# (about 145 MB measured), and forked from the fork server (10 MB measured at the first
# collective, a DDP rank after a few steps 30 MB; the server and its twins add one process
# about as large as a rank on its own).
PROCESS_BYTES_ON_ITS_OWN = 150 * MIB
PROCESS_BYTES_FORKED = 32 * MIB
TORCHRUN_COMMANDS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


class CapacityError(Exception):
    """The request cannot fit in this machine's memory; the message gives the estimate and fix."""


def planned_processes(command: list[str], num_nodes: int, nproc_per_node: int | None, gpus: int) -> int:
    """How many Python processes the request starts: K per node with --nproc-per-node; with
    torchrun, its workers and its agent per node; otherwise the command once per node."""
    if nproc_per_node:
        return num_nodes * nproc_per_node
    workers = _torchrun_workers(command, gpus)
    return num_nodes * (workers + 1) if workers else num_nodes


def _torchrun_workers(command: list[str], gpus: int) -> int:
    """torchrun's --nproc-per-node in the command (1, its default, when absent); 0 when the
    command is not torchrun."""
    if not any(Path(token).name in TORCHRUN_COMMANDS or token in TORCHRUN_COMMANDS for token in command):
        return 0
    for index, token in enumerate(command):
        name, sep, value = token.partition("=")
        if name.replace("_", "-") == "--nproc-per-node":
            if not sep:
                value = command[index + 1] if index + 1 < len(command) else "1"
            return int(value) if value.isdigit() else gpus  # "gpu", "auto": one a GPU
    return 1


def available_bytes() -> tuple[int, str]:
    """Memory the session may use, and where the figure comes from."""
    available = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    source = "MemAvailable in /proc/meminfo"
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((cgroup / "memory.current").read_text())
            if room < available:
                available, source = room, "the cgroup's memory.max less memory.current"
    except (OSError, ValueError):
        pass
    return available, source


def check(command: list[str], num_nodes: int, nproc_per_node: int | None, gpus: int, fork_server: bool) -> None:
    """Refuses a request whose processes cannot fit, naming the estimate and the fix."""
    processes = planned_processes(command, num_nodes, nproc_per_node, gpus)
    each = PROCESS_BYTES_FORKED if fork_server else PROCESS_BYTES_ON_ITS_OWN
    needed = processes * each + (PROCESS_BYTES_ON_ITS_OWN if fork_server else 0)
    available, source = available_bytes()
    if needed <= available:
        return
    how = "forked from the fork server" if fork_server else "each started on its own (--no-fork-server)"
    fixes = "fewer nodes or ranks (--num-nodes, --nproc-per-node, torchrun's --nproc-per-node)"
    if not fork_server:
        fixes += f"; drop --no-fork-server (about {PROCESS_BYTES_FORKED // MIB} MiB a process)"
    fits = max(0, (available - (PROCESS_BYTES_ON_ITS_OWN if fork_server else 0)) // each)
    raise CapacityError(
        f"this machine cannot hold {processes} processes: they need about {needed / 2**30:.1f} GiB "
        f"({processes} x {each // MIB} MiB, the memory a process of the runtime needs before the workload's "
        f"own, {how}) but {available / 2**30:.1f} GiB is available ({source}); about {fits} would fit. "
        f"Fix: {fixes}; or free memory on this machine.")
