"""`mirage plan` (issue 32, item 3): a grid of configurations of the user's own program, each run
as `mirage run --timing --predict-only`, ranked; cached by configuration; failures reported with
their reason; bad input refused before anything runs; a killed plan leaves no session behind.

The workload is a small DDP model on 2 emulated GPUs. Each rank appends a line to $RECORD as it
starts (its session, pid and start time), so the test counts the sessions that really ran and
finds their processes without mirage's help."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, mirage
from escapees import WatchedCgroup, still_running
from mirage import launcher

WORKLOAD = """\
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

batch = int(os.environ["BATCH"])
started = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
with open(os.environ["RECORD"], "a") as record:
    record.write(f"{os.environ['MIRAGE_SESSION']} {os.getpid()} {started} batch={batch}\\n")
# as torchtitan checks its degrees: a bare AssertionError
assert batch % 2 == 0
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
if os.environ.get("HANG") == str(batch):  # the session is up: hold it until killed
    time.sleep(1000)
model = DistributedDataParallel(nn.Sequential(nn.Linear(1024, 16384), nn.ReLU(), nn.Linear(16384, 1024)).cuda(),
                                device_ids=[rank])
optimizer = torch.optim.AdamW(model.parameters())
x = torch.randn(batch, 128, 1024, device="cuda")
for _ in range(4):
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
"""
TOKENS = "{batch}*128"  # the workload's tokens per step: batch x 128 positions, both ranks' x the same
PRICE = 2.5
RUN_FLAGS = ["--gpus-per-node", "2", "--nproc-per-node", "2", "--env", "BATCH={batch}"]


@pytest.fixture(scope="module", autouse=True)
def shim_built():
    """A shim built beforehand, so no run in a plan waits for a first-run build."""
    launcher.ensure_shim()


@pytest.fixture
def workload(tmp_path) -> tuple[Path, Path]:
    script = tmp_path / "ddp_tiny.py"
    script.write_text(WORKLOAD)
    return script, tmp_path / "record"


def plan(tmp_path: Path, script: Path, record: Path, *args: str, run_flags=RUN_FLAGS) -> subprocess.CompletedProcess:
    return mirage("plan", "--cache", str(tmp_path / "cache"), "--picture", str(tmp_path / "plan"), *args,
                  *run_flags, "--env", f"RECORD={record}", "--", "python", str(script), timeout=300)


def sessions_run(record: Path) -> set[str]:
    return {line.split()[0] for line in record.read_text().splitlines()} if record.exists() else set()


def test_plan_ranks_points_by_their_predictions_caches_them_and_reports_failures(tmp_path, workload):
    script, record = workload
    axes = ["--axis", "batch={2,4}", "--axis", "profile={h100,mi300x}"]
    first = plan(tmp_path, script, record, "-j", "2", *axes, "--tokens-per-step", TOKENS,
                 "--price-per-gpu-hour", str(PRICE), "--json")
    assert first.returncode == 0, first.stderr
    assert len(sessions_run(record)) == 4
    assert "[4/4]" in first.stderr and "ETA" in first.stderr  # the progress lines (stderr is no terminal)
    rows = json.loads(first.stdout)["points"]
    assert [r["rank"] for r in rows] == [1, 2, 3, 4] and all(r["ok"] and not r["cached"] for r in rows)

    # Each row's figures are its summary's: a direct `mirage run` of one point predicts the same.
    summary = tmp_path / "direct.json"
    direct = mirage("run", "--quiet", "--timing", "--predict-only", "--summary-json", str(summary),
                    "--profile", "mi300x", *[f.replace("{batch}", "4") for f in RUN_FLAGS],
                    "--env", f"RECORD={tmp_path / 'direct-record'}", "--", "python", str(script))
    assert direct.returncode == 0, direct.stderr
    job = json.loads(summary.read_text())["timing"]["job"]
    row = next(r for r in rows if r["point"] == {"batch": "4", "profile": "mi300x"})
    assert (row["step_ms"], row["mfu"], row["peak_bytes"]) == (job["step_ms"], job["mfu"], job["peak_reserved"])
    assert row["capacity_bytes"] == json.loads(mirage("profiles", "show", "mi300x", "--json").stdout)["memory_bytes"]

    # The ranking follows from the figures: tokens/s/GPU from the tokens of a step, best first;
    # the cost of a million tokens from the price; the front is what no other point beats on both.
    for r in rows:
        tokens = int(r["point"]["batch"]) * 128
        assert r["gpus"] == 2
        assert r["tokens_per_s_per_gpu"] == pytest.approx(tokens / (r["step_ms"] / 1e3) / 2)
        assert r["cost_per_million_tokens"] == pytest.approx(PRICE * 2 / 3600 * (r["step_ms"] / 1e3) / tokens * 1e6)
        mine = (r["tokens_per_s_per_gpu"], -r["peak_bytes"])
        dominated = any(theirs >= mine and theirs != mine and min(theirs[0] - mine[0], theirs[1] - mine[1]) >= 0
                        for theirs in ((o["tokens_per_s_per_gpu"], -o["peak_bytes"]) for o in rows))
        assert r["pareto"] == (not dominated)
    throughputs = [r["tokens_per_s_per_gpu"] for r in rows]
    assert throughputs == sorted(throughputs, reverse=True)
    picture = (tmp_path / "plan.html").read_text()
    assert picture.count("<circle") == 4 and picture.count('fill="#1f6fb4"><title>') == sum(r["pareto"] for r in rows)

    # Two more batch values: only their points run (a session each). 3 does not divide over the
    # ranks (the assert that failed is named); 32768 needs 256 GiB for one activation, over
    # either profile's capacity (checked before the host backs it: a smaller excess on mi300x
    # would fail for the host's RAM instead). Each point says why, after those that ran.
    second = plan(tmp_path, script, record, "-j", "2", "--axis", "batch={2,3,4,32768}", *axes[2:],
                  "--tokens-per-step", TOKENS)
    assert second.returncode == 0, second.stderr
    assert len(sessions_run(record)) == 8
    assert "4 of 8 points to run (4 cached" in second.stderr
    table = second.stdout.splitlines()
    assert [line.split()[1:3] for line in table[1:5]] == [r["label"].split() for r in rows]
    assert table[5] == "4 point(s) could not run:"
    for line, profile in zip(table[6:8], ("h100", "mi300x")):
        assert line == f"  batch=3 profile={profile}: exit code 1: AssertionError (assert batch % 2 == 0)"
    for line, (profile, api) in zip(table[8:], (("h100", "CUDA"), ("mi300x", "HIP"))):
        assert line.startswith(f"  batch=32768 profile={profile}: exit code 1: torch.OutOfMemoryError: "
                               f"{api} out of memory. Tried to allocate 256.00 GiB."), line

    # The profile as a fixed flag, spelt another way, where it was an axis: the same points, cached.
    third = plan(tmp_path, script, record, "--axis", "batch={2,4}", "--profile=mi300x", "--tokens-per-step", TOKENS)
    assert third.returncode == 0, third.stderr
    assert "all 2 points cached" in third.stderr and len(sessions_run(record)) == 8


@pytest.mark.parametrize("args, fix", [
    (["--axis", "batch={}"], "the template names no value; list them: --axis 'batch={1,2,4}'"),
    (["--axis", "batch={2,,4}"], "the template names no value in one of its places"),
    (["--axis", "batch={2,4}", "--axis", "a={" + ",".join(map(str, range(101))) + "}",
      "--axis", "b={" + ",".join(map(str, range(100))) + "}", "--env", "X={a}{b}"],
     "the grid has 20200 points (over 10000): narrow an axis, or pass --yes to run them all"),
    (["--axis", "batch={2,4}", "--tokens-per-step", TOKENS, "--price-per-gpu-hour", "0"],
     "argument --price-per-gpu-hour: '0' is not a positive number"),
    (["--axis", "batch={2,4}", "--tokens-per-step", TOKENS, "--price-per-gpu-hour", "-1.5"],
     "argument --price-per-gpu-hour: '-1.5' is not a positive number"),
    (["--axis", "batch={2,4}", "--axis", "profile={h100,h1000}"], "at batch=2 profile=h1000: unknown profile 'h1000'"),
    (["--axis", "batch={2,4}", "--axis", "tp={1,2}"], "axis tp appears nowhere: put {tp} where its value goes"),
    (["--axis", "batch={2,4}", "--env", "X={bacth}"], "{bacth} in 'X={bacth}' names no axis (did you mean {batch}?"),
])
def test_bad_input_is_refused_before_anything_runs(tmp_path, workload, args, fix):
    script, record = workload
    refused = plan(tmp_path, script, record, *args)
    assert refused.returncode == 2, refused.stderr
    assert fix in refused.stderr
    assert not record.exists() and not (tmp_path / "cache").exists()


def test_a_python_without_torch_is_refused_naming_the_install(tmp_path):
    """The plan's cache key names the installed torch: without one (`python -S` hides
    site-packages) the plan says what to install, as `mirage run` does, instead of a traceback."""
    refused = subprocess.run([sys.executable, "-S", "-m", "mirage", "plan", "--cache", str(tmp_path / "cache"),
                              "--axis", "a={1,2}", "--", "echo", "{a}"], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "torch is not installed" in refused.stderr and "pip install torch==2.13.0" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_plan_leaves_no_session_behind_and_keeps_its_cache(tmp_path, workload, sig):
    """The plan killed (SIGKILL: no handler; SIGTERM: it stops its runs) while the second point's
    session is up, its ranks waiting in the workload: the first point's result stays cached; of
    the sessions nothing is left: no process under the test's cgroup nor any the workload
    recorded, no session folder, no /dev/shm segment."""
    script, record = workload
    watched = WatchedCgroup()
    args = [sys.executable, "-m", "mirage", "plan", "--cache", str(tmp_path / "cache"), "--no-picture", "--json",
            "-j", "1", "--axis", "batch={2,4}", *RUN_FLAGS, "--profile", "h100", "--env", "HANG=4",
            "--env", f"RECORD={record}", "--", "python", str(script)]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=watched.enter)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and (
                not record.exists() or record.read_text().count("batch=4") < 2):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        hanging = {line.split()[0] for line in record.read_text().splitlines() if line.endswith("batch=4")}
        processes = [(int(pid), started) for _, pid, started, _ in map(str.split, record.read_text().splitlines())]
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == -sig if sig == signal.SIGKILL else proc.returncode == 128 + sig, stderr

        def leftovers() -> list:
            found: list = watched.processes() + still_running(processes)
            found += [d for d in launcher.runtime_root().iterdir() if d.name in hanging]
            return found + [s for session in hanging for s in Path("/dev/shm").glob(f"mirage-*-{session}*")]

        deadline = time.monotonic() + 30
        while leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        watched.remove()

    again = subprocess.run(args[:args.index("batch={2,4}")] + ["batch={2}"] + args[args.index("batch={2,4}") + 1:],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    [row] = json.loads(again.stdout)["points"]
    assert row["cached"] and row["ok"]
    assert len(sessions_run(record)) == 2  # the first point's and the killed one's: none new
