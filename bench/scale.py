"""Scale figures with and without the fork server (mirage/forkserver), measured in one run.

    python bench/scale.py [--skip-256]

For each case, `mirage run` as it starts by default (the fork server) against
`mirage run --no-fork-server`, one after the other in the same run:

* 32 and 64 ranks (4 and 8 nodes x 8): start-up, from launch to the moment the last rank has finished its
  first collective (each rank prints the time it finished its first all_reduce), the median of
  three jobs (one job's figure moves by half a second with the machine's other load); peak host
  memory (the largest sum, over the run's process tree, of each process's Pss, sampled every
  0.5 s); per-rank unique memory (smaps_rollup Private_Dirty + Private_Clean, read by each
  rank right after that collective; the median over ranks).
* 8-rank all_reduce bus bandwidth on 64 MiB tensors: seven jobs a side, the two sides taking
  turns (so that a change in the machine's load falls on both), the median and range of each
  (the fork server must not slow collectives).
* 256 ranks (32 nodes x 8): dist_smoke and the DDP demo (ddp_mlp.py, 5 steps), wall time and
  peak host memory.

A case the memory check refuses (mirage/launcher/capacity.py: on a shared machine, the baseline
may not fit where the fork server does) is reported as refused, with its estimate.

Targets (issue 22): 64-rank start-up <= 5 s, per-rank unique memory <= 50 MB, the 8-rank
bandwidth not lower than without the server. Prints a table and a JSON line; the figures go into
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from record import save  # bench/record.py: the figures beside the doc

REPO = Path(__file__).resolve().parent.parent
# Each rank: its first collective, then its own unique memory; with BUSBW_MB, all_reduce bus
# bandwidth over a tensor of that many MiB.
PROBE = """
import os, sys, time
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
dist.init_process_group("nccl")
one = torch.ones(1, device="cuda")
dist.all_reduce(one)
first = time.time()
unique_kb = 0
for line in open("/proc/self/smaps_rollup"):
    if line.startswith(("Private_Dirty:", "Private_Clean:")):
        unique_kb += int(line.split()[1])
print(f"FIRST_COLLECTIVE {first:.3f} UNIQUE_KB {unique_kb}", flush=True)
size_mb = int(os.environ.get("BUSBW_MB", "0"))
if size_mb:
    data = torch.ones(size_mb << 18, device="cuda")
    for _ in range(2):
        dist.all_reduce(data)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(10):
        dist.all_reduce(data)
    dist.barrier()
    seconds = (time.perf_counter() - start) / 10
    if rank == 0:
        print(f"BUSBW_GBS {(size_mb << 20) / seconds * 2 * (world - 1) / world / 1e9:.3f}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


class TreeMemory(threading.Thread):
    """Samples the summed Pss of a process and all its descendants; keeps the largest."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peak_kb, self.stopped = root, 0, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            self.peak_kb = max(self.peak_kb, self._sample())

    def _sample(self) -> int:
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(parent, []).append(int(entry.name))
        total, todo = 0, [self.root]
        while todo:
            pid = todo.pop()
            todo.extend(children.get(pid, []))
            try:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
            except OSError:
                continue
        return total


def mirage(args: list[str], env: dict[str, str] | None = None) -> dict:
    """One `mirage run`: wall time, peak tree memory, output (exit code checked by the caller)."""
    start = time.time()
    process = subprocess.Popen([sys.executable, "-m", "mirage", "run", "--quiet", *args], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = TreeMemory(process.pid)
    sampler.start()
    stdout, stderr = process.communicate()
    sampler.stopped.set()
    return {"start": start, "wall_s": time.time() - start, "peak_gib": sampler.peak_kb / 2**20,
            "code": process.returncode, "stdout": stdout, "stderr": stderr}


class CaseFailed(Exception):
    """A case whose `mirage run` failed: reported with its exit code, the other cases still run."""


def checked(result: dict, what: str) -> dict:
    if result["code"] != 0:
        lines = [line for line in result["stderr"].splitlines() if "starting node" not in line]
        raise CaseFailed(f"{what} failed (exit {result['code']}): " + " | ".join(lines[-4:]))
    return result


def refusal(result: dict) -> dict | None:
    """The memory check's refusal (exit 2), kept as a figure: on a shared machine the baseline
    may not fit where the fork server does."""
    if result["code"] != 2:
        return None
    return {"refused": next((line for line in result["stderr"].splitlines() if "cannot hold" in line),
                            result["stderr"]).strip()}


STARTUP_JOBS = 3
BUSBW_JOBS = 7


def startup_case(probe: Path, server: bool, nodes: int) -> dict:
    """The median job of STARTUP_JOBS by start-up; its memory figures with it."""
    flags = [] if server else ["--no-fork-server"]
    jobs = []
    for _ in range(STARTUP_JOBS):
        result = mirage([*flags, "--isolate-nodes", "--num-nodes", str(nodes), "--nproc-per-node", "8",
                         "--gpus-per-node", "8", "--",
                         "python", str(probe)])
        refused = refusal(result)
        if refused:
            return refused
        checked(result, f"{nodes * 8}-rank start-up")
        firsts, uniques = [], []
        for line in result["stdout"].splitlines():
            if "FIRST_COLLECTIVE" in line:
                fields = line.split()
                firsts.append(float(fields[fields.index("FIRST_COLLECTIVE") + 1]))
                uniques.append(int(fields[fields.index("UNIQUE_KB") + 1]) / 1024)
        assert len(firsts) == nodes * 8, result["stdout"][-2000:]
        jobs.append({"startup_s": round(max(firsts) - result["start"], 2), "wall_s": round(result["wall_s"], 1),
                     "peak_gib": round(result["peak_gib"], 2),
                     "unique_mb_median": round(statistics.median(uniques), 1), "unique_mb_max": round(max(uniques), 1)})
    jobs.sort(key=lambda job: job["startup_s"])
    return {**jobs[len(jobs) // 2], "startup_s_each": [job["startup_s"] for job in jobs]}


def busbw_jobs(probe: Path) -> dict:
    """BUSBW_JOBS 8-rank jobs a side, the sides taking turns: each side's median and range."""
    figures: dict[str, list[float]] = {"fork_server": [], "no_fork_server": []}
    for _ in range(BUSBW_JOBS):
        for side, flags in (("fork_server", []), ("no_fork_server", ["--no-fork-server"])):
            result = checked(mirage([*flags, "--nproc-per-node", "8", "--gpus-per-node", "8", "--env", "BUSBW_MB=64",
                                     "--", "python", str(probe)]), "8-rank bandwidth")
            figures[side].append(next(float(line.split()[-1]) for line in result["stdout"].splitlines()
                                      if "BUSBW_GBS" in line))
    return {side: {"median_gbs": statistics.median(values), "min_gbs": min(values), "max_gbs": max(values)}
            for side, values in figures.items()}


def big_case(server: bool, workload: str) -> dict:
    flags = [] if server else ["--no-fork-server"]
    command = (["python", "tests/fixtures/ml/dist_smoke.py"] if workload == "dist_smoke"
               else ["python", "tests/fixtures/ml/ddp_mlp.py"])
    result = mirage([*flags, "--isolate-nodes", "--num-nodes", "32", "--nproc-per-node", "8", "--gpus-per-node", "8",
                     "--env", "STEPS=5", "--", *command])
    refused = refusal(result)
    if refused:
        return refused
    checked(result, f"256-rank {workload}")
    if workload == "dist_smoke":
        assert "dist_smoke_ok" in result["stdout"], result["stdout"][-2000:]
    return {"wall_s": round(result["wall_s"], 1), "peak_gib": round(result["peak_gib"], 2)}


def measured(name: str, case, *args) -> object:
    """Runs one case, printing its figure at once (a long run is not lost to a later failure)."""
    try:
        figure = case(*args)
    except CaseFailed as failure:
        figure = {"failed": str(failure)}
    print(f"{name}: {json.dumps(figure)}", flush=True)
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-256", action="store_true", help="only the 32-, 64- and 8-rank cases")
    args = parser.parse_args()
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        probe = Path(folder) / "probe.py"
        probe.write_text(PROBE)
        bandwidth = measured("8-rank busbw", busbw_jobs, probe)
        for server in (True, False):
            name = "fork_server" if server else "no_fork_server"
            figures[name] = {
                "32_ranks": measured(f"{name} 32 ranks", startup_case, probe, server, 4),
                "64_ranks": measured(f"{name} 64 ranks", startup_case, probe, server, 8),
                "8_rank_busbw": bandwidth.get(name, bandwidth),
            }
            if not args.skip_256:
                for workload in ("dist_smoke", "ddp"):
                    figures[name][f"256_ranks_{workload}"] = measured(f"{name} 256 ranks {workload}", big_case,
                                                                      server, workload)
    print(json.dumps(figures))
    save(figures)


if __name__ == "__main__":
    main()
