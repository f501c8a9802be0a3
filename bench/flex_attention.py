"""Benchmark: FlexAttention on an emulated GPU, compiled vs eager vs SDPA, sequence 1k-8k.

Not a test. Must run under mirage:

    mirage run --gpus-per-node 1 -- python bench/flex_attention.py [--lengths 1024 2048 4096 8192]
        [--heads 4] [--repeats 3]

One call = forward + backward of causal attention, batch 1, `--heads` heads of 64, float32:
torch.compile(flex_attention) with a causal BlockMask (128 x 128 blocks), eager flex_attention
with the same mask, and F.scaled_dot_product_attention(is_causal=True). Both flex paths run
mirage's block-sparse implementation (mirage/runtime/flex_attention.py); before it, eager flex
built the dense S x S scores and compiled flex could not train.

Per length and path: the median wall time of `--repeats` calls after one untimed call (the
compiled path compiles there), and the peak device memory a call adds to what was allocated before
it (torch.cuda.max_memory_allocated), next to the float32 B x H x S x S scores a dense
implementation holds. Timings are the host's, as everywhere in mirage. Output: a table, and the
figures in docs/benchmarks/ (bench/record.py). Exit code 2: not running under mirage.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from record import save  # bench/record.py: the figures beside the doc

MIB = 2**20


def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q >= kv


def measure(call: Callable[[], torch.Tensor], inputs: list[torch.Tensor], repeats: int) -> dict:
    """Median seconds of forward + backward over `repeats` calls after an untimed one, and the
    peak device memory one call adds."""
    def once() -> None:
        call().sum().backward()
        for t in inputs:
            t.grad = None
        torch.cuda.synchronize()

    once()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_mib": (torch.cuda.max_memory_allocated() - before) / MIB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("run it under mirage: mirage run --gpus-per-node 1 -- python bench/flex_attention.py", file=sys.stderr)
        return 2
    compiled = torch.compile(flex_attention, dynamic=False)
    rows = []
    print(f"{'S':>6} {'path':>9} {'seconds':>9} {'peak MiB':>9} {'dense scores MiB':>17}")
    for length in args.lengths:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, args.heads, length, 64, device="cuda", requires_grad=True) for _ in range(3))
        mask = create_block_mask(causal, None, None, length, length, device="cuda")
        dense_mib = args.heads * length * length * 4 / MIB
        paths = {"compiled": lambda: compiled(q, k, v, block_mask=mask),
                 "eager": lambda: flex_attention(q, k, v, block_mask=mask),
                 "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
        for path, call in paths.items():
            figures = measure(call, [q, k, v], args.repeats)
            rows.append({"length": length, "path": path, "heads": args.heads, "dense_scores_mib": dense_mib,
                         **figures})
            print(f"{length:>6} {path:>9} {figures['seconds']:>9.3f} {figures['peak_mib']:>9.1f} {dense_mib:>17.0f}",
                  flush=True)
    save(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
