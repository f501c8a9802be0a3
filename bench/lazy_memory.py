"""Benchmark: the host memory a large-model prediction takes, with and without
`--lazy-device-memory`.

Not a test. Starts mirage itself (run it with plain python):

    python bench/lazy_memory.py [--layers 24 --dim 2048 --heads 16] [--gpus 8] [--modes default lazy]

Runs bench/e2e_gpt.py --fsdp (a GPT of MPT's shapes, FSDP2 FULL_SHARD per block, initialised on
the meta device, bf16 autocast, AdamW) under `mirage run --timing --predict-only` on N emulated
GPUs of a profile, once per mode, and samples every process of the run (the workload's ranks, the
launcher) every --interval seconds from /proc: the sum of their proportional set sizes (Pss:
pages shared between processes, such as device memory a peer maps, counted once) and the
largest rank's. The peak of the sum is the host memory the run needed. Against it: the GPU's
figure, each emulated GPU's peak memory as the session summary reports it (what nvidia-smi would
show: context + reserved), summed over the GPUs.

Output: a markdown table and a `JSON ` line. Exit code 0, or 1 if a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
E2E = Path(__file__).resolve().parent / "e2e_gpt.py"


def descendants(root: int) -> list[int]:
    """root and every process below it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def pss_bytes(pid: int) -> int:
    """A process's proportional set size (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run(mode: str, args: argparse.Namespace) -> dict:
    """One prediction under `mode` ("default" or "lazy"); its host and GPU memory peaks."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        command = [sys.executable, "-m", "mirage", "run", "--quiet", "--timing", "--predict-only",
                   "--profile", args.profile, "--gpus-per-node", str(args.gpus), "--nproc-per-node", str(args.gpus),
                   "--summary-json", str(summary), *(["--lazy-device-memory"] if mode == "lazy" else []), "--",
                   sys.executable, str(E2E), "--fsdp", "--layers", str(args.layers), "--dim", str(args.dim),
                   "--heads", str(args.heads), "--seq", str(args.seq), "--batch", str(args.batch),
                   "--steps", str(args.steps)]
        start = time.monotonic()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        peak_total = peak_rank = 0
        while proc.poll() is None:
            sizes = [pss_bytes(pid) for pid in descendants(proc.pid)]
            peak_total = max(peak_total, sum(sizes))
            peak_rank = max([peak_rank, *sizes])
            time.sleep(args.interval)
        out, err = proc.communicate()
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            print(f"{mode}: mirage run exited {proc.returncode}\n{err[-3000:]}", file=sys.stderr)
            return {"mode": mode, "failed": proc.returncode, "host_peak_bytes": peak_total}
        gpus = json.loads(summary.read_text())["gpus"]
        # rank 0's line, "[0] E2E {...}" (mirage prefixes each rank's output with its rank)
        step = next((json.loads(line.split("E2E ", 1)[1]) for line in out.splitlines() if "E2E {" in line), None)
        if step is None:
            print(f"{mode}: no E2E line from rank 0\n{out[-2000:]}\n{err[-2000:]}", file=sys.stderr)
            return {"mode": mode, "failed": "no result", "host_peak_bytes": peak_total}
        return {"mode": mode, "host_peak_bytes": peak_total, "largest_process_peak_bytes": peak_rank,
                "gpu_peak_bytes_total": sum(g["peak_bytes"] for g in gpus),
                "gpu_peak_bytes_max": max(g["peak_bytes"] for g in gpus),
                "predicted_step_ms": step["step_ms"], "wall_s": round(seconds, 1)}


def params(layers: int, dim: int, vocab: int, seq: int) -> int:
    """Parameters of bench/e2e_gpt.py's GPT (tied embeddings)."""
    return vocab * dim + seq * dim + layers * (12 * dim * dim + 13 * dim) + 2 * dim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--modes", nargs="+", choices=("default", "lazy"), default=["default", "lazy"])
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    args = ap.parse_args()
    if os.environ.get("MIRAGE_SESSION"):
        print("bench/lazy_memory.py starts mirage itself: run it with plain python", file=sys.stderr)
        sys.exit(2)
    n = params(args.layers, args.dim, 50304, args.seq)
    rows = [run(mode, args) for mode in args.modes]
    print(f"GPT {args.layers} x {args.dim}, {n / 1e9:.2f} B parameters, FSDP2 on {args.gpus} x {args.profile}, "
          f"seq {args.seq}, batch {args.batch}, --timing --predict-only\n")
    print("| mode | host peak (all processes, Pss) GiB | largest process GiB | emulated GPUs' peak, summed GiB "
          "| per GPU GiB | predicted step ms | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "failed" in r:
            peak = f"{r['host_peak_bytes'] / GIB:.2f} when it ended" if r.get("host_peak_bytes") else ""
            print(f"| {r['mode']} | failed ({r['failed']}) {peak} | | | | | |")
            continue
        print(f"| {r['mode']} | {r['host_peak_bytes'] / GIB:.2f} | {r['largest_process_peak_bytes'] / GIB:.2f} | "
              f"{r['gpu_peak_bytes_total'] / GIB:.2f} | {r['gpu_peak_bytes_max'] / GIB:.2f} | "
              f"{r['predicted_step_ms']:.1f} | {r['wall_s']} |")
    print("JSON " + json.dumps({"params": n, "args": vars(args), "rows": rows}))
    sys.exit(1 if any("failed" in r for r in rows) else 0)


if __name__ == "__main__":
    main()
