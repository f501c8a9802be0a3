"""Scale figures: the DDP demo's wall time with 8 ranks, and dist_smoke on 32 emulated GPUs
(4 nodes x 8) with each rank's peak memory (RSS).

    python bench/scale.py

Prints a table and a JSON line; the figures go into docs/benchmarks.md.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Runs dist_smoke unchanged and reports this rank's peak RSS when the interpreter exits.
PEAK_REPORTING_SMOKE = (
    "import atexit, resource, runpy, sys\n"
    "atexit.register(lambda: print('PEAK_RSS_MB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, flush=True))\n"
    "sys.argv = ['dist_smoke.py']\n"
    "runpy.run_path('tests/fixtures/ml/dist_smoke.py', run_name='__main__')\n"
)


def mirage(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "mirage", "run", *args], cwd=REPO, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"mirage run {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return elapsed, result


def main() -> None:
    ddp_seconds, _ = mirage("--gpus-per-node", "8", "--", "torchrun", "--standalone", "--nproc_per_node=8",
                            "tests/fixtures/ml/ddp_mlp.py")
    smoke_seconds, smoke = mirage("--num-nodes", "4", "--nproc-per-node", "8", "--gpus-per-node", "8", "--",
                                  "python", "-c", PEAK_REPORTING_SMOKE)
    peaks = [float(line.split()[-1]) for line in smoke.stdout.splitlines() if "PEAK_RSS_MB" in line]
    assert "dist_smoke_ok" in smoke.stdout and len(peaks) == 32, smoke.stdout[-2000:]
    figures = {
        "ddp_demo_8_ranks_wall_s": round(ddp_seconds, 1),
        "dist_smoke_32_gpus_wall_s": round(smoke_seconds, 1),
        "peak_rss_per_rank_mb": {"min": round(min(peaks)), "median": round(statistics.median(peaks)),
                                 "max": round(max(peaks)), "sum": round(sum(peaks))},
    }
    print(f"DDP demo, 8 ranks via torchrun:   {ddp_seconds:.1f} s wall")
    print(f"dist_smoke, 4 nodes x 8 GPUs:     {smoke_seconds:.1f} s wall")
    print(f"peak RSS per rank (MB):           min {min(peaks):.0f}, median {statistics.median(peaks):.0f}, "
          f"max {max(peaks):.0f} (all 32: {sum(peaks) / 1024:.1f} GiB)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
