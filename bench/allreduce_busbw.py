"""all_reduce bus bandwidth: emulated NCCL on emulated-GPU tensors vs gloo on CPU tensors.

Bus bandwidth as nccl-tests defines it: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n.
Both are measured in the same job, interleaved per size, so machine noise hits both alike;
the figure that matters is the ratio emulated / gloo (target: >= 1.0 at every size).

    python bench/allreduce_busbw.py [--ranks 2 4 8] [--iters 5]

runs `mirage run --nproc-per-node R` for each R and prints a table (and a JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES_MB = (1, 4, 16, 64, 256)


def worker(iters: int) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    cpu_group = dist.new_group(backend="gloo")
    rows = []
    for mb in SIZES_MB:
        numel = mb * 2**20 // 4
        device_tensor = torch.ones(numel, device="cuda")
        cpu_tensor = torch.ones(numel)
        times = {"emulated": [], "gloo": []}
        for i in range(iters + 1):
            for name, tensor, group in (("emulated", device_tensor, None), ("gloo", cpu_tensor, cpu_group)):
                dist.barrier(group=cpu_group)
                start = time.perf_counter()
                dist.all_reduce(tensor, group=group)
                elapsed = time.perf_counter() - start
                if i:  # the first round is warm-up
                    times[name].append(elapsed)
        factor = 2 * (world - 1) / world
        busbw = {k: mb * 2**20 / statistics.median(v) * factor / 1e9 for k, v in times.items()}
        rows.append({"ranks": world, "size_mb": mb, "busbw_emulated_gbs": round(busbw["emulated"], 3),
                     "busbw_gloo_gbs": round(busbw["gloo"], 3),
                     "ratio": round(busbw["emulated"] / busbw["gloo"], 3)})
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        result = subprocess.run(
            [sys.executable, "-m", "mirage", "run", "--nproc-per-node", str(ranks), "--gpus-per-node", str(ranks),
             "--", sys.executable, __file__, "--iters", str(args.iters)],
            capture_output=True, text=True, env=dict(os.environ, MIRAGE_BENCH_WORKER="1"),
        )
        line = next((l for l in result.stdout.splitlines() if "RESULT " in l), None)
        if line is None:
            sys.exit(f"{ranks} ranks failed:\n{result.stderr[-3000:]}")
        rows.extend(json.loads(line.split("RESULT ", 1)[1]))
    print(f"{'ranks':>5} {'size':>7} {'emulated GB/s':>14} {'gloo GB/s':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['size_mb']:>5}MB {r['busbw_emulated_gbs']:>14.3f} {r['busbw_gloo_gbs']:>10.3f} {r['ratio']:>6.3f}")
    print(json.dumps({"allreduce_busbw": rows, "min_ratio": min(r["ratio"] for r in rows)}))


if __name__ == "__main__":
    if os.environ.get("MIRAGE_BENCH_WORKER") and "RANK" in os.environ:
        worker(int(sys.argv[sys.argv.index("--iters") + 1]))
    else:
        main()
