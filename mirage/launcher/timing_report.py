"""The end of a clocked run (mirage run --timing): the predicted step time per rank and for the
job, its split, MFU and peak memory; and with --trace, one Chrome/Perfetto trace of every rank's
predicted timeline.

Each workload process writes its steps at exit (mirage/runtime/timing.py); this module reads
them. A step is the predicted time between two step marks on a GPU (the end of an optimizer
step, or `torch.cuda.nvtx.mark("mirage.step")`), split into compute-bound and memory-bound
kernels, collectives, exposed communication (collective time no kernel overlaps) and idle time
(the GPU waiting for the host's launches or for other ranks).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from mirage import profiles

NS_PER_MS = 1e6
KINDS = ("compute", "memory", "collective", "copy")


def collect(directory: Path) -> list[dict]:
    """The reports the session's processes wrote, by rank."""
    reports = []
    for path in sorted(directory.glob("*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(reports, key=lambda r: (r["rank"], r["pid"]))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def build(reports: list[dict], profile: profiles.Profile, stands_for: int = 1) -> dict:
    """Per rank: steps, median and spread of the step time, the median step's split, MFU
    (model FLOPs per second over the profile's dense bf16 peak), peak memory; and the job's,
    whose GPUs count the ranks each running rank stands for (`stands_for`, with --stand-ins)."""
    peak_flops = profile.peak_tflops.get("bf16", max(profile.peak_tflops.values(), default=1.0)) * 1e12
    ranks = []
    for report in reports:
        steps = report["steps"]
        if not steps:
            continue
        durations = [s["duration"] for s in steps]
        median = statistics.median(durations)
        typical = min(steps, key=lambda s: abs(s["duration"] - median))
        flops = statistics.median(s["flops"] for s in steps)
        ranks.append({
            "rank": report["rank"], "node": report["node"], "steps": len(steps), "steps_from": report["steps_from"],
            "step_ms": median / NS_PER_MS, "step_p10_ms": _quantile(durations, 0.1) / NS_PER_MS,
            "step_p90_ms": _quantile(durations, 0.9) / NS_PER_MS,
            "split_ms": {key: typical[key] / NS_PER_MS
                         for key in ("compute", "memory", "collective", "exposed", "idle")},
            "mfu": flops / (median / 1e9) / peak_flops if median > 0 else 0.0,
            "peak_memory": report["peak_memory"],
        })
    job = {}
    if ranks:
        slowest = max(ranks, key=lambda r: r["step_ms"])
        job = {"gpus": len(ranks) * stands_for, "step_ms": slowest["step_ms"], "slowest_rank": slowest["rank"],
               "step_p10_ms": min(r["step_p10_ms"] for r in ranks),
               "step_p90_ms": max(r["step_p90_ms"] for r in ranks),
               "mfu": statistics.mean(r["mfu"] for r in ranks),
               "peak_allocated": max(m["allocated"] for r in ranks for m in r["peak_memory"].values()),
               "peak_reserved": max(m["reserved"] for r in ranks for m in r["peak_memory"].values())}
    return {"profile": profile.name, "ranks": ranks, "job": job}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def render(report: dict) -> str:
    lines = [f"mirage: predicted timing on {report['profile']} (clocked mode; median step, split of that step)"]
    if not report["ranks"]:
        lines.append("  no device work was recorded")
        return "\n".join(lines)
    lines.append("  rank  steps  step ms (p10-p90)        compute  memory  collect  exposed  idle     MFU    peak mem")
    for r in report["ranks"]:
        split = r["split_ms"]
        peak = max((m["allocated"] for m in r["peak_memory"].values()), default=0)
        spread = f"{r['step_ms']:.3f} ({r['step_p10_ms']:.3f}-{r['step_p90_ms']:.3f})"
        lines.append(f"  {r['rank']:<5} {r['steps']:<6} {spread:<24} {split['compute']:<8.3f} {split['memory']:<7.3f} "
                     f"{split['collective']:<8.3f} {split['exposed']:<8.3f} {split['idle']:<8.3f} "
                     f"{100 * r['mfu']:5.1f}%  {_gib(peak)}")
    job = report["job"]
    stood_in = f" on {job['gpus']} GPUs ({len(report['ranks'])} ran)" if job["gpus"] != len(report["ranks"]) else ""
    lines.append(f"  job{stood_in}: {job['step_ms']:.3f} ms per step (slowest rank {job['slowest_rank']}; "
                 f"p10-p90 {job['step_p10_ms']:.3f}-{job['step_p90_ms']:.3f}), MFU {100 * job['mfu']:.1f}%, "
                 f"peak memory {_gib(job['peak_allocated'])} allocated / {_gib(job['peak_reserved'])} reserved per GPU; "
                 f"steps from {report['ranks'][0]['steps_from']} steps")
    return "\n".join(lines)


def write_trace(reports: list[dict], path: str) -> int:
    """All ranks' predicted timelines as one Chrome trace (Perfetto opens it): a process per rank,
    a track per GPU stream (kernels, copies, collectives with their bytes), the host thread's NVTX
    ranges, a memory counter per GPU. Returns the number of events."""
    events: list[dict] = []
    for report in reports:
        timeline = report.get("timeline")
        if not timeline:
            continue
        pid = report["rank"]
        events.append({"ph": "M", "pid": pid, "name": "process_name",
                       "args": {"name": f"rank {report['rank']} (node {report['node']})"}})
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "host"}})
        tracks: dict[tuple[int, int], int] = {}
        for (device, stream, kind, start, end, nbytes), flops, name in zip(
                timeline["intervals"], timeline["flops"], timeline["names"]):
            tid = tracks.get((device, stream))
            if tid is None:
                tid = tracks[(device, stream)] = len(tracks) + 1
                label = f"cuda:{device} stream {stream}" + (" (nccl)" if KINDS[kind] == "collective" else "")
                events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": label}})
            args = {"bytes": nbytes}
            if flops:
                args["flops"] = flops
            events.append({"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": KINDS[kind],
                           "ts": start / 1e3, "dur": (end - start) / 1e3, "args": args})
        for name, _thread, start, end in timeline["ranges"]:
            events.append({"ph": "X", "pid": pid, "tid": 0, "name": name, "cat": "nvtx",
                           "ts": start / 1e3, "dur": max(end - start, 0) / 1e3})
        for device, when, allocated in timeline["memory"]:
            events.append({"ph": "C", "pid": pid, "name": f"cuda:{device} memory allocated", "ts": when / 1e3,
                           "args": {"bytes": allocated}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)
