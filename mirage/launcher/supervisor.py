"""Starts the workload processes of a session, forwards signals, and leaves nothing behind.

Each workload process leads its own process group, so a signal reaches everything it started
(torchrun workers, multiprocessing children) with one killpg. mirage also becomes a child
subreaper: anything that escapes its group (setsid, double fork) is re-parented to mirage
and is found at teardown as its descendant, or in the session's cgroup (containment), whatever
its environment says.

The interrupt ladder (SIGINT, SIGTERM and SIGHUP all count toward it):
  1st: forwarded to the workload as the signal that arrived;
  2nd: SIGTERM to the workload, then SIGKILL after a grace period;
  3rd: SIGKILL at once.
SIGUSR1/SIGUSR2 are forwarded and never count. Every step is narrated on stderr.
"""

from __future__ import annotations

import ctypes
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mirage.launcher import containment

TERMINATE_GRACE_SECONDS = 5.0
LINE_LIMIT = 1 << 20  # a line with no newline is flushed at 1 MiB
_PR_SET_CHILD_SUBREAPER = 36
LADDER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class Supervisor:
    """Owns the workload processes of one session, from start to the last reaped child."""

    session_id: str
    narrate: Callable[[str], None]
    children: list[subprocess.Popen] = field(default_factory=list)
    labels: dict[int, str] = field(default_factory=dict)  # pid -> rank label
    pumps: list[threading.Thread] = field(default_factory=list)
    _output_lock: threading.Lock = field(default_factory=threading.Lock)
    ladder_step: int = 0
    kill_deadline: float | None = None
    _terminal_fd: int | None = None
    forced_exit_code: int | None = None
    exit_codes: dict[str, int] = field(default_factory=dict)  # label -> shell exit code
    # How each process was started (argv, env, cwd, label), so a node killed on purpose can rejoin.
    commands: dict[int, tuple[list[str], dict[str, str], str | None, str | None]] = field(default_factory=dict)
    spared: set[int] = field(default_factory=set)  # killed on purpose (kill-node): the others go on
    rejoins_pending: int = 0  # nodes killed on purpose that will be started again

    def arm_signals(self) -> None:
        """Installs the handlers; called before bring-up so no signal falls through."""
        for sig in LADDER_SIGNALS:
            signal.signal(sig, self._on_ladder_signal)
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._on_forwarded_signal)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None, *,
              label: str | None = None) -> subprocess.Popen:
        """Starts one workload process in a process group of its own.

        Without a `label` the process inherits the terminal (stdin, stdout, stderr) and becomes
        the terminal's foreground group, so a REPL works and Ctrl-C reaches it directly, as
        without mirage. With a label (multi-process jobs) its output is printed line by line
        prefixed with `[label] `, stdout and stderr kept apart, and it gets no stdin.
        """
        if label is None:
            child = subprocess.Popen(argv, env=env, cwd=cwd, process_group=0)
            if sys.stdin.isatty():
                self._terminal_fd = sys.stdin.fileno()
                self._hand_terminal_to(child.pid)
        else:
            child = subprocess.Popen(argv, env=env, cwd=cwd, process_group=0, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            prefix = f"[{label}] ".encode()
            for pipe, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
                pump = threading.Thread(target=self._pump, args=(pipe, sink, prefix), daemon=True)
                pump.start()
                self.pumps.append(pump)
            self.labels[child.pid] = label
        self.commands[child.pid] = (argv, env, cwd, label)
        self.children.append(child)
        return child

    def spare(self, pids: list[int], rejoin: bool) -> None:
        """These processes are killed on purpose (a node that fails, --fault kill-node): their end
        does not stop the rest of the job, as a node's reboot does not stop the other nodes; with
        `rejoin`, the node will be started again (rejoin_node), so the job waits for it."""
        self.spared.update(pids)
        if rejoin:
            self.rejoins_pending += 1

    def rejoin_node(self, node: int) -> None:
        """Starts again the command of emulated node `node` that was killed on purpose (not once
        the job is being stopped)."""
        stopping = self.kill_deadline is not None or self.forced_exit_code is not None
        for pid, (argv, env, cwd, label) in list(self.commands.items()):
            if not stopping and pid in self.spared and env.get("MIRAGE_NODE_RANK") == str(node):
                self.start(argv, env, cwd, label=label)
        self.rejoins_pending -= 1

    def _pump(self, pipe, sink, prefix: bytes) -> None:
        """Copies one child's stream to ours a line at a time, each line prefixed. When the
        reader of ours goes away (`mirage run ... | head -1`), the job ends as a pipeline does
        on SIGPIPE: the workload is stopped, teardown runs, and mirage exits 141."""
        for line in iter(lambda: pipe.readline(LINE_LIMIT), b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with self._output_lock:
                if not write_or_discard(sink, prefix + line) and self.forced_exit_code is None:
                    self.narrate("the reader of the workload's output went away (broken pipe); "
                                 "stopping the workload")
                    self.abort(128 + signal.SIGPIPE)
        pipe.close()

    def wait(self) -> int:
        """Waits for every child; returns the first failing exit code (as a shell reports it).

        When one process fails, the others are stopped: a job with a dead rank cannot finish;
        except a node killed on purpose (spare), whose peers must find out for themselves.
        """
        exit_code = 0
        reaped: set[int] = set()
        while True:
            # a node that rejoins adds a child meanwhile
            pending = [child for child in self.children if child.pid not in reaped]
            if not pending and not self.rejoins_pending:
                break
            for child in list(pending):
                if child.poll() is not None:
                    pending.remove(child)
                    reaped.add(child.pid)
                    code = shell_exit_code(child.returncode)
                    self.exit_codes[self.labels.get(child.pid, "0")] = code
                    if child.pid in self.spared:
                        continue
                    if code and not exit_code and self.forced_exit_code is None:
                        exit_code = code
                        if pending and self.kill_deadline is None:
                            who = self.labels.get(child.pid, str(child.pid))
                            self.narrate(f"[{who}] exited with code {code}; stopping the other processes")
                            self.signal_all(signal.SIGTERM)
                            self.kill_deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
            if pending or self.rejoins_pending:
                if self.kill_deadline is not None and time.monotonic() >= self.kill_deadline:
                    self.narrate("workload still running after SIGTERM; sending SIGKILL")
                    self.signal_all(signal.SIGKILL)
                    self.kill_deadline = None
                time.sleep(0.05)
        for pump in self.pumps:
            pump.join(timeout=5)
        return self.forced_exit_code if self.forced_exit_code is not None else exit_code

    def abort(self, exit_code: int) -> None:
        """Ends the job with `exit_code` (a diagnosis, not a workload failure, decided it)."""
        self.forced_exit_code = exit_code
        self.signal_all(signal.SIGTERM)
        self.kill_deadline = time.monotonic() + TERMINATE_GRACE_SECONDS

    def signal_all(self, sig: int) -> None:
        for child in self.children:
            try:
                os.killpg(child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def teardown(self) -> None:
        """Kills and reaps whatever the workload left: its groups and any session stragglers."""
        if self._terminal_fd is not None:
            self._hand_terminal_to(os.getpgrp())
        self.signal_all(signal.SIGKILL)
        for pid in session_processes(self.session_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in self.children:
            if child.returncode is None:
                child.wait()
        _reap_adopted()

    def kill_the_rest(self, cgroup: Path | None) -> None:
        """The end of teardown, once the fork server and the node holders are stopped: kills what
        is still running of the session however it hid (an empty environment, `setsid`): the
        session cgroup's processes and this process's descendants (containment)."""
        containment.kill_until_gone(lambda: containment.descendants(os.getpid()) + containment.cgroup_members(cgroup))
        _reap_adopted()

    def _hand_terminal_to(self, pgid: int) -> None:
        previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(self._terminal_fd, pgid)
        except OSError:
            pass
        finally:
            signal.signal(signal.SIGTTOU, previous)

    def _on_ladder_signal(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        self.ladder_step += 1
        if self.ladder_step == 1:
            self.narrate(f"received {name}: forwarding it to the workload "
                         "(again to terminate, a third time to kill)")
            self.signal_all(signum)
        elif self.ladder_step == 2:
            self.narrate(f"received {name} again: terminating the workload "
                         f"(SIGTERM now, SIGKILL in {TERMINATE_GRACE_SECONDS:g} s)")
            self.signal_all(signal.SIGTERM)
            self.kill_deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
        else:
            self.narrate(f"received {name} a third time: killing the workload (SIGKILL)")
            self.signal_all(signal.SIGKILL)

    def _on_forwarded_signal(self, signum: int, _frame) -> None:
        self.narrate(f"forwarding {signal.Signals(signum).name} to the workload")
        self.signal_all(signum)


def write_or_discard(stream, data: bytes) -> bool:
    """Writes and flushes; False if the stream's reader is gone, which from then on points the
    stream at /dev/null, so later writes (and Python's flush at exit) succeed and go nowhere."""
    try:
        stream.buffer.write(data)
        stream.flush()
        return True
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
        return False


def stdin_has_input() -> bool:
    """Whether something was piped or redirected into our stdin (that no rank will read)."""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or (stat.S_ISREG(mode) and os.fstat(sys.stdin.fileno()).st_size > 0)


def shell_exit_code(returncode: int) -> int:
    """A child's status as a shell reports it: the code masked to a byte, 128+N for signal N."""
    return 128 - returncode if returncode < 0 else returncode & 0xFF


def session_processes(session_id: str) -> list[int]:
    """PIDs of live processes that carry MIRAGE_SESSION=<session_id> (excluding this one)."""
    marker = f"MIRAGE_SESSION={session_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


REAPER = ("import sys; from pathlib import Path; from mirage.launcher.sessions import reap_after_run; "
          "reap_after_run(Path(sys.argv[1]))")


def start_reaper(session_dir: Path) -> None:
    """Starts the session's reaper (sessions.reap_after_run), which removes what the session left
    if this process dies without its teardown (SIGKILL, the OOM killer).

    It reads a pipe whose only writer is this process, so the pipe's end tells it this process is
    gone, however it ended. Called before this process becomes a subreaper: a middle process that
    exits at once hands the reaper to init, so teardown, collecting its orphans, never waits on
    it. It leads a session of its own (the terminal's signals do not reach it), holds none of our
    files but the pipe (a reader of our output still sees its end), and carries no MIRAGE_SESSION
    (teardown's search for stragglers passes it by)."""
    read_end, _write_end = os.pipe()  # the write end stays open, never written, until we end
    middle = os.fork()
    if middle == 0:
        try:
            subprocess.Popen([sys.executable, "-c", REAPER, str(session_dir)], stdin=read_end,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        finally:
            os._exit(0)
    os.close(read_end)
    os.waitpid(middle, 0)


def _reap_adopted(timeout: float = 2.0) -> None:
    """Collects the killed orphans re-parented to us as subreaper, so none stays a zombie."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)
