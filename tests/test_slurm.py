"""One emulated cluster across real hosts (launcher/cluster.py), on a real Slurm: slurmctld and a
slurmd per host, each host a network namespace of its own (scripts/slurm_testbed.sh, which the
fixture starts and stops). `mirage node` runs once per host under srun."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO
from mirage import launcher
from mirage.launcher import nodes

TESTBED = REPO / "scripts" / "slurm_testbed.sh"
pytestmark = pytest.mark.skipif(nodes.unavailable_reason() is not None or shutil.which("apt-get") is None,
                                reason="the Slurm test cluster needs root, iproute2 and apt-get")
MIRAGE = str(Path(os.sys.executable).parent / "mirage")


@pytest.fixture(scope="module")
def slurm() -> dict[str, str]:
    started = subprocess.run([str(TESTBED), "start", "2"], capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, started.stderr[-3000:]
    conf = re.search(r"SLURM_CONF=(\S+)", started.stdout).group(1)
    yield {**os.environ, "SLURM_CONF": conf}
    subprocess.run([str(TESTBED), "stop"], capture_output=True, timeout=120)


def srun(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["srun", "--quiet", "-N2", "--ntasks-per-node=1", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cluster_leftovers() -> list[str]:
    """Processes and session folders of any cluster session (slurm-*), on either host."""
    found = [d.name for d in launcher.runtime_root().glob("slurm-*")]
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"MIRAGE_SESSION=slurm-" in (entry / "environ").read_bytes():
                found.append(entry.name)
        except OSError:
            pass
    return found


def test_a_two_host_slurm_job_trains_ddp_to_identical_replicas(slurm):
    result = srun(slurm, MIRAGE, "node", "--quiet", "--gpus-per-node", "2", "--nproc-per-node", "2",
                  "--env", "NCCL_DEBUG=INFO", "--", "python", "tests/fixtures/ml/ddp_mlp.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0] [rank 0] all ranks converged with identical replicas" in result.stdout
    # 4 ranks over 2 hosts: each host's two emulated GPUs share memory; the hosts meet on their NICs.
    assert re.search(r"\[0\] host0:\d+ \[0\] RCCL INFO comm 0x\w+ rank 0 nRanks 4 node 0", result.stderr)
    assert re.search(r"\[2\] host1:\d+ \[0\] RCCL INFO Channel 00/0 : 2\[0\] -> 0 via NET/Socket/0", result.stderr)
    assert "[3] host1" in result.stderr and "RCCL INFO NET/Socket : Using [0]eth0:10.231.0.11<0>" in result.stderr
    assert not cluster_leftovers()


def test_smi_on_one_host_shows_the_whole_cluster(slurm):
    job = subprocess.Popen(["srun", "--quiet", "-N2", "--ntasks-per-node=1", MIRAGE, "node", "--quiet",
                            "--gpus-per-node", "2", "--nproc-per-node", "1", "--", "python", "-c",
                            "import time, torch; torch.ones(1 << 20, device='cuda'); time.sleep(60)"],
                           cwd=REPO, env=slurm, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        status = {}
        deadline = time.monotonic() + 120
        def node1_allocated() -> bool:
            return any(g["node"] == 1 and g["used_bytes"] >= 4 << 20 for g in status.get("gpus", []))

        while time.monotonic() < deadline and not (len(status.get("processes", [])) == 2 and node1_allocated()):
            time.sleep(1)
            sessions = sorted(d.name for d in launcher.runtime_root().glob("slurm-*-host0"))
            if sessions:
                smi = subprocess.run([MIRAGE, "smi", "--json", "--session", sessions[0]], capture_output=True,
                                     text=True)
                status = json.loads(smi.stdout) if smi.returncode == 0 else {}
        assert [p["rank"] for p in status["processes"]] == [0, 1]
        assert [(g["node"], g["gpu"]) for g in status["gpus"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert len(status["hosts"]) == 2 and node1_allocated()  # the 4 MiB tensor on host1's GPU
    finally:
        job.send_signal(signal.SIGINT)  # srun: twice within a second cancels the step
        time.sleep(0.2)
        job.send_signal(signal.SIGINT)
        job.wait(timeout=60)
    deadline = time.monotonic() + 20
    while cluster_leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not cluster_leftovers()


TRAINING = "Init COMPLETE"  # each rank's NCCL_DEBUG=INFO line; DDP's broadcast and steps follow


def test_sigkill_of_mirage_node_on_either_host_leaves_nothing_on_any_host(slurm):
    """mirage node is killed once both hosts' ranks have formed their communicator (training), an
    event read from the job's output, not a time. The output is read by a thread for the whole job:
    a pipe nobody reads fills (64 KiB) and blocks the ranks' writes, and a readline in the test's
    own thread would wait for ever on a line that never comes."""
    for victim in (0, 1):
        # --kill-on-bad-exit, as a job script would: a rank still in start-up waits for its lost peer
        # until torch's timeout otherwise (10 minutes), on a real cluster too
        job = subprocess.Popen(["srun", "--quiet", "--kill-on-bad-exit=1", "-N2", "--ntasks-per-node=1", MIRAGE,
                                "node", "--quiet", "--gpus-per-node", "1", "--nproc-per-node", "1",
                                "--env", "NCCL_DEBUG=INFO", "--", "python", "tests/fixtures/ml/ddp_mlp.py"],
                               cwd=REPO, env={**slurm, "STEPS": "100000"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        training = threading.Event()

        def read(out=job.stdout, lines=lines, training=training) -> None:
            for line in out:
                lines.append(line)
                if sum(TRAINING in seen for seen in lines) >= 2:
                    training.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        folder = launcher.runtime_root()
        deadline = time.monotonic() + 120
        run_pid = None
        while run_pid is None and time.monotonic() < deadline:
            time.sleep(0.5)
            for session in folder.glob(f"slurm-*-host{victim}"):
                try:
                    run_pid = int((session / launcher.RUN_PID_NAME).read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    pass
        assert run_pid is not None
        assert training.wait(120), "the ranks never formed their communicator:\n" + "".join(lines[-30:])
        os.kill(run_pid, signal.SIGKILL)
        job.wait(timeout=120)  # the other host's ranks find their peers gone, and srun ends the step
        reader.join(timeout=10)
        deadline = time.monotonic() + 30
        while cluster_leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not cluster_leftovers(), f"host{victim} killed"


def test_a_host_that_never_joins_fails_the_rendezvous_naming_it(slurm, tmp_path):
    """Only host0 of a 2-host allocation starts mirage node: it names host1 and leaves nothing.
    host1's task stays up, not in mirage, until host0's mirage node has ended (a file host0's
    shell writes after it, on the hosts' shared filesystem), as a host that is there but never
    joins; host0's shell runs mirage node without exec so that it can write the file."""
    ended = tmp_path / "host0-ended"
    result = subprocess.run(["srun", "--quiet", "-N2", "--ntasks-per-node=1", "sh", "-c",
                             f'if [ "$SLURM_NODEID" = 0 ]; then {MIRAGE} node --rdzv-timeout 5 -- true; code=$?; '
                             f'touch {ended}; exit $code; fi; while [ ! -e {ended} ]; do sleep 0.1; done'],
                            cwd=REPO, env=slurm, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "host(s) host1 did not join within 5 s" in result.stderr
    assert not cluster_leftovers()


def test_mirage_node_outside_slurm_or_with_a_mismatched_node_list_is_refused():
    outside = subprocess.run([MIRAGE, "node", "--", "true"], capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert outside.returncode == 2 and "start it with srun" in outside.stderr
    mismatched = subprocess.run([MIRAGE, "node", "--", "true"], capture_output=True, text=True,
                                env={**os.environ, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a,b",
                                     "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "3"})
    assert mismatched.returncode == 2 and "names 2 host(s) but SLURM_JOB_NUM_NODES is 3" in mismatched.stderr
    uneven = subprocess.run([MIRAGE, "node", "--num-nodes", "3", "--", "true"], capture_output=True, text=True,
                            env={**os.environ, "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a,b",
                                 "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "2"})
    assert uneven.returncode == 2 and "does not split over the job's 2 host(s)" in uneven.stderr
