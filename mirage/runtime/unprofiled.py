"""mirage's Python code that runs on the program's behalf, kept out of the program's Python
profile (torch.profiler's with_stack, cProfile): a GPU box has none of it, so a profile that
showed its frames would tell mirage from a GPU box. The shim's built-ins
(mirage/shim/unprofiled.h) take the calling thread's profile function off while such code
runs, so the profiler sees one call of a built-in function where torch._C has one, and nothing
of mirage beneath it. The same goes for the stack the profiler finds when it starts: the
program's script is the bottom of its thread's stack (call_at_bottom), and the session's watch
(mirage/runtime/session.py) is a thread with no Python on it (watch_connection)."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any, Callable


@functools.cache
def _shim() -> ctypes.PyDLL:
    """The shim (loaded already), called holding the GIL: its functions make Python objects."""
    shim = ctypes.PyDLL(os.environ["MIRAGE_SHIM_PATH"])
    shim.mirage_unprofiled.restype = ctypes.py_object
    shim.mirage_unprofiled.argtypes = [ctypes.py_object, ctypes.c_char_p]
    shim.mirage_unprofiled_around.restype = ctypes.py_object
    shim.mirage_unprofiled_around.argtypes = [ctypes.py_object] * 3 + [ctypes.c_char_p]
    shim.mirage_call_at_bottom.restype = ctypes.py_object
    shim.mirage_call_at_bottom.argtypes = [ctypes.py_object, ctypes.py_object]
    shim.mirage_watch_connection.restype = None
    shim.mirage_watch_connection.argtypes = [ctypes.c_int, ctypes.py_object, ctypes.c_char_p]
    return shim


def unprofiled(fn: Callable, name: str | None = None) -> Callable:
    """`fn` as a built-in function (named `name`, or fn's own name) no Python profiler sees into."""
    return _shim().mirage_unprofiled(fn, (name or fn.__name__).encode())


def unprofiled_around(call: Callable, before: Callable[..., Any], after: Callable[[Any, bool], None],
                      name: str | None = None) -> Callable:
    """`call` (the program's work, which the profiler sees) with mirage's `before(*args, **kwargs)`
    unprofiled ahead of it and `after(what before returned, whether call returned)` unprofiled
    once it returns or raises (its exception then goes on unless `after` raises one of its own)."""
    return _shim().mirage_unprofiled_around(call, before, after, (name or call.__name__).encode())


def call_at_bottom(function: Callable, *args: Any) -> Any:
    """function(*args) with no frame of the caller's (the fork server's) beneath it, as `python`
    has its program: exec(code, globals) for a script or -c, runpy's for -m."""
    return _shim().mirage_call_at_bottom(function, args)


def watch_connection(fd: int, on_close: Callable[[], None], message: str) -> None:
    """Calls `on_close()` once the far end closes socket `fd`, from a thread that runs no Python
    until then (`message` on stderr and exit status 1 instead, if the interpreter is finalizing)."""
    _shim().mirage_watch_connection(fd, on_close, message.encode())
