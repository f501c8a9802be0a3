"""Finds every process a session started, whatever it did to its environment or session.

MIRAGE_SESSION in a process's environment is how mirage used to find its session's processes,
and a workload can scrub it (`env -i`, a daemon that clears its environment), so two more ways,
neither of which the workload controls:

* A cgroup v2 of the session's own, where one can be made (root, or a delegated subtree): `mirage
  run` moves itself into `<its cgroup>/mirage-<uid>-<session>` before it starts anything, so every
  process of the session is born in it, and `setsid`, double forks and an empty environment leave
  it there. Its path is written to the session folder (CGROUP_FILE) for the reaper and `mirage
  cleanup`, which kill what its cgroup.procs lists and remove it.
* The run's descendants: the run is a child subreaper, so a process whose parent ended is
  re-parented to it and stays its descendant until the run ends; teardown kills them all.

Without a cgroup, a process that scrubbed MIRAGE_SESSION and whose run was SIGKILLed (re-parented
to init, no descendant of anything mirage knows) is not found.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

CGROUP_FILE = "cgroup"  # in the session folder: the session's cgroup, if it has one
KILL_SECONDS = 10.0  # for processes forking as they are killed, until none is left


def _cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a
    hybrid host), from /proc/self/mountinfo; None if it is not."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            return Path(fields[0].split()[4])
    return None


def session_cgroup(session_id: str) -> Path | None:
    """Where the session's cgroup is, or would be: under the cgroup this process is in. The run
    and its reaper (started before the run moved) compute the same path."""
    mount = _cgroup2_mount()
    if mount is None:
        return None
    try:
        own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    return mount / own.strip().lstrip("/") / f"mirage-{os.getuid()}-{session_id}"


def enter_session_cgroup(session_id: str, session_dir: Path) -> Path | None:
    """Moves this process into a new cgroup for the session, under the one it is in, and records
    it in the session folder; None (and no cgroup) where that is not allowed."""
    cgroup = session_cgroup(session_id)
    if cgroup is None:
        return None
    try:
        cgroup.mkdir()
    except OSError:
        return None
    try:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        cgroup.rmdir()
        return None
    (session_dir / CGROUP_FILE).write_text(str(cgroup))
    return cgroup


def recorded_cgroup(session_dir: Path) -> Path | None:
    """The session's cgroup as its run recorded it (None if it had none, or it is gone)."""
    try:
        cgroup = Path((session_dir / CGROUP_FILE).read_text())
    except OSError:
        return None
    return cgroup if cgroup.is_dir() else None


def _state_and_parent(pid: int | str) -> tuple[str, int] | None:
    """The state letter and parent pid /proc/<pid>/stat gives (None once the process is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie is gone but for its parent's wait)."""
    state = _state_and_parent(pid)
    return state is not None and state[0] not in "ZX"


def cgroup_members(cgroup: Path | None) -> list[int]:
    """The running processes in the cgroup, this one excepted."""
    if cgroup is None:
        return []
    try:
        listed = (cgroup / "cgroup.procs").read_text().split()
    except OSError:
        return []
    return [int(pid) for pid in listed if int(pid) != os.getpid() and _running(int(pid))]


def descendants(ancestor: int) -> list[int]:
    """Running descendants of `ancestor`, from the parent each /proc/<pid>/stat names."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (state := _state_and_parent(entry.name)) is not None:
            children.setdefault(state[1], []).append(int(entry.name))
    found, pending = [], list(children.get(ancestor, []))
    while pending:
        pid = pending.pop()
        if _running(pid):
            found.append(pid)
        pending.extend(children.get(pid, []))
    return found


def kill_until_gone(find) -> None:
    """SIGKILLs what `find()` lists until it lists nothing (a process may fork while it is being
    killed), for at most KILL_SECONDS."""
    deadline = time.monotonic() + KILL_SECONDS
    while (pids := find()) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def remove_cgroup(cgroup: Path | None) -> None:
    """Removes the session's cgroup once its processes have left it (an exiting process may
    hold it busy for a moment)."""
    if cgroup is None:
        return
    deadline = time.monotonic() + KILL_SECONDS
    while cgroup.is_dir():
        try:
            cgroup.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
