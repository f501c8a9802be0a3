"""What one small op costs on the emulated device beyond the same op on native CPU torch.

    .venv/bin/python bench/op_overhead.py [--processes 3]

Not a test. A training step of small layers is a few thousand ops of 1-7 us each, so what the
emulated device adds per op (dispatch to the CUDA key, aliasing the arguments as CPU tensors,
the allocator model, re-labelling the result) decides the step's ratio (bench/train_step.py's
`small` and `blocks`). Each op here is one a small step runs, on a 32 x 64 or 64 x 64 float32
tensor: per process, 7 rounds of 10,000 calls after 500 warm-up calls, the best round kept; per
side (`python` on `cpu`, `mirage run` on `cuda`), the best of `--processes` processes, one at a
time, at 1 thread. The figure is emulated minus native microseconds an op.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from record import save  # bench/record.py: the figures beside the doc

REPO = Path(__file__).resolve().parent.parent
ROUNDS, CALLS, WARMUP = 7, 10_000, 500


def worker(device: str) -> None:
    """Times every op on `device` and prints `name=microseconds` pairs on one line."""
    import torch

    torch.manual_seed(0)
    x = torch.randn(32, 64, device=device)
    w, b = torch.randn(64, 64, device=device), torch.randn(64, device=device)
    p, g = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
    m, d = torch.zeros(64, 64, device=device), torch.ones(64, 64, device=device)
    functional = torch.nn.functional
    ops = {
        "x + x": lambda: x + x,
        "F.linear": lambda: functional.linear(x, w, b),
        "F.layer_norm": lambda: functional.layer_norm(x, (64,), b, b),
        "F.gelu": lambda: functional.gelu(x),
        "p.mul_(0.999)": lambda: p.mul_(0.999),
        "m.lerp_(g, 0.1)": lambda: m.lerp_(g, 0.1),
        "d.sqrt()": lambda: d.sqrt(),
        "d.div(1.5)": lambda: d.div(1.5),
        "p.addcdiv_(m, d)": lambda: p.addcdiv_(m, d, value=-1e-4),
    }
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(ROUNDS):
        for name, op in ops.items():
            for _ in range(WARMUP):
                op()
            start = time.perf_counter()
            for _ in range(CALLS):
                op()
            best[name] = min(best[name], (time.perf_counter() - start) / CALLS * 1e6)
    print("OPS " + "\t".join(f"{name}={us}" for name, us in best.items()), flush=True)


def timed(side: str) -> dict[str, float]:
    """One process's best microseconds per op."""
    me = [sys.executable, str(Path(__file__).resolve()), "--worker", "cuda" if side == "emulated" else "cpu"]
    command = [sys.executable, "-m", "mirage", "run", "--quiet", "--", *me] if side == "emulated" else me
    out = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("OPS "))
    return {name: float(us) for name, us in (pair.rsplit("=", 1) for pair in line[4:].split("\t"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--worker", choices=["cpu", "cuda"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    if os.environ.get("MIRAGE_SESSION"):
        sys.exit("bench/op_overhead.py starts mirage itself: run it with plain python, outside `mirage run`")
    best: dict[str, dict[str, float]] = {"native": {}, "emulated": {}}
    for side in best:
        for _ in range(args.processes):
            for name, us in timed(side).items():
                best[side][name] = min(best[side].get(name, float("inf")), us)
    rows = {name: {"native_us": round(best["native"][name], 3), "emulated_us": round(best["emulated"][name], 3),
                   "extra_us": round(best["emulated"][name] - best["native"][name], 3)} for name in best["native"]}
    mean = sum(row["extra_us"] for row in rows.values()) / len(rows)
    save({"threads": 1, "processes": args.processes, "ops": rows, "mean_extra_us": round(mean, 3)})
    print(f"{'op':<18} {'native us':>9} {'emulated us':>11} {'extra us':>8}")
    for name, row in rows.items():
        print(f"{name:<18} {row['native_us']:>9.2f} {row['emulated_us']:>11.2f} {row['extra_us']:>+8.2f}")
    print(f"{'mean':<18} {'':>9} {'':>11} {mean:>+8.2f}")


if __name__ == "__main__":
    main()
