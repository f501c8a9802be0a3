"""Leftover checks that do not reuse mirage's own rule for finding a session's processes.

mirage's teardown, reaper and `mirage cleanup` find processes by MIRAGE_SESSION in their
environment, by descent from the run, or in the session's cgroup. A test that asked the same
questions would check mirage against itself, so these helpers find processes two other ways:

* the workload records the pid (and start time) of every process it starts, among them one with an
  empty environment in a session of its own (`env -i setsid`) and an orphan whose parent exited;
* where a cgroup v2 can be made, the test starts `mirage run` in a cgroup the test owns, and
  every process under it (its sub-cgroups included) counts, however it was started.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from pathlib import Path

# The workload's shell records itself, a process with an empty environment that leads a session
# of its own, and an orphan (its subshell exits at once), then waits until it is killed.
HIDING = ('echo "$$ $(cut -d" " -f22 /proc/$$/stat)" >> "$0"\n'
          "env -i setsid sh -c 'echo \"$$ $(cut -d\" \" -f22 /proc/$$/stat)\" >> \"$0\"; exec sleep 1000' \"$0\" &\n"
          "(sh -c 'echo \"$$ $(cut -d\" \" -f22 /proc/$$/stat)\" >> \"$0\"; exec sleep 1000' \"$0\" &)\n"
          "exec sleep 1000\n")
HIDING_COUNT = 3  # processes HIDING records


def hiding_workload(record: Path) -> list[str]:
    """The command (after `mirage run ... --`) of a workload that hides processes from mirage."""
    return ["sh", "-c", HIDING, str(record)]


def hiding_then(record: Path, command: list[str]) -> list[str]:
    """A workload that hides processes as hiding_workload's does (HIDING_COUNT recorded in `record`:
    its shell, then `command` exec'd in the same process) and then runs `command`, whose exit code
    is the workload's."""
    return ["sh", "-c", HIDING.removesuffix("exec sleep 1000\n") + 'exec "$@"\n', str(record), *command]


def recorded(record: Path, count: int, alive: "subprocess.Popen") -> list[tuple[int, str]]:
    """(pid, start time) of the `count` processes the workload recorded, once it has (polls the
    file, which is written by the processes themselves; fails if `alive` ends first)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and alive.poll() is None:
        lines = record.read_text().splitlines() if record.exists() else []
        if len(lines) >= count:
            return [(int(pid), started) for pid, started in (line.split() for line in lines)]
        time.sleep(0.05)
    raise AssertionError(f"the workload recorded fewer than {count} processes: "
                         f"{record.read_text() if record.exists() else 'nothing'}")


def still_running(processes: list[tuple[int, str]]) -> list[int]:
    """Those of the recorded processes still running: the same pid and start time, not a zombie."""
    running = []
    for pid, started in processes:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[19] == started and fields[0] not in "ZX":
            running.append(pid)
    return running


def _cgroup2_root() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            own = next(entry[3:] for entry in Path("/proc/self/cgroup").read_text().splitlines()
                       if entry.startswith("0::"))
            return Path(fields[0].split()[4]) / own.strip().lstrip("/")
    return None


class WatchedCgroup:
    """A cgroup the test owns (None of it where none can be made): `mirage run` starts in it, so
    whatever the run starts is under it until it ends."""

    def __init__(self) -> None:
        root = _cgroup2_root()
        self.path: Path | None = None
        if root is not None:
            path = root / f"mirage-test-{secrets.token_hex(4)}"
            try:
                path.mkdir()
                self.path = path
            except OSError:
                pass

    def enter(self) -> None:
        """Popen's preexec_fn: the child joins the cgroup before it runs anything."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text("0")

    def processes(self) -> list[int]:
        """Running processes anywhere under the cgroup."""
        if self.path is None:
            return []
        found = []
        for folder, _, _ in os.walk(self.path):
            try:
                pids = (Path(folder) / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                        found.append(int(pid))
                except OSError:
                    pass
        return found

    def remove(self) -> None:
        """Kills what is left under it (a failed test's) and removes it, deepest first."""
        if self.path is None:
            return
        for pid in self.processes():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for folder, _, _ in sorted(os.walk(self.path), key=lambda walked: -len(walked[0])):
            while Path(folder).is_dir():
                try:
                    Path(folder).rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
