"""Collective bus bandwidth: emulated NCCL on emulated-GPU tensors vs gloo on CPU tensors.

Bus bandwidth as nccl-tests defines it: algbw = bytes / time, and busbw = algbw x 2(n-1)/n for
all_reduce, x (n-1)/n for all_gather, reduce_scatter and all_to_all (bytes: the whole gathered /
scattered / exchanged tensor of one rank), x 1 for broadcast, reduce and send/recv (bytes: the
message; send/recv pairs rank 2k with 2k+1, both directions at once). Both sides are measured in
the same job, interleaved per size, so machine noise hits both alike; the figure that matters is
the ratio emulated / gloo. As in nccl-tests, a round's time is that of back-to-back operations
(at least 16 MB of them) divided by their number; the median over the rounds is reported.

The memory-bandwidth limit (all_reduce): every byte of a rank's S-byte tensor must at least be
read from memory once and its result written once, i.e. one memcpy of S per rank; with B the
memcpy rate (bytes copied per second) each rank reaches while all ranks copy at once, measured
in the same job on the same sizes, no all_reduce can beat algbw = B, i.e. busbw = 2B (n-1)/n.
`limit_fraction` is the measured busbw over that limit. It means most for sizes far beyond the
caches (64 MB and up), where B is the DRAM rate; for small sizes both sides run from cache.

    python bench/collectives_busbw.py [--collectives all_reduce ...] [--ranks 2 4 8] [--iters 5]
        [--env NCCL_SHM_DISABLE=1 ...] [--num-nodes M] [--mirage-flag=--lazy-device-memory ...]

runs `mirage run --nproc-per-node R` for each R and prints a table (and a JSON line). With
--num-nodes M, R ranks on each of M isolated emulated nodes: the bytes between nodes cross the
nodes' eth0 and the session's bridge (veth pairs), for the emulated NCCL and for gloo alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from record import save  # bench/record.py: the figures beside the doc

SIZES_MB = (1, 4, 16, 64, 256)
# A round times back-to-back operations of at least this many bytes in all, as nccl-tests times a
# loop of iterations: one small operation alone measures the ranks' skew leaving the barrier
# before it (on 2 cores, a scheduling quantum) more than the operation.
BACK_TO_BACK_BYTES = 16 * 2**20
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send_recv")


def bus_factor(collective: str, world: int) -> float:
    """nccl-tests' busbw / algbw for a collective on `world` ranks."""
    return {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0, "reduce": 1.0,
            "send_recv": 1.0}.get(collective, (world - 1) / world)


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
        received = torch.empty_like(whole)
        peer = rank ^ 1

        def send_recv():
            if peer < world:
                ops = [dist.P2POp(dist.isend, whole, peer, group=group),
                       dist.P2POp(dist.irecv, received, peer, group=group)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

        return {
            "all_reduce": lambda: dist.all_reduce(whole, group=group),
            "all_gather": lambda: dist.all_gather_into_tensor(whole[: part.numel() * world], part, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, whole[: part.numel() * world], group=group),
            "broadcast": lambda: dist.broadcast(whole, src=0, group=group),
            "reduce": lambda: dist.reduce(whole, dst=0, group=group),
            "all_to_all": lambda: dist.all_to_all_single(received[: part.numel() * world], whole[: part.numel() * world],
                                                         group=group),
            "send_recv": send_recv,
        }[collective]

    def memcpy_rate(numel: int) -> float:
        """Bytes per second one rank copies while every rank copies at once (see the docstring)."""
        src, dst = torch.ones(numel), torch.empty(numel)
        samples = []
        for i in range(iters + 1):
            dist.barrier(group=cpu_group)
            start = time.perf_counter()
            dst.copy_(src)
            if i:
                samples.append(time.perf_counter() - start)
        return numel * 4 / statistics.median(samples)

    rows = []
    for collective in collectives:
        for mb in SIZES_MB:
            numel = mb * 2**20 // 4
            sides = {"emulated": runner(collective, numel, "cuda", None), "gloo": runner(collective, numel, "cpu", cpu_group)}
            times = {name: [] for name in sides}
            repeats = max(1, BACK_TO_BACK_BYTES // (mb * 2**20))
            for i in range(iters + 1):
                for name, run in sides.items():
                    dist.barrier(group=cpu_group)
                    start = time.perf_counter()
                    for _ in range(repeats):
                        run()
                    if i:  # the first round is warm-up
                        times[name].append((time.perf_counter() - start) / repeats)
            busbw = {k: mb * 2**20 / statistics.median(v) * bus_factor(collective, world) / 1e9 for k, v in times.items()}
            row = {"collective": collective, "ranks": world, "size_mb": mb,
                   "busbw_emulated_gbs": round(busbw["emulated"], 3), "busbw_gloo_gbs": round(busbw["gloo"], 3),
                   "ratio": round(busbw["emulated"] / busbw["gloo"], 3)}
            if collective == "all_reduce":
                limit = memcpy_rate(numel) * 2 * (world - 1) / world / 1e9
                row["limit_busbw_gbs"] = round(limit, 3)
                row["limit_fraction"] = round(busbw["emulated"] / limit, 3)
            rows.append(row)
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=["all_reduce"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the job (e.g. NCCL_SHM_DISABLE=1)")
    parser.add_argument("--num-nodes", type=int, default=1, help="isolated emulated nodes, R ranks each")
    parser.add_argument("--mirage-flag", action="append", default=[],
                        help="a `mirage run` flag for the job (e.g. --mirage-flag=--lazy-device-memory)")
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        result = subprocess.run(
            [sys.executable, "-m", "mirage", "run", *(["--isolate-nodes"] if args.num_nodes > 1 else []),
             "--num-nodes", str(args.num_nodes), "--nproc-per-node", str(ranks),
             "--gpus-per-node", str(ranks), *args.mirage_flag,
             *[f"--env={pair}" for pair in args.env], "--", sys.executable, __file__, "--iters", str(args.iters), "--collectives", *args.collectives],
            capture_output=True, text=True, env=dict(os.environ, MIRAGE_BENCH_WORKER="1"),
        )
        line = next((l for l in result.stdout.splitlines() if "RESULT " in l), None)
        if line is None:
            sys.exit(f"{ranks} ranks failed:\n{result.stderr[-3000:]}")
        rows.extend(json.loads(line.split("RESULT ", 1)[1]))
    print(f"{'collective':>14} {'ranks':>5} {'size':>7} {'emulated GB/s':>14} {'gloo GB/s':>10} {'ratio':>6} "
          f"{'of limit':>8}")
    for r in rows:
        print(f"{r['collective']:>14} {r['ranks']:>5} {r['size_mb']:>5}MB {r['busbw_emulated_gbs']:>14.3f} "
              f"{r['busbw_gloo_gbs']:>10.3f} {r['ratio']:>6.3f} {r.get('limit_fraction', ''):>8}")
    figures = {"busbw": rows, "min_ratio": min(r["ratio"] for r in rows)}
    print(json.dumps(figures))
    save(figures)


if __name__ == "__main__":
    if os.environ.get("MIRAGE_BENCH_WORKER") and "RANK" in os.environ:
        worker_args = argparse.ArgumentParser()
        worker_args.add_argument("--iters", type=int)
        worker_args.add_argument("--collectives", nargs="+")
        parsed = worker_args.parse_args()
        worker(parsed.collectives, parsed.iters)
    else:
        main()
