"""What the session daemon costs: start-up, and a training step with vs without it.

1. Time from launching to the first line of a trivial 8-rank workload (`import torch; print`):
   `mirage run --nproc-per-node 8` against `torchrun --standalone --nproc_per_node=8` of the
   same CPU-only script without mirage. Target: at most 1.25x.
2. One training step (bench/train_step.py's small-op model, the daemon's worst case: most
   allocations per second) under `mirage run` (daemon, shared memory table) against
   `mirage run --in-process`. Target: at most 1.02x.
Runs are interleaved (A, B, A, B, ...) so both sides share the machine's noise.

    python bench/session_overhead.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record import save  # bench/record.py: the figures beside the doc

REPO = Path(__file__).resolve().parent.parent
TRIVIAL = "import torch\nprint('first line', flush=True)\n"


def time_to_first_line(command: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if "first line" in line:
            elapsed = time.perf_counter() - start
            break
    else:
        raise SystemExit(f"no first line from {command}")
    proc.wait()
    return elapsed


def step_time(mode: list[str]) -> float:
    result = subprocess.run([sys.executable, "bench/train_step.py", "--workload", "small", "--threads", "default",
                             "--steps", "20", *(f"--mirage-arg={arg}" for arg in mode)],
                            cwd=REPO, capture_output=True, text=True)
    line = next(l for l in result.stdout.splitlines() if l.startswith("JSON "))
    figures = json.loads(line[len("JSON "):])
    return figures["results"][0]["sides"]["emulated"]["median_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(TRIVIAL)
    try:
        mirage_cmd = [sys.executable, "-m", "mirage", "run", "--quiet", "--nproc-per-node", "8", "--gpus-per-node", "8",
                      "--", sys.executable, script.name]
        torchrun_cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=8", script.name]
        starts = {"mirage": [], "torchrun": []}
        for _ in range(args.rounds):
            starts["mirage"].append(time_to_first_line(mirage_cmd))
            starts["torchrun"].append(time_to_first_line(torchrun_cmd))
    finally:
        Path(script.name).unlink()
    steps = {"daemon": [], "in_process": []}
    for _ in range(args.rounds):
        steps["daemon"].append(step_time(["--daemon"]))
        steps["in_process"].append(step_time(["--in-process"]))
    start_ratio = statistics.median(starts["mirage"]) / statistics.median(starts["torchrun"])
    step_ratio = statistics.median(steps["daemon"]) / statistics.median(steps["in_process"])
    print(f"start-up to first line, 8 ranks: mirage {statistics.median(starts['mirage']):.2f} s, "
          f"torchrun {statistics.median(starts['torchrun']):.2f} s -> {start_ratio:.3f}x (target <= 1.25)")
    print(f"small-op training step: daemon {statistics.median(steps['daemon']):.1f} ms, "
          f"in-process {statistics.median(steps['in_process']):.1f} ms -> {step_ratio:.3f}x (target <= 1.02)")
    figures = {"startup": starts, "startup_ratio": round(start_ratio, 3), "step_ms": steps,
               "step_ratio": round(step_ratio, 3)}
    print(json.dumps(figures))
    save(figures)


if __name__ == "__main__":
    main()
