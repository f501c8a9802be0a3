"""Benchmark: a torch.compile'd training step on mirage's emulated `cuda` device vs on `cpu`.

Not a test. Must run under mirage:

    mirage run --gpus-per-node 1 -- python bench/compile_step.py [--steps 20] [--compiles 2]

The workload: the memory table's GPT (bench/memory_workloads.py: token + position embeddings,
pre-norm blocks of causal SDPA attention and a GELU MLP) with 2 blocks, width 256, 4 heads,
vocabulary 512, sequence 128, batch 8, built once from a seed and copied to both devices. One step = forward + cross-entropy
+ backward + SGD step, the model under torch.compile (inductor's default mode).

Three figures, each a median of ratios measured in the same run, the sides interleaved so that
they share the machine's noise:

  compile  the first compiled step (dynamo + AOTAutograd + inductor, forward and backward, with
           inductor's caches off), emulated / cpu; --compiles rounds, torch._dynamo.reset()
           between them                                                     target <= 1.25
  step     a compiled step after warm-up, emulated / cpu (both run inductor's host kernels: 1.0
           is the limit)                                                    target <= 1.10
  payoff   the compiled step / the eager step on the emulated device, and the same on cpu
           (reported: compiling should pay off on the device as it does on the host)

Output: a table and one line starting with `JSON `. Exit code: 0 targets met, 3 a target missed,
2 not running under mirage.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from memory_workloads import GPT  # the memory table's GPT block (bench/memory_workloads.py)

TARGETS = {"compile": 1.25, "step": 1.10}


class Side:
    """One device's model, optimizer, batch and (compiled or eager) step."""

    def __init__(self, template: GPT, batch: tuple[torch.Tensor, torch.Tensor], device: str, compiled: bool):
        """`batch`: the tokens and the targets."""
        self.device = torch.device(device)
        self.model = copy.deepcopy(template).to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.batch = tuple(t.to(self.device) for t in batch)
        self.forward = torch.compile(self.model) if compiled else self.model

    def step(self) -> float:
        """One training step; its wall time (the device's work waited for)."""
        started = time.perf_counter()
        tokens, targets = self.batch
        loss = F.cross_entropy(self.forward(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started


def compile_ratios(template: GPT, batch: tuple, rounds: int) -> tuple[list[float], list[float]]:
    """First-step (compile) times emulated / cpu, alternating which side goes first, after an
    untimed round (the process's first compile also pays one-time costs: imports, the C++
    toolchain's first runs)."""
    ratios, seconds = [], []
    with torch._inductor.config.patch(force_disable_caches=True):
        for device in ("cpu", "cuda"):
            torch._dynamo.reset()
            Side(template, batch, device, compiled=True).step()
        for i in range(rounds):
            times = {}
            for device in (("cuda", "cpu") if i % 2 == 0 else ("cpu", "cuda")):
                torch._dynamo.reset()
                times[device] = Side(template, batch, device, compiled=True).step()
            ratios.append(times["cuda"] / times["cpu"])
            seconds += [times["cuda"], times["cpu"]]
    return ratios, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compiles", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("run this under mirage: mirage run --gpus-per-node 1 -- python bench/compile_step.py", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    template = GPT(vocab=512, width=256, depth=2, heads=4, seq=128, checkpointed=False)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (8, 129), generator=generator)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    compile_r, compile_s = compile_ratios(template, batch, args.compiles)
    torch._dynamo.reset()
    sides = {"emulated": Side(template, batch, "cuda", True), "cpu": Side(template, batch, "cpu", True),
             "eager": Side(template, batch, "cuda", False), "eager_cpu": Side(template, batch, "cpu", False)}
    for _ in range(args.warmup):
        for side in sides.values():
            side.step()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.steps):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(sides[name].step())
    step_r = [e / c for e, c in zip(times["emulated"], times["cpu"])]
    payoff_r = [c / e for c, e in zip(times["emulated"], times["eager"])]
    cpu_payoff_r = [c / e for c, e in zip(times["cpu"], times["eager_cpu"])]
    result = {
        "compile": {"median_ratio": statistics.median(compile_r), "ratios": compile_r,
                    "emulated_s": compile_s[0::2], "cpu_s": compile_s[1::2]},
        "step": {"median_ratio": statistics.median(step_r), "emulated_ms": 1e3 * statistics.median(times["emulated"]),
                 "cpu_ms": 1e3 * statistics.median(times["cpu"])},
        "payoff": {"median_ratio": statistics.median(payoff_r), "eager_ms": 1e3 * statistics.median(times["eager"]),
                   "cpu_median_ratio": statistics.median(cpu_payoff_r),
                   "eager_cpu_ms": 1e3 * statistics.median(times["eager_cpu"])},
        "torch": torch.__version__, "steps": args.steps, "compiles": args.compiles,
    }
    print(f"compile (first step)   emulated {statistics.median(result['compile']['emulated_s']):7.2f} s   "
          f"cpu {statistics.median(result['compile']['cpu_s']):7.2f} s   ratio {result['compile']['median_ratio']:.3f}"
          f"   (target <= {TARGETS['compile']})")
    print(f"compiled step          emulated {result['step']['emulated_ms']:7.2f} ms  "
          f"cpu {result['step']['cpu_ms']:7.2f} ms  ratio {result['step']['median_ratio']:.3f}"
          f"   (target <= {TARGETS['step']})")
    print(f"compiled / eager step  eager    {result['payoff']['eager_ms']:7.2f} ms  "
          f"ratio {result['payoff']['median_ratio']:.3f}   (on cpu: eager {result['payoff']['eager_cpu_ms']:.2f} ms, "
          f"ratio {result['payoff']['cpu_median_ratio']:.3f})")
    print("JSON " + json.dumps(result))
    met = all(result[k]["median_ratio"] <= target for k, target in TARGETS.items())
    return 0 if met else 3


if __name__ == "__main__":
    sys.exit(main())
