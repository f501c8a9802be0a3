"""Attaches a workload process to its session's service (see mirage/daemon/service.py).

The connection stays open for the life of the process: it is the registration, and if it
closes from the far end the service is gone, so this process stops at once ("mirage daemon
died") rather than hang in a collective no peer will ever join.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys

from mirage import unix_sockets
from mirage.daemon.protocol import STACK_SIGNAL, stack_path
from mirage.runtime import unprofiled

_connection: socket.socket | None = None
_stack_file = None  # where this rank's stacks go when the service asks (hang reports)


def _arm_stack_dumps() -> None:
    global _stack_file
    session_dir = os.environ.get("MIRAGE_RUNTIME")
    if not session_dir:
        return
    try:
        _stack_file = open(stack_path(session_dir, os.getpid()), "w")
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        _stack_file = None


def _death_notice(reason: str) -> str:
    return (f"mirage: mirage daemon died ({reason}); stopping pid {os.getpid()} "
            f"(rank {os.environ.get('RANK', '-')}). Fix: rerun the job; `mirage cleanup` reclaims leftovers.")


def _die(reason: str) -> None:
    try:  # our output may go to the dead run process: a broken pipe must not stop the exit
        sys.stdout.flush()
        print(_death_notice(reason), file=sys.stderr, flush=True)
    except Exception:
        pass
    finally:
        os._exit(1)


def attach() -> None:
    """Registers this process with the session service, if the session has one."""
    global _connection
    path = os.environ.get("MIRAGE_SOCKET")
    if not path or _connection is not None:
        return
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        unix_sockets.connect(connection, path)
    except OSError:
        _die(f"nothing answers on {path}")
    rank = None if os.environ.get("MIRAGE_EXEC") else os.environ.get("RANK")
    hello = {"op": "hello", "pid": os.getpid(), "rank": int(rank) if rank is not None else None,
             "node": int(os.environ.get("MIRAGE_NODE_RANK", "0"))}
    connection.sendall((json.dumps(hello) + "\n").encode())
    _connection = connection
    _arm_stack_dumps()
    # The service never sends anything: only its end closing wakes the watch. A thread of the
    # shim's, not a Python thread, whose frames the program's profiler would list.
    reason = "its socket closed"
    unprofiled.watch_connection(connection.fileno(), lambda: _die(reason), _death_notice(reason) + "\n")


def connection_fd() -> int | None:
    """The session connection's file descriptor, where the emulated NCCL backend writes its
    flight-recorder lines (mirage/nccl/flight_recorder.cpp); None outside a session."""
    return _connection.fileno() if _connection is not None else None
