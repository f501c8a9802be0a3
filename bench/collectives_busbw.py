"""Collective bus bandwidth: emulated NCCL on emulated-GPU tensors vs gloo on CPU tensors.

Bus bandwidth as nccl-tests defines it: algbw = bytes / time, and busbw = algbw x 2(n-1)/n for
all_reduce, x (n-1)/n for all_gather and reduce_scatter (bytes: the whole gathered / scattered
tensor), x 1 for broadcast. Both sides are measured in the same job, interleaved per size, so
machine noise hits both alike; the figure that matters is the ratio emulated / gloo (target for
all_reduce: >= 1.0 at every size).

    python bench/collectives_busbw.py [--collectives all_reduce ...] [--ranks 2 4 8] [--iters 5]

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
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def bus_factor(collective: str, world: int) -> float:
    """nccl-tests' busbw / algbw for a collective on `world` ranks."""
    return {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0}.get(collective, (world - 1) / world)


def worker(collectives: list[str], iters: int) -> None:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    cpu_group = dist.new_group(backend="gloo")

    def runner(collective: str, numel: int, device: str, group):
        """A closure doing one `collective` over `numel` elements in all (the nccl-tests size)."""
        whole = torch.ones(numel, device=device)
        part = torch.ones(numel // world, device=device)
        return {
            "all_reduce": lambda: dist.all_reduce(whole, group=group),
            "all_gather": lambda: dist.all_gather_into_tensor(whole[: part.numel() * world], part, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole[: part.numel() * world], group=group),
            "broadcast": lambda: dist.broadcast(whole, src=0, group=group),
        }[collective]

    rows = []
    for collective in collectives:
        for mb in SIZES_MB:
            numel = mb * 2**20 // 4
            sides = {"emulated": runner(collective, numel, "cuda", None), "gloo": runner(collective, numel, "cpu", cpu_group)}
            times = {name: [] for name in sides}
            for i in range(iters + 1):
                for name, run in sides.items():
                    dist.barrier(group=cpu_group)
                    start = time.perf_counter()
                    run()
                    if i:  # the first round is warm-up
                        times[name].append(time.perf_counter() - start)
            busbw = {k: mb * 2**20 / statistics.median(v) * bus_factor(collective, world) / 1e9 for k, v in times.items()}
            rows.append({"collective": collective, "ranks": world, "size_mb": mb,
                         "busbw_emulated_gbs": round(busbw["emulated"], 3), "busbw_gloo_gbs": round(busbw["gloo"], 3),
                         "ratio": round(busbw["emulated"] / busbw["gloo"], 3)})
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=["all_reduce"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        result = subprocess.run(
            [sys.executable, "-m", "mirage", "run", "--nproc-per-node", str(ranks), "--gpus-per-node", str(ranks),
             "--", sys.executable, __file__, "--iters", str(args.iters), "--collectives", *args.collectives],
            capture_output=True, text=True, env=dict(os.environ, MIRAGE_BENCH_WORKER="1"),
        )
        line = next((l for l in result.stdout.splitlines() if "RESULT " in l), None)
        if line is None:
            sys.exit(f"{ranks} ranks failed:\n{result.stderr[-3000:]}")
        rows.extend(json.loads(line.split("RESULT ", 1)[1]))
    print(f"{'collective':>14} {'ranks':>5} {'size':>7} {'emulated GB/s':>14} {'gloo GB/s':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['collective']:>14} {r['ranks']:>5} {r['size_mb']:>5}MB {r['busbw_emulated_gbs']:>14.3f} "
              f"{r['busbw_gloo_gbs']:>10.3f} {r['ratio']:>6.3f}")
    print(json.dumps({"busbw": rows, "min_ratio": min(r["ratio"] for r in rows)}))


if __name__ == "__main__":
    if os.environ.get("MIRAGE_BENCH_WORKER") and "RANK" in os.environ:
        worker_args = argparse.ArgumentParser()
        worker_args.add_argument("--iters", type=int)
        worker_args.add_argument("--collectives", nargs="+")
        parsed = worker_args.parse_args()
        worker(parsed.collectives, parsed.iters)
    else:
        main()
