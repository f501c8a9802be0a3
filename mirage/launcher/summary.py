"""The end-of-session summary: per GPU peak memory, per process exit status, collectives.

One table on stderr (with the faults injected, when --fault asked for some) (`--quiet` turns it off); `--summary-json PATH` writes the same for scripts.
Collective counts and bytes come from the flight recorder, so they cover collectives called
from Python (DDP's internal bucket all-reduces run in C++ and are not counted).
"""

from __future__ import annotations

import json

from mirage.daemon.service import SessionService
from mirage.shim import build as shim_build


def build(service: SessionService, exit_codes: dict[str, int], exit_code: int) -> dict:
    counts = service.recorder.counts
    return {
        "session": service.session_id,
        "build": shim_build.build_identity(),  # what `mirage --version` prints, for bug reports
        "exit_code": exit_code,
        "gpus": [{"node": n, "gpu": g, "peak_bytes": peak} for (n, g), peak in sorted(service.peaks.items())],
        "processes": [{"rank": label, "exit_code": code} for label, code in sorted(exit_codes.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0)],
        "collectives": [{"rank": rank, "count": c[0], "bytes": c[1]} for rank, c in sorted(counts.items())],
    }


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def render(report: dict) -> str:
    lines = [f"mirage: session {report['session']} summary (exit code {report['exit_code']})"]
    used = [g for g in report["gpus"] if g["peak_bytes"]]
    lines.append("  GPU (node:index)  peak memory")
    for g in used or report["gpus"][:1]:
        lines.append(f"  {g['node']}:{g['gpu']:<15} {_size(g['peak_bytes'])}")
    if len(used) < len(report["gpus"]):
        lines.append(f"  ({len(report['gpus']) - len(used)} GPU(s) unused)")
    by_rank = {c["rank"]: c for c in report["collectives"]}
    lines.append("  process  exit  collectives  bytes moved")
    for p in report["processes"]:
        c = by_rank.get(int(p["rank"])) if p["rank"].isdigit() else None
        lines.append(f"  [{p['rank']}]{'':<{6 - len(p['rank'])}} {p['exit_code']:<5} "
                     f"{(c or {}).get('count', 0):<12} {_size((c or {}).get('bytes', 0))}")
    for f in report.get("faults", []):
        when = f"fired at {f['at_s']:.1f} s (pid {f['pid']})" if f.get("at_s") is not None else \
            ("fired" if f["fired"] else "never fired (the workload ended first)")
        lines.append(f"  fault {f['id']}: {f['description']}: {when}")
    effects = report.get("fault_effects")
    if effects:
        for e in effects["errors"]:
            attempt = f" (attempt {e['restart']})" if e["restart"] else ""
            lines.append(f"    rank {e['rank']}{attempt} saw at {e['at_s']:.1f} s: {e['error']}")
        if effects["restarts"]:
            lines.append(f"    restarts: {effects['restarts']} (torchrun), downtime {effects['downtime_s']:.1f} s")
    return "\n".join(lines)


def write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
