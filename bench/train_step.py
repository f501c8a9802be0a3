"""Benchmark: one training step on mirage's emulated `cuda` device vs the same step on `cpu`.

Not a test. Must run under mirage:

    mirage run --gpus-per-node 1 -- python bench/train_step.py [--steps 20] [--warmup 3]

Two workloads, each built once from the same seed and copied to both devices, so both sides
do identical work on identical weights and data:

  mlp    4 x Linear(2048, 2048), ReLU between, batch 256            target cuda/cpu <= 1.10
  small  60 x [Linear(64, 64) + LayerNorm(64) + GELU], batch 32     target cuda/cpu <= 1.5

One step = zero_grad + forward + MSE loss + backward + AdamW(foreach=False).step().
Steps alternate between the devices (cuda, cpu, cpu, cuda, ... : which one goes first flips
each pair) so both share the machine's noise. After `--warmup` steps each, `--steps` steps
each are timed with time.perf_counter. Reported: the median step time per device, the median
of the per-pair ratios cuda/cpu (the headline figure, judged against the target), the ratio
of the medians, and the same median ratio in process CPU time, which other load on a
shared machine disturbs less than wall time.

Output: a table for people and one line starting with `JSON ` for machines.
Exit code: 0 all targets met, 3 a target missed, 2 not running under mirage (mirage itself
uses 1 for its own errors).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from torch import nn


WORKLOADS = {
    # name: (description, target ratio cuda/cpu)
    "mlp": ("4 x Linear(2048,2048)+ReLU, batch 256", 1.10),
    "small": ("60 x [Linear(64,64)+LayerNorm+GELU], batch 32", 1.5),
}


def build(name: str, seed: int = 0):
    """The model (on CPU), an input batch and a target batch, all from `seed`."""
    torch.manual_seed(seed)
    if name == "mlp":
        width, depth, batch = 2048, 4, 256
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(width, width))
            if i < depth - 1:
                layers.append(nn.ReLU())
        model = nn.Sequential(*layers)
    elif name == "small":
        width, depth, batch = 64, 60, 32
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
        model = nn.Sequential(*layers)
    else:
        raise ValueError(name)
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)
    return model, x, y


class Runner:
    """One copy of a workload on one device, stepping it."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str):
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(self.device)
        self.x = x.to(self.device)
        self.y = y.to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=False)
        self.is_cuda = self.device.type == "cuda"

    def step(self) -> tuple[float, float]:
        """One training step; returns (wall time, process CPU time) in seconds."""
        if self.is_cuda:
            torch.cuda.synchronize()  # a no-op under mirage (all work is synchronous); kept for honesty
        c0, t0 = time.process_time(), time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        if self.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, time.process_time() - c0


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    with torch.no_grad():
        return max((p.detach().cpu() - q.detach().cpu()).abs().max().item()
                   for p, q in zip(a.parameters(), b.parameters()))


def measure(name: str, steps: int, warmup: int) -> dict:
    model, x, y = build(name)
    gpu = Runner(model, x, y, "cuda")
    cpu = Runner(model, x, y, "cpu")
    del model
    for _ in range(warmup):
        gpu.step()
        cpu.step()
    s_gpu, s_cpu = [], []
    for i in range(steps):
        if i % 2 == 0:
            s_gpu.append(gpu.step())
            s_cpu.append(cpu.step())
        else:
            s_cpu.append(cpu.step())
            s_gpu.append(gpu.step())
    t_gpu, t_cpu = [s[0] for s in s_gpu], [s[0] for s in s_cpu]
    ratios = [g / c for g, c in zip(t_gpu, t_cpu)]
    # Process CPU time (all threads): less sensitive to other load on a shared machine.
    p_gpu, p_cpu = [s[1] for s in s_gpu], [s[1] for s in s_cpu]
    p_ratios = [g / c for g, c in zip(p_gpu, p_cpu) if c > 0]
    med_gpu, med_cpu = statistics.median(t_gpu), statistics.median(t_cpu)
    description, target = WORKLOADS[name]
    ratio = statistics.median(ratios)
    return {
        "workload": name,
        "description": description,
        "params": sum(p.numel() for p in gpu.model.parameters()),
        "steps": steps,
        "warmup": warmup,
        "cuda_median_ms": round(med_gpu * 1e3, 3),
        "cpu_median_ms": round(med_cpu * 1e3, 3),
        "cuda_min_ms": round(min(t_gpu) * 1e3, 3),
        "cpu_min_ms": round(min(t_cpu) * 1e3, 3),
        "ratio_median": round(ratio, 4),            # median of per-pair cuda/cpu ratios
        "ratio_of_medians": round(med_gpu / med_cpu, 4),
        "cuda_proc_cpu_median_ms": round(statistics.median(p_gpu) * 1e3, 3),
        "cpu_proc_cpu_median_ms": round(statistics.median(p_cpu) * 1e3, 3),
        "proc_cpu_ratio_median": round(statistics.median(p_ratios), 4) if p_ratios else None,
        "target": target,
        "ok": ratio <= target,
        # Same seed, same weights, same data, same kernels: the weights should still agree.
        "max_param_diff": max_param_diff(gpu.model, cpu.model),
    }


def git_commit() -> str | None:
    """The repository's commit (+ "-dirty" if mirage/ has uncommitted changes), if git can tell."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "mirage"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if dirty else "")) if head else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per device (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per device first (default 3)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), action="append",
                    help="run only this workload (repeatable; default: all)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")

    if not torch.cuda.is_available():
        print("bench/train_step.py must run under mirage (torch.cuda.is_available() is False):\n"
              "    mirage run --gpus-per-node 1 -- python bench/train_step.py", file=sys.stderr)
        return 2

    names = args.workload or list(WORKLOADS)
    results = [measure(n, args.steps, args.warmup) for n in names]
    info = {
        "bench": "train_step",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name(0),
        "commit": git_commit(),
        "results": results,
    }

    print(f"train_step: torch {info['torch']}, {info['threads']} threads, "
          f"cuda = {info['device_name']} (emulated), {args.steps} timed steps after {args.warmup} warm-up, "
          f"commit {info['commit']}, {info['date']}")
    header = (f"{'workload':<8} {'cuda ms':>9} {'cpu ms':>9} {'cuda/cpu':>9} {'(of medians)':>12} "
              f"{'(CPU time)':>10} {'target':>7}  {'':4} max|dW|")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['workload']:<8} {r['cuda_median_ms']:>9.2f} {r['cpu_median_ms']:>9.2f} "
              f"{r['ratio_median']:>9.3f} {r['ratio_of_medians']:>12.3f} {r['proc_cpu_ratio_median'] or float('nan'):>10.3f} "
              f"{r['target']:>7.2f}  "
              f"{'ok' if r['ok'] else 'MISS':<4} {r['max_param_diff']:.1e}")
    print("JSON " + json.dumps(info, sort_keys=False))
    return 0 if all(r["ok"] for r in results) else 3


if __name__ == "__main__":
    sys.exit(main())
