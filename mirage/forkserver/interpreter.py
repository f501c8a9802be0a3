"""What the interpreter would do with a command line, done in a forked child instead.

`describe` reads a process's own command line (sys.orig_argv, as `python` received it, and
sys.argv, as the interpreter prepared it) in its sitecustomize; `run` repeats the interpreter's
last steps in the fork server's child: sys.path[0], a fresh `__main__`, then the script,
`-m module` or `-c code`. Only what can be repeated exactly is handed over; `describe` returns
None for the rest (stdin or interactive programs, `-i`, a directory or zip as the script, long
options), and such a process starts normally.

Interpreter options are settled when an interpreter starts, so the child keeps the server's:
the server is started with the session's environment (PYTHON* variables included), and a
process whose sys.flags differ from the server's in anything but -u, -B, -P and -q starts
normally (client.py checks). -u and -B are applied in the child (stdio rebuilt unbuffered,
sys.dont_write_bytecode), -P decides sys.path[0].
"""

from __future__ import annotations

import io
import os
import sys
import types

TYPE_CHECKING = False  # typing itself is not imported: every handed-over process imports this module
if TYPE_CHECKING:
    from typing import NoReturn

# sys.flags fields the child can take on after the fact (the rest must match the server's);
# -u is not among sys.flags: it shows as unbuffered binary stdio.
ADJUSTABLE_FLAGS = ("dont_write_bytecode", "safe_path", "quiet")
_OPTIONS_WITH_VALUE = "WX"  # -W arg, -X arg


def identity() -> dict:
    """This interpreter and the options it was started with, as a hand-over compares them. The
    prefix too: every virtual environment's python resolves to the same executable, but the
    server's imports (torch) come from its own environment's packages."""
    return {
        "executable": os.path.realpath(sys.executable), "prefix": sys.prefix, "version": sys.version,
        "flags": {name: getattr(sys.flags, name) for name in dir(sys.flags) if not name.startswith(("_", "n_"))
                  and not callable(getattr(sys.flags, name))},
        "xoptions": sys._xoptions, "warnoptions": sys.warnoptions,
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
    }


def compatible(server: dict, process: dict) -> bool:
    """Whether a process of interpreter `process` (identity()) can be forked from a server of
    interpreter `server`: the same interpreter and environment, started with the same options but those the
    child can take on (ADJUSTABLE_FLAGS), and the same hash seed."""
    if any(process.get(key) != server[key] for key in ("executable", "prefix", "version", "xoptions", "warnoptions",
                                                       "hash_seed")):
        return False
    flags = process.get("flags") or {}
    return all(flags.get(name) == value for name, value in server["flags"].items() if name not in ADJUSTABLE_FLAGS)


class Program:
    """The program a command line runs: kind is "script", "module" or "code". A plain class,
    not a dataclass: every handed-over process imports this module, and dataclasses' imports
    (inspect) cost more than the rest of the hand-over."""

    def __init__(self, kind: str, target: str, argv: list[str], safe_path: bool, unbuffered: bool,
                 dont_write_bytecode: bool) -> None:
        self.kind = kind
        self.target = target      # the script path as given, the module name, or the code
        self.argv = argv          # sys.argv as the program starts with it
        self.safe_path = safe_path  # -P / PYTHONSAFEPATH: no sys.path[0]
        self.unbuffered = unbuffered  # -u / PYTHONUNBUFFERED: stdout and stderr without a buffer
        self.dont_write_bytecode = dont_write_bytecode


def describe(orig_argv: list[str], argv: list[str], flags) -> Program | None:
    """The program of this command line, or None when only a normal start can run it."""
    args = orig_argv[1:]
    index = 0
    kind = target = None
    while index < len(args):
        arg = args[index]
        if arg == "--":
            index += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        if arg.startswith("--"):
            return None  # --check-hash-based-pycs and the like
        position = 1
        while position < len(arg):
            letter = arg[position]
            if letter in "cm":
                rest = arg[position + 1:]
                if not rest:
                    index += 1
                    if index >= len(args):
                        return None
                    rest = args[index]
                kind, target = ("code" if letter == "c" else "module"), rest
                break
            if letter in _OPTIONS_WITH_VALUE:
                if position + 1 == len(arg):
                    index += 1
                break
            position += 1
        if kind:
            break
        index += 1
    if kind is None:
        if index >= len(args) or args[index] == "-" or not os.path.isfile(args[index]):
            return None  # interactive, stdin, or a directory/zip with __main__.py
        if args[index].endswith((".pyc", ".pyo")):
            return None
        kind, target = "script", args[index]
    if flags.inspect or flags.interactive:
        return None
    unbuffered = sys.stdout is not None and isinstance(getattr(sys.stdout, "buffer", None), io.FileIO)
    return Program(kind, target, list(argv), bool(flags.safe_path), unbuffered, bool(flags.dont_write_bytecode))


def rebuild_stdio(streams: dict, unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr over fds 0-2 as the handing-over process had them (encoding,
    errors, line buffering, which depends on whether the fd is a terminal): the server's own
    were built for the server's fds."""
    for index, name in enumerate(("stdin", "stdout", "stderr")):
        described = streams.get(name)
        if described is None:
            setattr(sys, name, None)
            setattr(sys, f"__{name}__", None)
            continue
        raw = io.FileIO(index, "rb" if index == 0 else "wb", closefd=False)
        raw.name = f"<{name}>"
        if index > 0 and unbuffered:
            binary = raw
        else:
            binary = io.BufferedReader(raw) if index == 0 else io.BufferedWriter(raw)
        text = io.TextIOWrapper(binary, encoding=described["encoding"], errors=described["errors"],
                                newline="\n", line_buffering=described["line_buffering"],
                                write_through=described["write_through"])
        text.mode = "r" if index == 0 else "w"
        setattr(sys, name, text)
        setattr(sys, f"__{name}__", text)


def describe_stdio() -> dict:
    """What rebuild_stdio needs to know about this process's standard streams."""
    described = {}
    for name in ("stdin", "stdout", "stderr"):
        stream = getattr(sys, name)
        described[name] = None if stream is None else {
            "encoding": stream.encoding, "errors": stream.errors,
            "line_buffering": stream.line_buffering, "write_through": stream.write_through,
        }
    return described


def _path0(program: Program) -> str | None:
    """sys.path[0] as the interpreter computes it: the script's real directory, the working
    directory for -m, '' for -c; nothing under -P."""
    if program.safe_path:
        return None
    if program.kind == "script":
        return os.path.dirname(os.path.realpath(program.target))
    if program.kind == "module":
        return os.getcwd()
    return ""


def _fresh_main() -> types.ModuleType:
    """A new, empty `__main__` (the server's own stays with the server)."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__ if isinstance(__builtins__, types.ModuleType) else sys.modules["builtins"]
    sys.modules["__main__"] = main
    return main


def run(program: Program, search_path: list[str]) -> NoReturn:
    """Runs the program as `python` would, in this (forked) process, and ends the process as
    the interpreter would: SystemExit's code (its message on stderr), 1 after an uncaught
    exception, printed from the program's first frame on, or death by SIGINT after an uncaught
    KeyboardInterrupt."""
    sys.path[:] = list(search_path)
    path0 = _path0(program)
    if path0 is not None:
        sys.path.insert(0, path0)
    sys.dont_write_bytecode = program.dont_write_bytecode
    sys.argv[:] = program.argv
    import runpy  # here, not at the top: the waiter never needs it

    # The program's code is the bottom of its stack, as under `python`: a profiler's stack, a
    # traceback, sys._getframe see none of this function's frames (mirage/runtime/unprofiled.py).
    from mirage.runtime.unprofiled import call_at_bottom

    main = _fresh_main()
    try:
        if program.kind == "module":
            sys.argv[0] = "-m"
            call_at_bottom(runpy._run_module_as_main, program.target, True)
        elif program.kind == "code":
            main.__dict__.update(__loader__=None, __spec__=None, __package__=None, __doc__=None)
            call_at_bottom(exec, compile(program.target, "<string>", "exec", dont_inherit=True), main.__dict__)
        else:
            with io.open_code(program.target) as source_file:
                source = source_file.read()
            from importlib.machinery import SourceFileLoader

            main.__dict__.update(__file__=program.target, __cached__=None, __spec__=None, __package__=None,
                                 __doc__=None, __loader__=SourceFileLoader("__main__", program.target))
            call_at_bottom(exec, compile(source, program.target, "exec", dont_inherit=True), main.__dict__)
    except SystemExit as exit_request:
        _shut_down(_exit_code(exit_request))
    except BaseException as error:  # noqa: BLE001 - the interpreter's own top-level handler, repeated
        # From the program's first frame on (run's and call_at_bottom's are mirage's), as
        # `python` prints it; with -m, runpy's frames stay, as they do there.
        error.__traceback__ = _without_frames_of(error.__traceback__, {run.__code__, call_at_bottom.__code__})
        sys.excepthook(type(error), error, error.__traceback__)
        _shut_down(1, by_sigint=isinstance(error, KeyboardInterrupt))
    _shut_down(0)


def _without_frames_of(traceback: types.TracebackType | None, codes: set[types.CodeType]) -> types.TracebackType | None:
    """The traceback from its first entry that runs none of `codes` (what the default hook prints from)."""
    while traceback is not None and traceback.tb_frame.f_code in codes:
        traceback = traceback.tb_next
    return traceback


def _exit_code(exit_request: SystemExit) -> int:
    """SystemExit's code as the interpreter reads it: None is 0, an int itself, anything else
    is printed on stderr and means 1."""
    code = exit_request.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except (OSError, ValueError):
        pass
    return 1


def _shut_down(code: int, by_sigint: bool = False) -> NoReturn:
    """The interpreter's shutdown steps that a program can see (non-daemon threads joined,
    atexit callbacks, files it left open flushed, stdio flushed), then _exit.

    Python's full finalization would then tear down every module, writing a reference count
    into nearly every object, which in a fork copies the server's whole shared heap into the
    child at its end: 64 ranks measured twice the wall time and twice the peak memory. What is
    skipped is what Python does not promise: __del__ of objects still alive at exit, and C
    atexit handlers."""
    import atexit
    import gc
    import signal
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for obj in gc.get_objects():  # the program's own objects (the server's heap is frozen)
        # type(), not isinstance(): a weak proxy among them answers isinstance by its referent,
        # which may be gone (ReferenceError)
        if issubclass(type(obj), (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)):
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    if by_sigint:  # Python ends by SIGINT after an uncaught KeyboardInterrupt, so a shell sees it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
