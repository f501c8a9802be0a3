"""Commands that act on sessions from outside: ps, smi, exec, cleanup, paths; and the reaper.

A session is found by its socket (`<runtime root>/<session id>/mirage.sock`): one that answers
a status request is live. A run that dies without its teardown (SIGKILL, the OOM killer) is
followed by its reaper (reap_after_run), which removes what the session left once its processes
are gone. Should the reaper die too, a session directory whose socket does not answer AND whose
`mirage run` process (named in its run.pid) is gone is what `mirage cleanup`, and every mirage
command before it does anything else, reclaims (its stranded processes, found by the
MIRAGE_SESSION in their environment, its /dev/shm segments, its directory). The run's pid keeps
an `--in-process` session (no service) and a service too busy to answer in time from being taken
for dead, and a folder its run has not named yet (a run just starting) is left alone for
STARTING_GRACE_SECONDS.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from mirage import unix_sockets
from mirage.daemon import shared_table
from mirage.daemon.protocol import SOCKET_NAME
from mirage.daemon.service import request
from mirage.launcher import containers, containment, nodes
from mirage.launcher.run import RUN_PID_NAME, process_start_time, runtime_root
from mirage.launcher.supervisor import session_processes
from mirage.shim.build import cache_root


class SessionError(Exception):
    """No session, or not the one asked for (exit code 1); the message names the fix."""


def live_sessions() -> list[dict]:
    """Status of every session whose service answers, oldest first."""
    found = []
    for directory in sorted(runtime_root().iterdir()):
        socket_path = directory / SOCKET_NAME
        if socket_path.exists():
            try:
                found.append(request(socket_path, {"op": "status"}, timeout=2.0))
            except (OSError, ValueError):
                continue
    return found


def pick(session_id: str | None) -> dict:
    """The named live session, or the only/latest one."""
    sessions = live_sessions()
    if session_id:
        for status in sessions:
            if status["session"] == session_id:
                return status
        raise SessionError(f"no run is serving session {session_id}; `mirage ps` lists live sessions")
    if not sessions:
        raise SessionError("no live mirage session; start one with `mirage run ...`")
    return sessions[-1]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def ps_table(sessions: list[dict]) -> str:
    rows = [("SESSION", "RUN PID", "PROFILE", "NODES x GPUS", "PROCESSES", "UPTIME")]
    for s in sessions:
        rows.append((s["session"], str(s["run_pid"]), s["profile"], f"{s['num_nodes']} x {s['gpus_per_node']}",
                     str(len(s["processes"])), f"{time.time() - s['started']:.0f} s"))
    return _table(rows)


def smi_table(status: dict) -> str:
    header = (f"mirage smi - session {status['session']} ({status['profile']}, "
              f"{status['num_nodes']} node(s) x {status['gpus_per_node']} GPUs)")
    rows = [("NODE", "GPU", "NAME", "UTIL", "POWER", "TEMP", "MEMORY USED / TOTAL", "PROCESSES (pid:rank)")]
    for g in status["gpus"]:
        users = " ".join(f"{p['pid']}:{p['rank'] if p['rank'] is not None else '-'}" for p in g["processes"]) or "-"
        power = f"{g['power_watts']} W" if g.get("power_watts") is not None else "-"
        rows.append((str(g["node"]), str(g["gpu"]), g["name"], f"{g['utilization_percent']}%", power,
                     f"{g['temperature_c']} C", f"{_size(g['used_bytes'])} / {_size(g['total_bytes'])}", users))
    ranks = [("RANK", "PID", "NODE", "LAST COLLECTIVE")]
    for p in status["processes"]:
        ranks.append((str(p["rank"]) if p["rank"] is not None else "-", str(p["pid"]), str(p["node"]),
                      p["last_collective"] or "-"))
    return "\n".join([header, _table(rows), "", _table(ranks)])


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def smi(session_id: str | None, as_json: bool, watch: float | None) -> int:
    while True:
        status = pick(session_id)
        if as_json:
            print(json.dumps(status, indent=2))
        else:
            if watch:
                print("\033[2J\033[H", end="")
            print(smi_table(status), flush=True)
        if not watch:
            return 0
        time.sleep(watch)


def exec_in_session(session_id: str | None, node: int, command: list[str]) -> int:
    """Runs `command` with a node's identity in a live session, holding it open meanwhile."""
    import socket as socket_module

    status = pick(session_id)
    socket_path = runtime_root() / status["session"] / SOCKET_NAME
    lease = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    unix_sockets.connect(lease, socket_path)
    lease.sendall((json.dumps({"op": "exec", "node": node}) + "\n").encode())
    reply = json.loads(lease.makefile().readline())
    if "error" in reply:
        lease.close()
        raise SessionError(reply["error"])
    try:
        env = reply["env"]
        target = env.pop(nodes.EXEC_TARGET, None)  # an isolated node: enter its namespaces
        child = subprocess.Popen(nodes.enter_argv(int(target), command) if target else command, env=env)
    except FileNotFoundError:
        lease.close()
        raise SessionError(f"command not found: {command[0]}") from None
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    lease.close()
    return 128 - code if code < 0 else code


# A run creates its session folder and then names itself in run.pid; another mirage command
# starting in between (every command first reclaims dead sessions) must not take the folder for a
# dead session's. A folder not yet named is left alone this long after it was made.
STARTING_GRACE_SECONDS = 60.0


def _run_alive(session_dir: Path) -> bool:
    """Whether the session's `mirage run` lives (or is still starting: its folder not yet named)."""
    try:
        pid, started = (session_dir / RUN_PID_NAME).read_text().split()
    except (OSError, ValueError):  # no run.pid yet, or one being written
        try:
            return time.time() - session_dir.stat().st_mtime < STARTING_GRACE_SECONDS
        except OSError:
            return False
    try:
        return process_start_time(int(pid)) == started
    except (OSError, ValueError):
        return False


def stale_sessions() -> list[Path]:
    """Session directories whose run is gone."""
    stale = []
    for directory in sorted(runtime_root().iterdir()):
        if _run_alive(directory):
            continue
        socket_path = directory / SOCKET_NAME
        try:
            request(socket_path, {"op": "status"}, timeout=2.0)
        except (OSError, ValueError):
            stale.append(directory)
    return stale


REAPER_GRACE_SECONDS = 2.0  # for the session's processes to exit on their own ("mirage daemon died")


def reap_after_run(session_dir: Path) -> None:
    """The session's reaper (supervisor.start_reaper): waits for the run process to end (the end
    of its pipe, on stdin), then for the session's processes, killing those still there after a
    grace period (ranks leave at once when the service dies; a process that never attached
    would not), and only then removes the session's directory and /dev/shm segments, when no
    process is left to write them. After a run that tore down itself, nothing is left to find."""
    while os.read(0, 4096):
        pass
    session_id = session_dir.name
    cgroup = containment.session_cgroup(session_id)  # the run's, if it could make it

    def remaining() -> list[int]:
        return sorted(set(session_processes(session_id) + containment.cgroup_members(cgroup)))

    grace = time.monotonic() + REAPER_GRACE_SECONDS
    while remaining() and time.monotonic() < grace:
        time.sleep(0.1)
    containment.kill_until_gone(remaining)
    containment.remove_cgroup(cgroup)
    containers.remove_containers(session_dir)  # --image: what podman still lists of the session
    shutil.rmtree(session_dir, ignore_errors=True)
    for segment in shared_table.segments(session_id):
        shared_table.remove(segment)


def _reclaimable() -> list[tuple[str, object]]:
    """What runs that died (SIGKILL, the OOM killer) and whose reaper died too left: their
    processes, session folders and /dev/shm segments. A session counts as alive while its
    `mirage run` process is (the run's pid and start time), so an --in-process session, which
    has no service, is never touched."""
    actions: list[tuple[str, object]] = []
    stale_ids = {d.name for d in stale_sessions()}
    for session_id in sorted(stale_ids):
        directory = runtime_root() / session_id
        cgroup = containment.recorded_cgroup(directory)
        for pid in sorted(set(session_processes(session_id) + containment.cgroup_members(cgroup))):
            actions.append((f"kill process {pid} (session {session_id})", lambda pid=pid: os.kill(pid, signal.SIGKILL)))
        if cgroup is not None:
            actions.append((f"remove the cgroup {cgroup}", lambda c=cgroup: containment.remove_cgroup(c)))
        if (directory / containers.CONTAINERS_FILE).exists():
            actions.append((f"remove the containers of session {session_id} (podman rm -f)",
                            lambda d=directory: containers.remove_containers(d)))
        actions.append((f"remove {directory}", lambda d=directory: shutil.rmtree(d, ignore_errors=True)))
    for segment in sorted(shared_table.SHM_DIR.glob(f"{shared_table.PREFIX}{os.getuid()}-*")):
        # mirage-<uid>-<session>.collectives-<id> (or .ipc-...; the table of an older mirage)
        session_id = segment.name.split("-", 2)[2].split(".", 1)[0]
        directory = runtime_root() / session_id
        if session_id in stale_ids or not directory.is_dir() or not _run_alive(directory):
            actions.append((f"remove {segment}", lambda t=segment: shared_table.remove(t)))
    # a session cgroup whose removal failed (a process still exiting) while its folder went:
    # found next to where this process would put one, removed once no process is in it
    here = containment.session_cgroup("")
    for cgroup in sorted(here.parent.glob(f"{here.name}*") if here is not None else []):
        directory = runtime_root() / cgroup.name.removeprefix(here.name)
        if cgroup.is_dir() and not directory.is_dir() and not containment.cgroup_members(cgroup):
            actions.append((f"remove the cgroup {cgroup}", lambda c=cgroup: containment.remove_cgroup(c)))
    return actions


def cleanup(dry_run: bool) -> int:
    """`mirage cleanup`: reclaims what SIGKILLed runs left, saying what; never touches a live session."""
    actions = _reclaimable()
    if not actions:
        print("mirage cleanup: nothing to reclaim")
        return 0
    for description, act in actions:
        print(("would " if dry_run else "") + description)
        if not dry_run:
            try:
                act()
            except OSError as err:
                print(f"  failed: {err}", file=sys.stderr)
    return 0


def reap_dead_sessions() -> None:
    """Every mirage command starts with this: what a dead session left goes without anyone
    having to run `mirage cleanup`."""
    for _, act in _reclaimable():
        try:
            act()
        except OSError:
            pass


def paths(as_json: bool) -> int:
    found = {"runtime": str(runtime_root()), "cache": str(cache_root()), "shared_memory": str(shared_table.SHM_DIR)}
    if as_json:
        print(json.dumps(found, indent=2))
    else:
        for key, value in found.items():
            print(f"{key:14} {value}")
    return 0
