"""The hand-over, in mirage's sitecustomize: this process gives its program to the fork server
and stays behind as its waiter.

The waiter is what this process's parent sees: it forwards every signal it gets to the child's
process group, ends when the child ends, with its exit code, or dies by the same signal. When
the waiter is killed outright (SIGKILL), the server sees its connection close and kills the
child's group. It closes every fd it handed over but stderr (kept to report a lost server), so
a pipe's reader sees its end when the child closes it.

Anything that keeps the hand-over from being exact (interpreter.py; the server refuses another
interpreter, or one started with options it cannot take on) leaves the process to go on
starting normally.

Every Python process of a session runs this before its program, so it imports built-in modules
only: `_socket`, `_signal` and `marshal` rather than socket, signal and json, which bring re,
enum and selectors (15 ms a process; for 64 ranks on 2 cores, a second of start-up).
"""

from __future__ import annotations

import _signal
import _socket
import marshal
import os
import resource
import sys

from mirage import unix_sockets
from mirage.forkserver import SOCKET_ENV, interpreter

REPLY_TIMEOUT_SECONDS = 120.0  # the server imports torch before it answers; a loaded machine is slow
# How long a child whose server died may take to stop by itself before its waiter kills it: a
# rank notices the session's end in milliseconds, on a loaded machine in well under this.
LOST_SERVER_GRACE_SECONDS = 2.0
# Faults a waiter could raise itself: left at their defaults so such a fault is not swallowed.
_NOT_FORWARDED = {_signal.SIGKILL, _signal.SIGSTOP, _signal.SIGCHLD, _signal.SIGSEGV, _signal.SIGBUS,
                  _signal.SIGFPE, _signal.SIGILL, _signal.SIGTRAP, _signal.SIGSYS}


def hand_off() -> None:
    """Hands this process over to the session's fork server, if it has one and the hand-over
    can be exact; returns (a normal start) otherwise, and never returns once handed over."""
    path = os.environ.get(SOCKET_ENV)
    if not path or "torch" in sys.modules or _stdin_is_terminal():
        return  # a terminal's reader must be in its foreground group, which the child is not
    program = interpreter.describe(sys.orig_argv, sys.argv, sys.flags)
    if program is None:
        return
    connection = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    try:
        connection.settimeout(REPLY_TIMEOUT_SECONDS)
        unix_sockets.connect(connection, path)
        fds = _open_fds(connection.fileno())
        # Sent at once, while the server may still be importing torch: it checks the
        # interpreter itself, and finds every waiting request together when it is ready.
        request = {
            "interpreter": interpreter.identity(),
            "program": vars(program), "orig_argv": sys.orig_argv, "sys_path": sys.path,
            "env": dict(os.environ), "cwd": os.getcwd(), "umask": _umask(),
            "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in _rlimit_names()},
            "ignored_signals": [int(s) for s in _signal.valid_signals() if _ignored(s)],
            "blocked_signals": [int(s) for s in _signal.pthread_sigmask(_signal.SIG_BLOCK, [])],
            "stdio": interpreter.describe_stdio(),
            "fds": [[fd, os.get_inheritable(fd)] for fd in fds],
            "waiter_pid": os.getpid(), "parent_pid": os.getppid(),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
        }
        rights = b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds)  # an int array, as SCM_RIGHTS takes
        connection.sendmsg([marshal.dumps(request)], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
        reply = marshal.loads(connection.recv(1 << 16) or marshal.dumps(None))
    except (OSError, ValueError, EOFError, TypeError):  # marshal: another interpreter's bytes
        connection.close()
        return  # no server: start normally
    if not isinstance(reply, dict) or "pid" not in reply:
        connection.close()
        return  # refused (another interpreter or its options, or no process left): start normally
    connection.settimeout(None)
    try:
        _wait(connection, reply["pid"], fds)
    finally:  # the program runs in the child: the waiter must never go on to run it too
        os._exit(1)


def _stdin_is_terminal() -> bool:
    try:
        return os.isatty(0)
    except OSError:
        return False


def _open_fds(connection_fd: int) -> list[int]:
    """This process's open fds (what it inherited), but the connection."""
    fds = []
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd == connection_fd:
            continue
        try:
            os.fstat(fd)
        except OSError:
            continue  # the listing's own fd, closed by now
        fds.append(fd)
    return sorted(fds)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _rlimit_names() -> list[str]:
    return [name for name in dir(resource) if name.startswith("RLIMIT_")]


def _ignored(sig: int) -> bool:
    try:
        return _signal.getsignal(sig) == _signal.SIG_IGN
    except ValueError:
        return False


def _wait(connection: _socket.socket, child: int, handed_over: list[int]) -> None:
    """The waiter: forwards signals to the child's group until the server reports its end,
    then ends the same way."""
    def forward(signum: int, _frame) -> None:
        try:
            os.killpg(child, signum)
        except (ProcessLookupError, PermissionError):
            pass

    for sig in _signal.valid_signals():
        if sig not in _NOT_FORWARDED and not _ignored(sig):
            try:
                _signal.signal(sig, forward)
            except (OSError, ValueError):
                pass
    for fd in handed_over:
        if fd != 2:
            os.close(fd)
    try:
        reply = connection.recv(1 << 16)
    except OSError:
        reply = b""
    if not reply:
        _end_without_server(child)
    code = os.waitstatus_to_exitcode(marshal.loads(reply)["status"])
    if code < 0:
        _die_by(-code)
    os._exit(code)


def _end_without_server(child: int) -> None:
    """The server is gone, so the child's end can no longer be reported: the waiter ends, and
    kills the child's group. Not at once: the server dies with the run (its PR_SET_PDEATHSIG),
    as does the session's service, and the child then stops by itself, with last words that
    name the service's death (mirage/runtime/session.py); killed at once it would die silent."""
    import select  # not built-in, but only this rare path needs it

    try:
        ended = select.select([os.pidfd_open(child)], [], [], LOST_SERVER_GRACE_SECONDS)[0]
    except OSError:  # the child is gone already
        ended = True
    try:
        os.killpg(child, _signal.SIGKILL)  # what is left of its group, or the child itself
    except (ProcessLookupError, PermissionError):
        pass
    if not ended:
        try:  # stderr may be a pipe to the run that died
            os.write(2, f"mirage: the fork server ended before process {child} did; it was killed. "
                        "Fix: rerun; `mirage run --no-fork-server` starts every process on its own.\n".encode())
        except OSError:
            pass
    os._exit(1)


def _die_by(signum: int) -> None:
    """Ends this process by `signum`, as its child ended, so the parent sees the same status."""
    if signum not in (_signal.SIGKILL, _signal.SIGSTOP):  # those two have no handler to reset
        _signal.signal(signum, _signal.SIG_DFL)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is not to end the process
