"""The session service: shared GPU memory, smi/ps/exec, desync and hang diagnosis, lifecycle."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, mirage
from escapees import HIDING_COUNT, WatchedCgroup, hiding_workload, recorded, still_running
from mirage import launcher, profiles
from mirage.launcher import nodes, sessions

SHM = Path("/dev/shm")


def tiny_profile(tmp_path: Path, memory_bytes: int = 2**30, context_bytes: int = 64 * 2**20) -> str:
    path = tmp_path / "tiny.toml"
    text = (profiles.DATA_DIR / "mi300x.toml").read_text()
    text = text.replace("memory_bytes = 205822885888", f"memory_bytes = {memory_bytes}")
    path.write_text(re.sub(r"context_bytes = \d+", f"context_bytes = {context_bytes}", text))
    return str(path)


def start(*args: str, watched: WatchedCgroup | None = None) -> subprocess.Popen:
    """`mirage run ARGS`, in the test's cgroup `watched` if given (it then holds all the run starts)."""
    return subprocess.Popen([sys.executable, "-m", "mirage", "run", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=watched.enter if watched else None)


def session_of(proc: subprocess.Popen) -> str:
    """The session id `mirage run` announces (after any first-run shim build narration)."""
    for line in proc.stderr:
        if line.startswith("mirage: session "):
            return line.split()[2]
    raise AssertionError("mirage run announced no session")


def leftovers(session: str, watched: WatchedCgroup) -> list:
    """The session's /dev/shm segments, and the processes under the test's cgroup `watched`
    (found however they hid: tests/escapees.py) or carrying MIRAGE_SESSION=<session>."""
    found: list = [p for p in SHM.glob(f"mirage-*-{session}*")]  # any collectives segment (the table is a memfd)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"MIRAGE_SESSION={session}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found + [pid for pid in watched.processes() if pid not in found]


SHARED = (
    "import os, torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "x = torch.empty(400 * 2**20, dtype=torch.uint8, device='cuda:0')\n"
    "dist.barrier()\n"
    "free, total = torch.cuda.mem_get_info(0)\n"
    "print('in use', (total - free) // 2**20, flush=True)\n"
    "dist.barrier()\n"
    "if dist.get_rank() == 0:\n"
    "    try:\n"
    "        torch.empty(400 * 2**20, dtype=torch.uint8, device='cuda:0')\n"
    "    except torch.cuda.OutOfMemoryError as e:\n"
    "        print('OOM', str(e), flush=True)\n"
    "dist.barrier()\n"
)


def test_processes_on_one_gpu_share_its_capacity(tmp_path):
    result = mirage("run", "--profile", tiny_profile(tmp_path), "--nproc-per-node", "2", "--gpus-per-node", "2",
                    "--quiet", "--", "python", "-c", SHARED)
    assert result.returncode == 0, result.stderr
    # each process: a 400 MiB segment and its 64 MiB context
    assert result.stdout.count("in use 928") == 2
    oom = [line for line in result.stdout.splitlines() if " OOM " in line]
    assert oom, result.stdout
    assert "Tried to allocate 400.00 MiB. GPU 0 has a total capacity of 1024.00 MiB of which 96.00 MiB is free" in oom[0]
    assert "has 464.00 MiB memory in use. Including non-PyTorch memory, this process has 464.00 MiB" in oom[0]
    assert "Of the allocated memory 400.00 MiB is allocated by PyTorch, and 0 bytes is reserved" in oom[0]


def test_in_process_mode_keeps_memory_per_process(tmp_path):
    result = mirage("run", "--in-process", "--profile", tiny_profile(tmp_path), "--nproc-per-node", "2",
                    "--gpus-per-node", "2", "--", "python", "-c", SHARED)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("in use 464") == 2 and " OOM " not in result.stdout  # its segment and context
    assert "summary" not in result.stderr


def test_smi_ps_and_exec_on_a_live_session():
    script = ("import os, time, torch, torch.distributed as dist\n"
              "rank = int(os.environ['RANK']); torch.cuda.set_device(rank)\n"
              "dist.init_process_group('nccl')\nx = torch.ones(2**20, device='cuda')\ndist.all_reduce(x)\n"
              "print('ready', flush=True)\ntime.sleep(20)\n")
    isolated = nodes.unavailable_reason() is None  # then exec must enter node 1's namespaces
    proc = start(*(["--isolate-nodes"] if isolated else []), "--num-nodes", "2", "--nproc-per-node", "1",
                 "--gpus-per-node", "2", "--", "python", "-c", script)
    try:
        session = session_of(proc)
        assert proc.stdout.readline().endswith("ready\n") and proc.stdout.readline().endswith("ready\n")
        listed = json.loads(mirage("ps", "--json").stdout)
        assert session in [s["session"] for s in listed]
        status = json.loads(mirage("smi", "--session", session, "--json").stdout)
        assert status["num_nodes"] == 2 and len(status["gpus"]) == 4
        node1_gpu1 = [g for g in status["gpus"] if (g["node"], g["gpu"]) == (1, 1)][0]
        # as nvidia-smi counts it: the process's context and its 20 MiB segment for the 4 MiB tensor
        context = profiles.load("mi350x").context_bytes
        assert node1_gpu1["used_bytes"] == context + 20 * 2**20 and node1_gpu1["processes"][0]["rank"] == 1
        assert all("all_reduce" in p["last_collective"] for p in status["processes"])
        table = mirage("smi", "--session", session).stdout
        assert "AMD Instinct MI350X" in table and "LAST COLLECTIVE" in table
        seen = mirage("exec", "--session", session, "--node", "1", "--", "python", "-c",
                      "import os, socket, torch; free, total = torch.cuda.mem_get_info(1); "
                      "print(os.environ['MIRAGE_NODE_RANK'], (total - free) // 2**20, socket.gethostname())")
        # the rank's context and segment, and the context the querying process itself now has
        # there; inside node 1's namespaces when the nodes are isolated
        hostname = "node1" if isolated else os.uname().nodename
        assert seen.stdout.split() == ["1", str((2 * context + 20 * 2**20) // 2**20), hostname], seen.stderr
    finally:
        proc.kill()
        proc.wait()
        mirage("cleanup")


def test_desync_is_reported_at_once_naming_both_calls():
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python", "tests/workloads/desync.py",
                    timeout=120)
    assert result.returncode == 123
    assert "collective desync in group '0' at sequence number 2 (different numel)" in result.stderr
    assert "shapes=[[8]], op=SUM) at" in result.stderr and "shapes=[[4]], op=SUM) at" in result.stderr
    assert "tests/workloads/desync.py:11" in result.stderr


@pytest.mark.parametrize("workload, expected", [
    ("hang.py", ["hang: ranks [0] have waited more than 2 s in #2 all_reduce",
                 "rank 1 never arrived; its last collective: all_reduce", 'hang.py", line 15 in <module>']),
    # inside DDP, where the all-reduce is issued from C++ during the backward pass of line 17
    ("ddp_hang.py", ["hang: ranks [0] have waited more than 2 s in",
                     "all_reduce(dtype=float32, shapes=[[72]], op=SUM) from C++ during the backward pass at ",
                     "ddp_hang.py:17 in <module> (DDP's reducer or another C++ caller)",
                     "rank 1 never arrived",
                     'ddp_hang.py", line 16 in <module>']),
])
def test_hang_reports_who_waits_and_who_never_arrived_and_where_it_is(workload, expected):
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--hang-timeout", "2", "--",
                    "python", f"tests/workloads/{workload}", timeout=120)
    assert result.returncode == 124
    assert 'rank 1 is now at:\n      File "' in result.stderr
    for text in expected:
        assert text in result.stderr


def test_summary_table_and_json(tmp_path):
    path = tmp_path / "summary.json"
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--summary-json", str(path), "--",
                    "python", "tests/fixtures/ml/dist_smoke.py")
    assert result.returncode == 0, result.stderr
    assert "summary (exit code 0)" in result.stderr and "collectives" in result.stderr
    report = json.loads(path.read_text())
    assert [p["exit_code"] for p in report["processes"]] == [0, 0]
    assert {c["rank"]: c["count"] for c in report["collectives"]} == {0: 1, 1: 1}
    # each GPU's peak: its process's context and the small segment of dist_smoke's one-element tensor
    assert all(g["peak_bytes"] == profiles.load("mi350x").context_bytes + 2 * 2**20 for g in report["gpus"])


def test_an_output_path_that_cannot_be_written_is_refused_before_the_workload_starts(tmp_path):
    for path, why in (("/nonexistent-dir/x.json", "cannot write there"), (str(tmp_path), "is a directory")):
        result = mirage("run", "--summary-json", path, "--", "python", "-c", "print('ran')")
        assert result.returncode == 2 and why in result.stderr and "ran" not in result.stdout


def test_a_summary_that_fails_to_write_at_the_end_keeps_the_workloads_exit_code():
    # /dev/full accepts the open and fails the write (ENOSPC), as a full disk does at the end
    result = mirage("run", "--quiet", "--summary-json", "/dev/full", "--", "python", "-c", "raise SystemExit(3)")
    assert result.returncode == 3
    assert "--summary-json /dev/full not written: No space left on device" in result.stderr
    assert "Traceback" not in result.stderr


def _reaper_of(session: str) -> int:
    """The pid of the session's reaper (its command line names the session)."""
    reapers = [int(e.name) for e in Path("/proc").iterdir()
               if e.name.isdigit() and b"reap_after_run" in _cmdline(e) and session.encode() in _cmdline(e)]
    assert len(reapers) == 1
    return reapers[0]


def test_ranks_fail_fast_when_the_daemon_dies(tmp_path):
    """Each rank stops by itself when the service dies: its reaper is killed first (the reaper
    would otherwise SIGKILL what is left after 2 s), and each rank's stderr goes to a file of its
    own, which outlives the run, where the rank's last words name the daemon's death and its pid."""
    script = ("import os, sys, time, torch\n"
              f"err = open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w')\n"
              "os.dup2(err.fileno(), 2)\n"
              "print('attached', os.getpid(), flush=True)\n"
              "time.sleep(600)\n")
    proc = start("--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python", "-c", script)
    try:
        session = session_of(proc)
        ranks = [int(proc.stdout.readline().split()[-1]) for _ in range(2)]
        os.kill(_reaper_of(session), signal.SIGKILL)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60  # a guard against hanging only: the ranks take well under 1 s
        for rank in range(2):  # the file fills when the rank notices; nothing else writes it
            said = tmp_path / f"rank{rank}"
            while "mirage daemon died" not in said.read_text():
                assert time.monotonic() < deadline, f"rank {rank} did not stop by itself: {said.read_text()!r}"
                time.sleep(0.05)
        for pid in ranks:
            assert f"mirage daemon died (its socket closed); stopping pid {pid} " in "".join(
                (tmp_path / f"rank{rank}").read_text() for rank in range(2))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        mirage("cleanup")


def test_any_mirage_command_reaps_what_a_run_killed_with_its_reaper_left(tmp_path):
    """A run's reaper removes what its SIGKILLed run left (tests/test_mirage_killed.py); should
    the reaper be killed too, any mirage command does, processes that hid from mirage included
    (found by the pids they recorded and the test's cgroup: tests/escapees.py)."""
    record = tmp_path / "pids"
    watched = WatchedCgroup()
    proc = start("--nproc-per-node", "2", "--gpus-per-node", "2", "--", *hiding_workload(record), watched=watched)
    try:
        session = session_of(proc)
        hidden = recorded(record, 2 * HIDING_COUNT, proc)
        os.kill(_reaper_of(session), signal.SIGKILL)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # what a rank killed while its group set up its shared-memory collectives would leave
        segment = SHM / f"mirage-{os.getuid()}-{session}.collectives-42"
        segment.write_bytes(b"\0" * 4096)
        directory = launcher.runtime_root() / session
        dry = mirage("cleanup", "--dry-run")
        assert f"would remove {directory}\n" in dry.stdout and f"would remove {segment}\n" in dry.stdout
        assert mirage("ps").returncode == 0  # no `mirage cleanup`: any command reaps a dead session
        assert still_running(hidden) == []
        assert leftovers(session, watched) == []
        assert not directory.exists()
    finally:
        watched.remove()


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


def test_a_session_folder_its_run_has_not_named_yet_is_not_reclaimed():
    """A run makes its session folder, then names itself in it (run.pid); every mirage command
    first reclaims dead sessions, and one starting in between once removed a starting run's
    folder (four `mirage run`s started together by bench/train_step.py: FileNotFoundError at the
    run's scratch folder). A folder without run.pid is a starting run's for a grace period and a
    dead run's after it."""
    starting = launcher.runtime_root() / "20261205-000000-5ea7ed"
    starting.mkdir(mode=0o700)
    try:
        assert mirage("ps").returncode == 0
        assert starting.is_dir(), "a starting run's folder was reclaimed"
        made_long_ago = time.time() - sessions.STARTING_GRACE_SECONDS - 5
        os.utime(starting, (made_long_ago, made_long_ago))
        assert mirage("ps").returncode == 0
        assert not starting.exists(), "a folder no run named within the grace period was kept"
    finally:
        if starting.exists():
            starting.rmdir()


def test_cleanup_leaves_a_live_in_process_run_alone():
    """An --in-process run has no service to answer: its run's pid says it is alive."""
    script = "import sys, torch\nprint('ready', flush=True)\nsys.stdin.readline()\nprint('done', flush=True)\n"
    proc = subprocess.Popen([sys.executable, "-m", "mirage", "run", "--in-process", "--gpus-per-node", "1", "--",
                             "python", "-c", script], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        session = session_of(proc)
        assert proc.stdout.readline() == "ready\n"
        assert session not in mirage("cleanup", "--dry-run").stdout
        mirage("cleanup")
        out, _ = proc.communicate("go\n", timeout=60)
        assert proc.returncode == 0 and out == "done\n"
    finally:
        proc.kill()
        proc.wait()


def drained(session: str, watched: WatchedCgroup) -> list:
    """What the session left once its reaper (in `watched` too) had up to 30 s to end; a guard
    against hanging, not a time the reaper must meet."""
    deadline = time.monotonic() + 30
    while (left := leftovers(session, watched)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("rounds", [15, pytest.param(50, marks=pytest.mark.slow)])  # 50: MIRAGE_SLOW_TESTS=1
def test_sigkill_at_random_moments_leaves_nothing_after_cleanup(tmp_path, rounds):
    """Each round kills `mirage run` with SIGKILL at a random moment of its life; its workload
    hides processes from mirage (tests/escapees.py) as soon as it starts."""
    rng = random.Random(1234)
    for round_number in range(rounds):
        record = tmp_path / f"pids{round_number}"
        watched = WatchedCgroup()
        try:
            proc = start("--nproc-per-node", "2", "--gpus-per-node", "2", "--quiet", "--", *hiding_workload(record),
                         watched=watched)
            session = session_of(proc)
            time.sleep(rng.uniform(0, 0.6))  # the random moment of the kill, not a wait for an event
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            hidden = [(int(pid), started) for pid, started in
                      (line.split() for line in (record.read_text().splitlines() if record.exists() else []))]
            mirage("cleanup")
            assert drained(session, watched) == [], f"round {round_number}"
            assert still_running(hidden) == [], f"round {round_number}"
            assert not list(SHM.glob(f"mirage-*-{session}"))
        finally:
            watched.remove()


@pytest.mark.parametrize("end", ["teardown", "sigkill"])
def test_processes_that_hide_from_mirage_end_with_the_session(tmp_path, end):
    """README: "Nothing the workload started is left running", checked without mirage's own rule
    (tests/escapees.py): a process with an empty environment in a session of its own and an
    orphan are gone when `mirage run` returns after its teardown (at once: teardown waits for
    them), and after a SIGKILL of `mirage run` (its reaper's work, so the test waits for it)."""
    record = tmp_path / "pids"
    watched = WatchedCgroup()
    try:
        proc = start("--quiet", "--", *hiding_workload(record), watched=watched)
        session = session_of(proc)
        hidden = recorded(record, HIDING_COUNT, proc)
        proc.send_signal(signal.SIGTERM if end == "teardown" else signal.SIGKILL)
        assert proc.wait() == (128 + signal.SIGTERM if end == "teardown" else -signal.SIGKILL)
        if end == "teardown":
            assert still_running(hidden) == []
        assert drained(session, watched) == []
        assert still_running(hidden) == []
    finally:
        watched.remove()


def test_a_process_that_dies_returns_its_memory(tmp_path):
    script = (
        "import os, time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "if rank == 1:\n"
        "    x = torch.empty(600 * 2**20, dtype=torch.uint8, device='cuda:0')\n"
        "dist.barrier()\n"
        "if rank == 1:\n"
        "    os._exit(0)  # dies holding 600 MiB of the 1 GiB GPU\n"
        "for _ in range(200):\n"
        "    if torch.cuda.mem_get_info(0)[0] >= 600 * 2**20:\n"
        "        break\n"
        "    time.sleep(0.05)\n"
        "y = torch.empty(600 * 2**20, dtype=torch.uint8, device='cuda:0')\n"
        "print('reclaimed', flush=True)\n"
        "os._exit(0)\n"
    )
    result = mirage("run", "--profile", tiny_profile(tmp_path), "--nproc-per-node", "2", "--gpus-per-node", "1",
                    "--quiet", "--", "python", "-c", script, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[0] reclaimed" in result.stdout


def test_sequential_tests_that_each_create_group_0_are_not_a_desync_but_a_real_one_is():
    """The flight recorder keys operations by communicator instance: ten spawned "tests" in a
    row, each with its own default group '0', compare only with themselves."""
    result = mirage("run", "--gpus-per-node", "2", "--", "python", "tests/workloads/sequential_groups.py", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sequential_ok" in result.stdout
    assert "desync" not in result.stderr
    result = mirage("run", "--gpus-per-node", "2", "--env", "DESYNC_IN=5", "--", "python",
                    "tests/workloads/sequential_groups.py", timeout=300)
    assert result.returncode == 123, result.stderr[-3000:]
    assert "test 4 ok" in result.stdout and "test 5 ok" not in result.stdout
    assert "collective desync in group '0' at sequence number 1 (different numel)" in result.stderr
    assert "shapes=[[15]], op=SUM) at" in result.stderr and "shapes=[[16]], op=SUM) at" in result.stderr


def test_smi_shows_a_busy_gpu_s_utilization_power_and_temperature():
    script = ("import time, torch\nx = torch.randn(256, 256, device='cuda:1')\nprint('ready', flush=True)\n"
              "end = time.monotonic() + 15\nwhile time.monotonic() < end:\n    x = (x @ x).tanh()\n")
    proc = start("--gpus-per-node", "2", "--", "python", "-c", script)
    try:
        session = session_of(proc)
        assert proc.stdout.readline().endswith("ready\n")
        deadline = time.monotonic() + 60  # a guard against hanging: the service samples each second
        while True:  # until a sample covers the busy loop (no wall-clock amount of it is asserted)
            status = json.loads(mirage("smi", "--session", session, "--json").stdout)
            idle, busy = sorted(status["gpus"], key=lambda g: g["gpu"])
            if busy["utilization_percent"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        # GPU 0 never runs anything, so 0 holds whatever the scheduling; GPU 1 is only required to be busier
        assert idle["utilization_percent"] == 0 and idle["power_watts"] == 150 and idle["temperature_c"] == 35
        assert busy["utilization_percent"] > idle["utilization_percent"], busy
        assert busy["power_watts"] > 150 and busy["temperature_c"] > 35 and busy["clock_mhz"] == 2200
        table = mirage("smi", "--session", session).stdout
        assert "UTIL" in table and "POWER" in table and "150 W" in table
    finally:
        proc.kill()
        proc.wait()
        mirage("cleanup")


def test_ranks_killed_while_waiting_are_not_reported_as_hung():
    """Killed once the session's flight recorder has rank 0 waiting in its all_reduce, then on until
    the recorder's hang watch has looked past the 3 s --hang-timeout counted from the kill: no report.
    The positive control, same harness, leaves rank 0 waiting: a hang, 124. A mutation shows the
    first run can fail (2026-12-04): with FlightRecorder.process_gone a no-op, it ends 124 with
    "hang: ranks [0] have waited more than 3 s"."""
    result = mirage("run", "--gpus-per-node", "2", "--hang-timeout", "3", "--", "python",
                    "tests/workloads/killed_ranks.py", "kill", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "harness carried on" in result.stdout and "hang:" not in result.stderr
    control = mirage("run", "--gpus-per-node", "2", "--hang-timeout", "3", "--", "python",
                     "tests/workloads/killed_ranks.py", "keep", timeout=120)
    assert control.returncode == 124, control.stderr[-3000:]
    assert "hang:" in control.stderr and "harness carried on" not in control.stdout
