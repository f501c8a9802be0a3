"""Benchmark: the DDP demo's step time at 2 ranks on emulated GPUs against the same script on CPU.

Not a test. Both sides are the demo script (tests/fixtures/ml/ddp_mlp.py) under torchrun with 2
ranks: on the emulated GPUs with nccl (mirage's emulated NCCL) and, without mirage, on the CPU
with gloo, which the script falls back to when no GPU is there. Run with the venv's python,
outside mirage:

    .venv/bin/python bench/ddp_step.py [--rounds 5] [--steps 200]

Rounds alternate the two jobs (which one goes first flips each round) so that both see the same
machine noise. Each job prints rank 0's median step time over its steps; reported are the median
over rounds per side and the median of the per-round ratios emulated/native.

Output: a table and one line starting with `JSON `. Exit code 0, or 1 if a job failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "tests/fixtures/ml/ddp_mlp.py"
STEP = re.compile(r"median step ([0-9.]+) ms")


def job(emulated: bool, steps: int) -> float:
    """One torchrun job of the demo; returns rank 0's median step time in ms."""
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2", SCRIPT]
    command = ([sys.executable, "-m", "mirage", "run", "--quiet", "--gpus-per-node", "2", "--", *torchrun]
               if emulated else torchrun)
    env = dict(os.environ, STEPS=str(steps))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    found = STEP.search(result.stdout)
    if result.returncode != 0 or not found or "ddp_mlp_ok" not in result.stdout:
        raise RuntimeError(f"{'emulated' if emulated else 'native'} job failed ({result.returncode}):\n"
                           f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="training steps per job (default 200)")
    args = ap.parse_args(argv)
    emulated, native, ratios = [], [], []
    try:
        for i in range(args.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            times = {side: job(side, args.steps) for side in order}
            emulated.append(times[True])
            native.append(times[False])
            ratios.append(times[True] / times[False])
    except RuntimeError as error:
        print(f"ddp_step: {error}", file=sys.stderr)
        return 1
    info = {"bench": "ddp_step", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "ranks": 2, "steps": args.steps, "rounds": args.rounds, "cores": os.cpu_count(),
            "emulated_nccl_ms": emulated, "native_gloo_ms": native,
            "emulated_median_ms": statistics.median(emulated), "native_median_ms": statistics.median(native),
            "ratio": round(statistics.median(ratios), 4)}
    print(f"ddp_step: {SCRIPT}, 2 ranks via torchrun, {args.steps} steps, {args.rounds} rounds")
    print(f"emulated GPUs, nccl: {info['emulated_median_ms']:.3f} ms/step   "
          f"CPU, gloo (no mirage): {info['native_median_ms']:.3f} ms/step   ratio {info['ratio']:.3f}")
    print("JSON " + json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
