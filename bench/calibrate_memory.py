"""Calibration: the memory table of bench/memory_table.py, measured on a real GPU.

Run on a machine with a GPU and a CUDA or ROCm build of torch (no mirage):

    python bench/calibrate_memory.py [--workloads mlp gpt-s ...]

Same workloads, same columns: "model" is here the real caching allocator
(max_memory_allocated / max_memory_reserved), "rules" bench/allocator_rules.py replaying the
real allocator's own trace (so a difference is a rule the replay, and mirage's model, lack), and
"process" the device memory this process holds at the end (cudaMemGetInfo's used bytes minus
other processes', i.e. its context plus its reserved memory). The line `context` is that figure
minus memory_reserved() after the first allocation: the value for the profile's context_bytes.
Compare with `mirage run --profile <this GPU> -- python bench/memory_table.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_table import MIB, peak_requested  # noqa: E402
from allocator_rules import replay  # noqa: E402
from memory_workloads import WORKLOADS, train  # noqa: E402


def used_by_this_process(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free  # on a GPU of its own, everything used is this process's


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/calibrate_memory.py needs a real GPU", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.ones(1, device=device)
    context = used_by_this_process(device) - torch.cuda.memory_reserved(device)
    rows = []
    for name in args.workloads:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.memory._record_memory_history(max_entries=10_000_000, context=None)
        train(name, device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
        torch.cuda.memory._record_memory_history(enabled=None)
        rules = replay(trace)
        rows.append({"workload": name, "gpu_allocated": torch.cuda.max_memory_allocated(device),
                     "gpu_reserved": torch.cuda.max_memory_reserved(device), "rules_allocated": rules.peak_allocated,
                     "rules_reserved": rules.peak_reserved, "requested": peak_requested(trace),
                     "process": used_by_this_process(device)})
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; context {context / MIB:.2f} MiB; MiB")
    print("| workload | gpu alloc | rules alloc | gpu reserved | rules reserved | requested | process |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['gpu_allocated'] / MIB:.2f} | {r['rules_allocated'] / MIB:.2f} | "
              f"{r['gpu_reserved'] / MIB:.2f} | {r['rules_reserved'] / MIB:.2f} | {r['requested'] / MIB:.2f} | "
              f"{r['process'] / MIB:.2f} |")
    print("JSON " + json.dumps({"device": torch.cuda.get_device_name(device), "context_bytes": context, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
