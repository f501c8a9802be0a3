"""mirage itself killed (issue 20, item 6): a `mirage run` that dies by SIGKILL, as to the OOM
killer, leaves nothing once its session's processes have ended, with no mirage command after it."""

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO
from escapees import WatchedCgroup
from mirage import launcher

SEED = 20
DRAIN_SECONDS = 20  # the ranks stop at once; the reaper kills what did not after 2 s
COMMAND = ["--gpus-per-node", "2", "--env", "STEPS=1000000", "--env", "NCCL_DEBUG=INFO", "--",
           "torchrun", "--standalone", "--nproc_per_node=2", "tests/fixtures/ml/ddp_mlp.py"]
# What the run prints as it goes, the moments a kill is timed from: its session is up, torchrun's
# agent has started (its banner, before it starts the ranks), each rank's NCCL_DEBUG=INFO line
# once its communicator formed (DDP's broadcast and steps follow).
MARKERS = {"session": "mirage: session ", "torchrun": "torch/distributed/run.py", "training": "Init COMPLETE"}


@pytest.fixture(scope="module", autouse=True)
def shim_built():
    """A shim built beforehand, so no kill lands in (or waits for) a first-run build."""
    launcher.ensure_shim()


def moments(rng: random.Random) -> list[tuple[str, float]]:
    """(from, seconds): kills spread over mirage's start, the session's and torchrun's start-up,
    and training, each timed from what the run printed (start-up takes 1.5 s on a quiet machine
    and several times that under load, so fixed times from the start land in either phase)."""
    return [("start", rng.uniform(0.2, 0.4)), ("session", rng.uniform(0.0, 0.3)), ("torchrun", rng.uniform(0.0, 0.05)),
            ("training", rng.uniform(0.1, 1.0)), ("training", rng.uniform(1.0, 3.0))]


def session_pids(session: str) -> list[int]:
    """Live processes of the session by mirage's own marks: MIRAGE_SESSION in their environment,
    or the session in their command line (its reaper)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if (f"MIRAGE_SESSION={session}".encode() in (entry / "environ").read_bytes().split(b"\0")
                        or session.encode() in (entry / "cmdline").read_bytes()):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def run_of(directory: Path) -> str | None:
    """The pid in a session folder's run.pid (None once the folder is going)."""
    try:
        return (directory / launcher.RUN_PID_NAME).read_text().split()[0]
    except (OSError, IndexError):
        return None


def session_at_kill(lines: list[str], run_pid: int, watched: WatchedCgroup) -> str | None:
    """The run's session, read before the kill: from its "mirage: session" line, else from the
    folder whose run.pid names the run, else from its reaper's command line (the reaper starts
    before the folder exists). None only if the run had not yet chosen one."""
    announced = next((line.split()[2] for line in lines if line.startswith("mirage: session ")), None)
    folders = [d.name for d in launcher.runtime_root().iterdir() if run_of(d) == str(run_pid)]
    reapers = []
    for pid in watched.processes():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"reap_after_run" in arg for arg in argv):
            reapers.append(Path(argv[-2].decode()).name)
    return announced or next(iter(folders + reapers), None)


def leftovers(session: str | None, run_pid: int, watched: WatchedCgroup) -> list:
    """What the killed run's session left: every process under the test's cgroup (however it was
    started: tests/escapees.py) or marked with the session, its /dev/shm entries, its folder
    (by name or by the run.pid naming the run)."""
    root = launcher.runtime_root()
    found: list = [d for d in root.iterdir() if run_of(d) == str(run_pid) or d.name == session]
    found += sorted(set(watched.processes()) | set(session_pids(session) if session else []))
    if session:
        found += list(Path("/dev/shm").glob(f"mirage-{os.getuid()}-{session}*"))
    return found


def test_sigkill_of_mirage_run_at_random_moments_leaves_nothing():
    rng = random.Random(SEED)
    report = []
    for start_from, delay in moments(rng):
        watched = WatchedCgroup()
        proc = subprocess.Popen([sys.executable, "-m", "mirage", "run", *COMMAND], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=watched.enter)
        started = time.monotonic()
        lines: list[str] = []
        seen = {name: threading.Event() for name in MARKERS}
        training = seen["training"]

        def read(out=proc.stdout, lines=lines, seen=seen) -> None:
            for line in out:
                lines.append(line)
                for name, marker in MARKERS.items():  # training: both ranks' communicators
                    if sum(marker in earlier for earlier in lines) == (2 if name == "training" else 1):
                        seen[name].set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            if start_from != "start":
                assert seen[start_from].wait(120), f"the run never printed {MARKERS[start_from]!r}:\n" + "".join(lines[-30:])
            time.sleep(max(0.0, delay - (time.monotonic() - started)) if start_from == "start" else delay)
            session = session_at_kill(lines, proc.pid, watched)
            at_kill = len(watched.processes() or (session_pids(session) if session else []))
            phase = "training" if training.is_set() else "start-up"
            killed_at = time.monotonic() - started
            proc.send_signal(signal.SIGKILL)
            assert proc.wait() == -signal.SIGKILL
            deadline = time.monotonic() + DRAIN_SECONDS
            while (left := leftovers(session, proc.pid, watched)) and time.monotonic() < deadline:
                time.sleep(0.1)
            drained = time.monotonic() - started - killed_at
        finally:
            if proc.poll() is None:  # a failed round: its run is still up
                proc.kill()
                proc.wait()
            watched.remove()
        reader.join(timeout=5)
        report.append(f"killed at {killed_at:5.2f} s ({start_from} + {delay:.2f} s, "
                      f"{phase}, {at_kill} processes with its reaper): "
                      f"{len(left)} leftovers after {drained:.2f} s")
        print(report[-1])
        assert left == [], f"{report[-1]}: {left}\n" + "".join(lines[-20:])
    assert sum("training," in line for line in report) >= 2 and sum("start-up," in line for line in report) >= 2
