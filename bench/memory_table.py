"""Benchmark: device memory of reference training steps as mirage's allocator model predicts it,
checked against PyTorch's caching-allocator rules applied by hand to the same allocation trace.

Not a test. Must run under mirage:

    mirage run --gpus-per-node 1 -- python bench/memory_table.py [--workloads mlp gpt-s ...]

For each workload of bench/memory_workloads.py (two AdamW steps from seed 0, math attention),
with the cache emptied and the peaks reset first, and torch.cuda.memory._record_memory_history
on, it reports:

  model alloc / model reserved   torch.cuda.max_memory_allocated / max_memory_reserved
  rules alloc / rules reserved   bench/allocator_rules.py replaying the recorded alloc/free trace
  requested                      the peak of the bytes asked for (what counting exact tensor
                                 sizes, as mirage did before the allocator model, would say)
  process                        the process's peak on the device as nvidia-smi would show it:
                                 its GPU context (the profile's context_bytes) + peak reserved

bench/calibrate_memory.py prints the same columns for the real allocator on a real GPU.
Output: a markdown table and a `JSON ` line. Exit code: 0 if model and rules agree on every
workload, 3 if not, 2 if not running under mirage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allocator_rules import replay  # noqa: E402
from memory_workloads import WORKLOADS, train  # noqa: E402

MIB = 2**20


def peak_requested(trace: list[dict]) -> int:
    live, now, peak = {}, 0, 0
    for entry in trace:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry["size"]
            now += entry["size"]
            peak = max(peak, now)
        elif entry["action"] == "free_completed":
            now -= live.pop(entry["addr"])
    return peak


def measure(name: str, device: torch.device, context_bytes: int) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=10_000_000, context=None)
    try:
        train(name, device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    rules = replay(trace)
    reserved = torch.cuda.max_memory_reserved(device)
    return {"workload": name, "model_allocated": torch.cuda.max_memory_allocated(device), "model_reserved": reserved,
            "rules_allocated": rules.peak_allocated, "rules_reserved": rules.peak_reserved,
            "requested": peak_requested(trace), "process": context_bytes + reserved, "events": len(trace)}


def main() -> int:
    if "MIRAGE_SESSION" not in os.environ:
        print("bench/memory_table.py measures mirage's allocator model: run it under `mirage run`", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args()
    from mirage import profiles
    profile = profiles.load(os.environ["MIRAGE_PROFILE"])
    device = torch.device("cuda", 0)
    rows = [measure(name, device, profile.context_bytes) for name in args.workloads]
    print(f"profile {profile.name}, torch {torch.__version__}; MiB")
    print("| workload | model alloc | rules alloc | model reserved | rules reserved | requested | process |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['model_allocated'] / MIB:.2f} | {r['rules_allocated'] / MIB:.2f} | "
              f"{r['model_reserved'] / MIB:.2f} | {r['rules_reserved'] / MIB:.2f} | {r['requested'] / MIB:.2f} | "
              f"{r['process'] / MIB:.2f} |")
    agree = all(r["model_allocated"] == r["rules_allocated"] and r["model_reserved"] == r["rules_reserved"]
                for r in rows)
    print("JSON " + json.dumps({"profile": profile.name, "rows": rows, "model_follows_rules": agree}))
    return 0 if agree else 3


if __name__ == "__main__":
    sys.exit(main())
