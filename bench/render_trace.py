"""Renders a clocked-mode trace (mirage run --timing --trace PATH) as a PNG: one row per GPU
stream of each rank, kernels coloured by what bounds them, collectives on the communicator's row,
so overlap is visible without a trace viewer. The README's picture is made with it:

    mirage run --timing --trace run.json --profile h100 --gpus-per-node 2 -- \\
        torchrun --standalone --nproc_per_node=2 tests/fixtures/ml/ddp_mlp.py
    python bench/render_trace.py run.json docs/trace.png

`--profiler` reads the per-rank traces torch.profiler exported instead (their GPU side: kernels
and memcpys on each device's streams, coloured by their names), as the README's profiler
picture was drawn:

    mirage run --timing --profile h100 --gpus-per-node 8 -- torchrun --standalone \\
        --nproc_per_node=8 tests/workloads/fsdp_profile.py traces/
    python bench/render_trace.py --profiler --last 1 traces/rank?.json docs/profiler-8gpus.png

Needs matplotlib (pip install matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys

COLOURS = {"compute": "#3b7dd8", "memory": "#8fb8ed", "copy": "#f0a030", "collective": "#d8443b"}
# What a GPU-side kernel of a torch.profiler trace is, by the library names mirage gives them
COMPUTE_KERNELS = ("gemm", "Cijk_", "flash", "fmha", "attn_fwd", "bwd_kernel", "sdpa", "triton_tem")


def profiler_slices(paths: list[str]) -> tuple[list[dict], dict]:
    """The GPU side of torch.profiler traces (one per rank) as this script's slices and row names."""
    slices, names = [], {}
    for index, path in enumerate(paths):
        trace = json.load(open(path))
        rank = trace.get("distributedInfo", {}).get("rank", index)
        for e in trace["traceEvents"]:
            if e.get("cat") not in ("kernel", "gpu_memcpy"):
                continue
            name = e["name"]
            kind = ("collective" if name.startswith("nccl") else "copy" if e["cat"] == "gpu_memcpy"
                    else "compute" if any(k in name for k in COMPUTE_KERNELS) else "memory")
            slices.append({"pid": rank, "tid": e["tid"], "ts": e["ts"], "dur": e["dur"], "cat": kind})
            names[(rank, e["tid"])] = f"stream {e['tid']}"
    return slices, names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="+", help="the trace (with --profiler: torch.profiler's, one per rank)")
    ap.add_argument("png")
    ap.add_argument("--profiler", action="store_true", help="read torch.profiler's exported traces (their GPU side)")
    ap.add_argument("--last", type=float, default=0.05, metavar="FRACTION",
                    help="show the last FRACTION of the run (default 0.05: a few steps of a long run)")
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("render_trace needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    if args.profiler:
        slices, names = profiler_slices(args.trace)
    else:
        events = json.load(open(args.trace[0]))["traceEvents"]
        names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
        slices = [e for e in events if e["ph"] == "X" and e.get("cat") in COLOURS]
    stop = max(e["ts"] + e["dur"] for e in slices)
    begin = min(e["ts"] for e in slices)
    start = stop - (stop - begin) * args.last
    rows = sorted({(e["pid"], e["tid"]) for e in slices})
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) + 1.4))
    for y, row in enumerate(rows):
        for e in slices:
            if (e["pid"], e["tid"]) == row and e["ts"] + e["dur"] >= start:
                ax.broken_barh([(e["ts"] - start, max(e["dur"], 0.05))], (y - 0.4, 0.8), color=COLOURS[e["cat"]])
    ax.set_yticks(range(len(rows)), [f"rank {p}: {names.get((p, t), t)}" for p, t in rows])
    ax.set_xlim(0, stop - start)
    ax.set_xlabel("predicted time (µs)")
    ax.invert_yaxis()
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", ncol=4, fontsize=8)
    ax.set_title("torch.profiler's GPU side under mirage clocked mode (predicted)" if args.profiler
                 else "mirage clocked mode: predicted timeline")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
