"""Binding and connecting the session's Unix sockets at any path length.

A Unix socket's address holds at most 107 bytes of path (sun_path), and a session's sockets
live in its directory under XDG_RUNTIME_DIR, which can be deep (a CI runner's, a test's
tmp_path). A longer path goes through the directory's entry in /proc/self/fd: the kernel
resolves that link to the directory, so the socket is bound (or reached) at its real place
under a short name. Imports nothing beyond `os`: the fork server's waiter imports this before
every program of the session starts (mirage/forkserver/client.py).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing's constant, without importing typing (see above)
if TYPE_CHECKING:
    from typing import Callable

    import socket

SUN_PATH_BYTES = 107  # sizeof(sockaddr_un.sun_path) on Linux, less the terminating NUL


def bind(sock: socket.socket, path: str | os.PathLike) -> None:
    """sock.bind(path), for a path of any length."""
    _at(sock.bind, os.fspath(path))


def connect(sock: socket.socket, path: str | os.PathLike) -> None:
    """sock.connect(path), for a path of any length."""
    _at(sock.connect, os.fspath(path))


def _at(operation: Callable[[str], None], path: str) -> None:
    if len(os.fsencode(path)) <= SUN_PATH_BYTES:
        operation(path)
        return
    directory, name = os.path.split(path)
    fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        operation(f"/proc/self/fd/{fd}/{name}")
    finally:
        os.close(fd)
