"""torchtitan's published Llama 3.1 runs, predicted on emulated H100s by unmodified torchtitan.

    python bench/torchtitan_published.py [--cases NAME ...] [--steps N] [--profiler-traces DIR]

torchtitan's benchmark page (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md)
gives throughput (TPS/GPU) and peak memory for Llama 3.1 8B, 70B and 405B on Meta's Grand Teton
hosts: 8 H100s each, 96 GB HBM2e at 2.4 TB/s, a 500 W limit (the `h100-96gb` profile); its
docs/performance.md (mid-2024) gives Llama 3 8B on 64 A100 80GB (8 nodes, eager FSDP2). Each case
here is one row of its tables, run as torchtitan runs it (`torchrun -m torchtitan.train`, the
model's flavor and the row's parallelism, batch, sequence length and activation checkpointing,
as torchtitan's own command-line flags; torchtitan's defaults for the rest; the RMSNorm the run's
config named, and its grouped-query attention of 2024, bench/torchtitan2024.py) under
`mirage run --timing --predict-only --virtual-clock --lazy-device-memory`, with only the data
and tokenizer pointed at local files (tests/torchtitan_setup.py makes them).

For each case: the wall time of the whole run on this machine, its peak host memory (the
largest sum, over the run's process tree, of each process's Pss, sampled every 0.5 s), the
predicted step time (mirage's summary: the median step of the slowest rank), the TPS/GPU it
gives (local batch x sequence length / step time), the memory torchtitan's own metrics line
prints (its peak reserved, the published column), and their errors against the published row.
Nothing is fitted to these rows. Cases of 128 GPUs and more run with `--stand-ins` (one node's
ranks standing for the data-parallel replicas; docs/stand-in-replicas.md), and
8b-fsdp-64-a100-op-stand-ins checks that against the full 64-rank run of 8b-fsdp-64-a100-op
(70b-fsdp32-tp8-256-in-node checks --stand-ins-in-node against 70b-fsdp32-tp8-256). The Llama 2
rows of docs/performance.md run torchtitan's trainer with Llama 2's shapes as llama3 flavors
(bench/torchtitan_llama2.py).
Prints a table; the figures go to docs/benchmarks/ (record.py). `--profiler-traces DIR` also
turns on torchtitan's own profiling flags for the last step and keeps the per-rank traces of
each case in DIR/NAME/ (torch.profiler's, with their predicted GPU side), and the case's clocked
split of its median step (collective and exposed ms) beside its figures, for a trace tool (HTA)
to be checked against.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from record import save  # bench/record.py: the figures beside the doc
from scale import mirage  # bench/scale.py: one run's wall time and peak tree memory

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import torchtitan_setup  # noqa: E402 - tests/torchtitan_setup.py: torchtitan, triton, tokenizer, dataset


TORCHTITAN_2024 = str(Path(__file__).resolve().parent / "torchtitan2024.py")  # bench/torchtitan2024.py


@dataclass(frozen=True)
class Case:
    """One published row: where it is, the job, and its figures."""

    row: str
    nodes: int
    flavor: str
    local_batch: int
    seq_len: int
    activation_checkpoint: list[str]
    published_tps: int
    published_gib: float
    parallelism: list[str] = field(default_factory=list)
    profile: str = "h100-96gb"
    stand_ins: int = 1  # mirage run --stand-ins: 1/stand_ins of the nodes run (docs/stand-in-replicas.md)
    stand_ins_stride: int = 0  # --stand-ins-stride (0: data parallelism outermost)
    stand_ins_in_node: int = 1  # --stand-ins-in-node: 1 of every this many ranks of a running node runs
    like_for_like: bool = True  # False: the published run used what this one does not (named in `row`)
    compiled: bool = False  # torch.compile of each TransformerBlock, as torchtitan of 2024-12 compiled (not the loss)
    entry: tuple[str, ...] = ("-m", "torchtitan.train")  # how the trainer starts (after its norm and attention are set)
    # the published run's model.norm_type (bench/torchtitan2024.py): torchtitan's eager RMSNorm
    # module, or its fused Triton kernel, which torch 2.13's fused F.rms_norm stands for
    norm: str = "rmsnorm"

    def model_parallel(self) -> int:
        """The GPUs one model replica spans (torchtitan's non-data-parallel size): the product of
        the parallelism degrees the case sets."""
        degrees = [int(value) for flag, value in zip(self.parallelism, self.parallelism[1:])
                   if flag.endswith(("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"))]
        return math.prod(degrees)


LLAMA2 = (str(Path(__file__).resolve().parent / "torchtitan_llama2.py"),)  # Llama 2 flavors, then torchtitan.train
SELECTIVE_OP = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
CASES = {
    "8b-fsdp-8": Case("Table 1 (8B, 8 GPUs): FSDP", 1, "8B", 2, 8192, SELECTIVE_OP, 5762, 82.4),
    "8b-fsdp-16": Case("Table 1's job on 2 nodes (no published row: host-memory scaling)", 2, "8B", 2, 8192,
                       SELECTIVE_OP, 0, 0.0),
    "8b-fsdp-128": Case("Table 3 (8B, 128 GPUs): FSDP", 16, "8B", 2, 8192, SELECTIVE_OP, 5605, 67.0, stand_ins=16),
    "8b-fsdp-8-compile": Case("Table 1 (8B, 8 GPUs): FSDP + torch.compile", 1, "8B", 2, 8192, SELECTIVE_OP, 6667, 77.0,
                              compiled=True),
    "8b-fsdp-128-compile": Case("Table 3 (8B, 128 GPUs): FSDP + torch.compile", 16, "8B", 2, 8192, SELECTIVE_OP, 6514,
                                62.0, stand_ins=16, compiled=True),
    "70b-fsdp32-tp8-256": Case("Table 4 (70B, 256 GPUs): FSDP 32 x TP 8, full AC; published with torch.compile and "
                               "Float8, run here without both", 32, "70B", 16, 8192,
                               ["--activation_checkpoint.mode", "full"], 829, 71.9,
                               ["--parallelism.tensor_parallel_degree", "8"], stand_ins=32, like_for_like=False),
    # torchtitan's docs/performance.md (mid-2024): 64 A100 80GB, FSDP2, eager, Llama 3 8B (no memory column)
    "8b-fsdp-64-a100-op": Case("performance.md (8B, 64 A100): selective op", 8, "8B", 1, 8192, SELECTIVE_OP, 2973, 0.0,
                               profile="a100", norm="fused_rmsnorm"),
    "405b-fsdp8-tp8-pp8-512": Case("Table 5 (405B, 512 GPUs): FSDP 8 x TP 8 x PP 8, 1F1B, full AC; published with "
                                   "torch.compile, Float8 and AsyncTP, run here without them", 64, "405B", 32, 8192,
                                   ["--activation_checkpoint.mode", "full"], 100, 82.5,
                                   ["--parallelism.tensor_parallel_degree", "8", "--parallelism.pipeline_parallel_degree",
                                    "8", "--parallelism.pipeline_parallel_schedule", "1F1B"],
                                   stand_ins=8, stand_ins_stride=8, stand_ins_in_node=8, like_for_like=False),
    "405b-fsdp8-tp8-pp8-512-interleaved": Case("Table 5 (405B, 512 GPUs): FSDP 8 x TP 8 x PP 8, interleaved 1F1B, "
                                               "full AC; published with torch.compile, Float8 and AsyncTP, run here "
                                               "without them", 64, "405B", 32, 8192,
                                               ["--activation_checkpoint.mode", "full"], 128, 72.7,
                                               ["--parallelism.tensor_parallel_degree", "8",
                                                "--parallelism.pipeline_parallel_degree", "8",
                                                "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
                                               stand_ins=8, stand_ins_stride=8, stand_ins_in_node=8,
                                               like_for_like=False),
    "70b-fsdp32-tp8-256-in-node": Case("Table 4's job as 70b-fsdp32-tp8-256, each running rank standing for its TP "
                                       "group too (--stand-ins-in-node 8): the check of that flag at scale", 32, "70B",
                                       16, 8192, ["--activation_checkpoint.mode", "full"], 829, 71.9,
                                       ["--parallelism.tensor_parallel_degree", "8"], stand_ins=32,
                                       stand_ins_in_node=8, like_for_like=False),
    "8b-fsdp-64-a100-layer": Case("performance.md (8B, 64 A100): selective layer (every 2nd block), 1 node standing "
                                  "for 8", 8, "8B", 1, 8192, ["--activation_checkpoint.mode", "selective",
                                  "--activation_checkpoint.selective_ac_option", "2"], 2904, 0.0, profile="a100",
                                  stand_ins=8, norm="fused_rmsnorm"),
    "8b-fsdp-64-a100-op-stand-ins": Case("performance.md (8B, 64 A100): selective op, 1 node standing for 8", 8, "8B",
                                         1, 8192, SELECTIVE_OP, 2973, 0.0, profile="a100", stand_ins=8, norm="fused_rmsnorm"),
    # the same page's Llama 2 table: torchtitan's llama2 model of then, as llama3 flavors (bench/torchtitan_llama2.py)
    "llama2-13b-fsdp-64-a100-none": Case("performance.md (Llama 2 13B, 64 A100): no AC", 8, "llama2_13B", 2, 4096,
                                         ["--activation_checkpoint.mode", "none"], 2162, 0.0, profile="a100",
                                         stand_ins=8, entry=LLAMA2, norm="fused_rmsnorm"),
    "llama2-13b-fsdp-64-a100-layer": Case("performance.md (Llama 2 13B, 64 A100): selective layer", 8, "llama2_13B", 2,
                                          4096, ["--activation_checkpoint.mode", "selective",
                                                 "--activation_checkpoint.selective_ac_option", "2"], 1914, 0.0,
                                          profile="a100", stand_ins=8, entry=LLAMA2, norm="fused_rmsnorm"),
    "llama2-13b-fsdp-64-a100-op": Case("performance.md (Llama 2 13B, 64 A100): selective op", 8, "llama2_13B", 2, 4096,
                                       SELECTIVE_OP, 1904, 0.0, profile="a100", stand_ins=8, entry=LLAMA2, norm="fused_rmsnorm"),
    "llama2-70b-fsdp-64-a100-op": Case("performance.md (Llama 2 70B, 64 A100): selective op, local batch 1", 8,
                                       "llama2_70B", 1, 4096, SELECTIVE_OP, 355, 0.0, profile="a100", stand_ins=8,
                                       entry=LLAMA2),
    "llama2-70b-fsdp-64-a100-full": Case("performance.md (Llama 2 70B, 64 A100): full AC, local batch 2", 8,
                                         "llama2_70B", 2, 4096, ["--activation_checkpoint.mode", "full"], 353, 0.0,
                                         profile="a100", stand_ins=8, entry=LLAMA2),
    "70b-fsdp-64-a100-full": Case("performance.md (70B, 64 A100): full AC", 8, "70B", 1, 8192,
                                  ["--activation_checkpoint.mode", "full"], 331, 0.0, profile="a100"),
}
GPUS_PER_NODE = 8


def torchrun(case: Case, assets: Path, dump: Path, steps: int, traces: Path | None = None) -> list[str]:
    # torchtitan's profiling flags: the last step recorded, one trace per rank under `traces`
    profiling = [] if traces is None else [
        "--profiling.enable_profiling", "--profiling.save_traces_folder", str(traces),
        "--profiling.profile_freq", str(steps), "--profiling.profiler_warmup", "1"]
    titan = [TORCHTITAN_2024, "--norm", case.norm, *case.entry, "--model.name", "llama3", "--model.flavor", case.flavor,
             *torchtitan_setup.data_flags(assets), "--training.local_batch_size", str(case.local_batch),
             "--training.seq_len", str(case.seq_len), "--training.steps", str(steps),
             "--parallelism.data_parallel_shard_degree", "-1", *case.parallelism, *case.activation_checkpoint,
             *(["--compile.enable", "--compile.components", "model"] if case.compiled else []),
             "--metrics.log_freq", "1", "--metrics.disable_color_printing", "--job.dump_folder", str(dump),
             *profiling]
    if case.nodes == 1:
        return ["torchrun", "--standalone", f"--nproc_per_node={GPUS_PER_NODE}", *titan]
    line = " ".join(["torchrun", "--nnodes=$MIRAGE_NUM_NODES", "--node-rank=$MIRAGE_NODE_RANK",
                     f"--nproc-per-node={GPUS_PER_NODE}", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT", *titan])
    return ["sh", "-c", line]


def run_case(name: str, case: Case, assets: Path, paths: str, steps: int, work: Path,
             traces: Path | None = None) -> dict:
    summary = work / f"{name}.json"
    stand_ins = ["--stand-ins", str(case.stand_ins)] if case.stand_ins > 1 else []
    if case.stand_ins_stride:
        stand_ins += ["--stand-ins-stride", str(case.stand_ins_stride)]
    if case.stand_ins_in_node > 1:
        stand_ins += ["--stand-ins-in-node", str(case.stand_ins_in_node)]
    result = mirage(["--timing", "--predict-only", "--virtual-clock", "--lazy-device-memory", "--profile", case.profile,
                     "--num-nodes", str(case.nodes), "--gpus-per-node", str(GPUS_PER_NODE), *stand_ins,
                     "--summary-json", str(summary), "--env", f"PYTHONPATH={paths}", "--",
                     *torchrun(case, assets, work / name, steps, traces / name if traces else None)])
    figures = {"row": case.row, "profile": case.profile, "gpus": case.nodes * GPUS_PER_NODE, "stand_ins": case.stand_ins,
               "stand_ins_in_node": case.stand_ins_in_node,
               "like_for_like": case.like_for_like, "wall_s": round(result["wall_s"], 1),
               "host_peak_gib": round(result["peak_gib"], 2), "exit": result["code"]}
    if result["code"] != 0:
        figures["error"] = (result["stdout"] + result["stderr"])[-1500:]
        return figures
    timing = json.loads(summary.read_text())["timing"]
    step_ms = timing["job"]["step_ms"]
    memories = [float(gib) for gib in re.findall(r"memory:\s+([0-9.]+)GiB", result["stdout"] + result["stderr"])]
    # torchtitan's TPS/GPU: a data-parallel rank's tokens over the step, shared by the GPUs of its model replica
    if traces:  # each rank's median step, as the clocked report splits it
        figures["split_ms"] = {rank["rank"]: {key: round(rank["split_ms"][key], 3) for key in ("collective", "exposed")}
                               for rank in timing["ranks"]}
    figures.update(step_ms=round(step_ms, 1),
                   tps_per_gpu=round(case.local_batch * case.seq_len / (step_ms / 1e3) / case.model_parallel()),
                   memory_gib=max(memories) if memories else None)
    if case.published_tps:
        figures.update(published_tps=case.published_tps, published_gib=case.published_gib or None,
                       tps_error_pct=round(100 * (figures["tps_per_gpu"] / case.published_tps - 1), 1))
        if memories and case.published_gib:
            figures["memory_error_pct"] = round(100 * (figures["memory_gib"] / case.published_gib - 1), 1)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["8b-fsdp-8"])
    parser.add_argument("--steps", type=int, default=4, help="training steps a run takes (the median is reported)")
    parser.add_argument("--profiler-traces", type=Path, metavar="DIR",
                        help="keep each case's per-rank torch.profiler traces of its last step in DIR/NAME/")
    args = parser.parse_args()
    paths = f"{torchtitan_setup.install_torchtitan()}:{torchtitan_setup.install_triton()}"
    results = {}
    with tempfile.TemporaryDirectory(prefix="mirage-titan-") as folder:
        work = Path(folder)
        assets = torchtitan_setup.make_assets(work / "assets", Path(paths.split(":")[0]))
        for name in args.cases:
            results[name] = run_case(name, CASES[name], assets, paths, args.steps, work,
                                     args.profiler_traces.resolve() if args.profiler_traces else None)
            print(json.dumps({name: results[name]}), flush=True)
    print(f"{'case':<12} {'GPUs':>4} {'wall s':>7} {'host GiB':>8} {'step ms':>8} {'TPS/GPU':>8} {'published':>9} "
          f"{'error':>7} {'mem GiB':>7} {'published':>9} {'error':>7}")
    save(results)  # first: the table below is only a view of them
    for name, r in results.items():
        shown = {key: "-" if r.get(key) is None else r[key] for key in
                 ("step_ms", "tps_per_gpu", "published_tps", "tps_error_pct", "memory_gib", "published_gib",
                  "memory_error_pct")}
        print(f"{name:<12} {r['gpus']:>4} {r['wall_s']:>7} {r['host_peak_gib']:>8} {shown['step_ms']:>8} "
              f"{shown['tps_per_gpu']:>8} {shown['published_tps']:>9} {shown['tps_error_pct']:>7} "
              f"{shown['memory_gib']:>7} {shown['published_gib']:>9} {shown['memory_error_pct']:>7}")


if __name__ == "__main__":
    main()
