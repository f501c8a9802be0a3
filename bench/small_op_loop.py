"""A small-op training loop timed as a user times it: a whole loop in a process of its own.

    .venv/bin/python bench/small_op_loop.py [--rounds 3] [--steps 50] [--threads default 1]

Issue 33 measured 1.29-1.42x for this kind of step (60 x [Linear(64, 64) + LayerNorm + GELU],
batch 32, AdamW foreach=False) where bench/train_step.py's `small` workload reports about 1.16x.
The workload is the same; the timing is not: train_step.py hands each process one step at a time,
round-robin with a pause between steps, while a user runs the loop (`python train.py` on `cpu`
against `mirage run -- python train.py` on `cuda`) and divides the wall times. This does the
latter: per round and thread setting, one native process and one emulated one, each timing 5
warm-up steps and then `--steps` steps back to back (synchronizing at the end), one after the
other; the figure is the median over rounds of emulated / native. Not a test: no target is
asserted here (issue 33's is 1.15x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from record import save  # bench/record.py: the figures beside the doc

REPO = Path(__file__).resolve().parent.parent


def loop(device: str, steps: int) -> None:
    """The worker: builds the model on `device`, runs the loop, prints its milliseconds a step."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(60):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    model = nn.Sequential(*layers).to(device)
    x, y = torch.randn(32, 64).to(device), torch.randn(32, 64).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    def finish() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(5):
        step()
    finish()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    finish()
    print(f"STEP_MS {(time.perf_counter() - start) / steps * 1e3}", flush=True)


def timed(side: str, threads: str, steps: int) -> float:
    """One process's milliseconds a step: native CPU torch, or `mirage run` on the emulated GPU."""
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", "cuda" if side == "emulated" else "cpu",
              "--steps", str(steps)]
    command = [sys.executable, "-m", "mirage", "run", "--quiet", "--", *worker] if side == "emulated" else worker
    env = dict(os.environ)
    if threads == "1":
        env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout
    return float(next(line for line in out.splitlines() if "STEP_MS" in line).split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", choices=["default", "1"], nargs="+", default=["default", "1"])
    ap.add_argument("--worker", choices=["cpu", "cuda"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return loop(args.worker, args.steps)
    if os.environ.get("MIRAGE_SESSION"):
        sys.exit("bench/small_op_loop.py starts mirage itself: run it with plain python")
    figures = {}
    for threads in args.threads:
        rounds = []
        for _ in range(args.rounds):
            native, emulated = timed("native", threads, args.steps), timed("emulated", threads, args.steps)
            rounds.append({"native_ms": round(native, 3), "emulated_ms": round(emulated, 3),
                           "ratio": round(emulated / native, 3)})
        figures[threads] = {"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds)}
        print(f"threads {threads}: " + ", ".join(f"{r['native_ms']:.2f} / {r['emulated_ms']:.2f} ms = {r['ratio']}x"
                                                 for r in rounds) + f"; median {figures[threads]['median_ratio']}x",
              flush=True)
    save(figures)


if __name__ == "__main__":
    main()
