"""The fork server process, and `start`, which the launcher calls to bring one up.

The server imports torch once (with the shim loaded, as every process of the session needs),
freezes its heap and then only accepts: each connection is one process handing itself over
(client.py). It forks a child for it, tells the waiter the child's pid, reports the child's
wait status when it ends and kills the child's process group if the waiter's connection closes
first (the waiter was killed). The server runs one thread, before and after fork: a fork from a
threaded process could copy a lock some thread held, and OpenMP's pool is never started here.

Protocol (SOCK_SEQPACKET, one marshal-ed dict a message: both ends are the same interpreter, and
the waiter's side needs no import for it): client -> request (its interpreter, program, process
state) with the fds it hands over as SCM_RIGHTS, sent as soon as it connects, while the server
may still be importing torch; server -> {"pid": child} or {"refused": why}; server ->
{"status": wait status} when the child ends.

A burst (a job's ranks start together, and wait for the import together) is served in start
order, rank 0 first: it hosts the job's TCPStore, which the other ranks' clients otherwise find
closed and retry a second later. It is forked on every CPU: the server has twins, copies made
after the import, and hands them every other request of a burst (_become_one_of_twins).
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import importlib
import marshal
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from mirage import unix_sockets
from mirage.forkserver import SOCKET_ENV, interpreter

MAX_REQUEST_BYTES = 4 << 20
# The server's last argument: blank room in its argv area, which each child overwrites with its
# own command line so that /proc/<pid>/cmdline (ps, pgrep -f) shows the program, not the server.
COMMAND_LINE_ROOM = 8192
MAX_FDS = 253  # SCM_MAX_FD: what one message can carry
MAX_SERVERS = 4  # the server and its twins (see _become_one_of_twins)
_PR_SET_PDEATHSIG = 1
# Modules a session's processes import anyway (torchrun, DDP, the runtime's pieces): imported
# here once, so each child finds them in sys.modules instead of building them in private memory.
# torch._dynamo (with sympy) is what DDP's constructor imports: 1.6 CPU-seconds and 94 MB a
# rank when each rank imports it, about as much as torch itself.
PRELOADED_MODULES = (
    "torch.distributed", "torch.distributed.run", "torch.distributed.elastic.multiprocessing", "torch._dynamo",
    "torch.nn.parallel", "torch.multiprocessing", "torch.utils.data", "torch.optim",
    "mirage.runtime.torch_cuda", "mirage.runtime.session", "mirage.runtime.distributed",
    "mirage.forkserver.interpreter",
)
# Variables that say which process this is: a child takes them from its waiter; the server's
# own environment (what /proc/<child>/environ shows, and what launcher/faults.py reads to find
# a rank's processes) must not name a rank, so that only the waiter does. Without MIRAGE_SHM the
# shim does not take a slot in the session's memory table for the server; each child takes its
# own (boot.complete_forked_process).
PROCESS_IDENTITY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                    "MIRAGE_NODE_RANK", "NCCL_HOSTID", "MIRAGE_SHM", SOCKET_ENV)


@dataclass
class ForkServer:
    """A running server, as the launcher holds it."""

    process: subprocess.Popen
    socket_path: Path

    def stop(self) -> None:
        """Ends the server (its children are the session's; teardown has ended them)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def server_environment(process_env: dict[str, str]) -> dict[str, str]:
    """The server's environment: a session (or node) process's, without the process identity."""
    return {key: value for key, value in process_env.items() if key not in PROCESS_IDENTITY}


def start(process_env: dict[str, str], socket_path: Path) -> ForkServer:
    """Starts the session's fork server for processes whose environment is like `process_env`,
    listening on `socket_path`; it runs in the host's namespaces (a child joins its waiter's node).

    The socket is bound and listening before this returns, so a process started right after
    connects and sends its request at once, and waits for the answer while torch is imported
    (no start-up race, no polling); the server gets the listening socket as an inherited fd."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        unix_sockets.bind(listener, socket_path)
        listener.listen(4096)
        process = subprocess.Popen(
            [sys.executable, "-m", "mirage.forkserver.server", str(listener.fileno()),
             " " * COMMAND_LINE_ROOM],
            env=server_environment(process_env), pass_fds=(listener.fileno(),), stdin=subprocess.DEVNULL,
            process_group=0)
    finally:
        listener.close()
    return ForkServer(process, socket_path)


@dataclass
class Handoff:
    """One child's process, as the waiter described it; `take_over` makes this process it."""

    request: dict
    fds: list[int]
    torch: ModuleType
    server_threads: str | None

    def take_over(self) -> NoReturn:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, self.request["nice"])  # the waiter's, not the server's
        except OSError:
            pass  # a waiter above the server's priority: the server's (never higher than it may take)
        os.setsid()  # a session of its own: no terminal of the server's, its own group to signal
        _enter_namespaces_of(self.request["waiter_pid"])
        _install_fds(self.fds, self.request["fds"])
        for name, (soft, hard) in self.request["rlimits"].items():
            try:
                resource.setrlimit(getattr(resource, name), (soft, hard))
            except (ValueError, OSError):
                pass  # above the server's hard limit: the server's stands
        os.umask(self.request["umask"])
        os.chdir(self.request["cwd"])
        os.environ.clear()
        os.environ.update(self.request["env"])
        _reset_signals(self.request["ignored_signals"], self.request["blocked_signals"])
        _present_waiters_parent(self.request["waiter_pid"], self.request["parent_pid"])
        program = interpreter.Program(**self.request["program"])
        interpreter.rebuild_stdio(self.request["stdio"], program.unbuffered)
        sys.orig_argv[:] = self.request["orig_argv"]
        _show_command_line(self.request["orig_argv"])
        _fresh_multiprocessing_identity()
        _forget_directory_listings(self.request["sys_path"])
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads != self.server_threads and threads and threads.isdigit() and int(threads) > 0:
            self.torch.set_num_threads(int(threads))  # OpenMP read the server's value at load
        from mirage.runtime import boot

        boot.complete_forked_process(self.torch)
        gc.enable()
        interpreter.run(program, self.request["sys_path"])


NODE_NAMESPACES = ("uts", "ipc", "net", "mnt")  # what an isolated emulated node has of its own


def _enter_namespaces_of(waiter_pid: int) -> None:
    """Joins the waiter's node: on isolated emulated nodes (launcher/nodes.py) the waiter runs in
    its node's namespaces and the server in the host's, so the program would otherwise get the
    host's hostname, network and /dev/shm. The child is single-threaded here, as joining a mount
    namespace requires, and changes directory after it."""
    libc = ctypes.CDLL(None, use_errno=True)
    for kind in NODE_NAMESPACES:
        theirs = f"/proc/{waiter_pid}/ns/{kind}"
        if os.stat(theirs).st_ino == os.stat(f"/proc/self/ns/{kind}").st_ino:
            continue
        fd = os.open(theirs, os.O_RDONLY)
        try:
            if libc.setns(fd, 0) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"joining the waiter's {kind} namespace: {os.strerror(error)}")
        finally:
            os.close(fd)


def _install_fds(received: list[int], numbers: list[list]) -> None:
    """Puts the waiter's fds at the same numbers (multiprocessing passes pipes by number), with
    the same close-on-exec flag, and closes everything else the server had open."""
    floor = max([3, *received, *(number for number, _ in numbers)]) + 1
    parked = [_dup_above(fd, floor) for fd in received]
    for fd in received:
        os.close(fd)
    keep = set(parked)
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own fd, already closed
    for fd, (number, inheritable) in zip(parked, numbers):
        os.dup2(fd, number, inheritable=inheritable)
        os.close(fd)


def _dup_above(fd: int, floor: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)


def _reset_signals(ignored: list[int], blocked: list[int]) -> None:
    """Signal dispositions and mask as the waiter had them at start: a new process inherits
    ignored signals and the mask, and Python installs its SIGINT handler unless ignored."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            if sig in ignored:
                signal.signal(sig, signal.SIG_IGN)
            elif sig == signal.SIGINT:
                signal.signal(sig, signal.default_int_handler)
            else:
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # signals the interpreter may not touch (the real-time ones libc keeps)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _present_waiters_parent(waiter_pid: int, parent_pid: int) -> None:
    """os.getppid() in the program is its waiter's parent (the process that started it, e.g.
    torchrun's agent), which the program would see without the server; its own forked children
    see it as their parent, as usual."""
    own_pid = os.getpid()
    real_getppid = os.getppid

    def getppid() -> int:
        if os.getpid() != own_pid:
            return real_getppid()
        try:
            stat = Path(f"/proc/{waiter_pid}/stat").read_text()
            return int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return parent_pid

    os.getppid = getppid


def _show_command_line(argv: list[str]) -> None:
    """Writes the program's command line over the server's in this process's argv area (what
    /proc/<pid>/cmdline reads), NUL-padded to the area's end; a longer one is cut. Moving the
    area itself (PR_SET_MM) would need CAP_SYS_RESOURCE."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat fields 48, 49)
    text = b"\0".join(os.fsencode(arg) for arg in argv)[:end - start - 1]
    ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)


def _forget_directory_listings(sys_path: list[str]) -> None:
    """The import system's listings of the program's import directories, taken when the server
    imported torch, are read again (a module written since then is found). Only these: the
    server's hundreds of package directories are torch's own, and invalidating every finder
    (importlib.invalidate_caches) would copy their pages into every child."""
    for entry in sys_path:
        finder = sys.path_importer_cache.get(entry)
        if finder is not None and hasattr(finder, "invalidate_caches"):
            finder.invalidate_caches()


def _fresh_multiprocessing_identity() -> None:
    """A new process draws its own multiprocessing authkey; children of the server would all
    share the server's."""
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = os.urandom(32)


def serve(listener: socket.socket) -> Handoff:
    """Imports torch, then forks a child per request; returns only in a child."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the run is gone: so is its server
    gc.disable()
    _take_precedence()
    from mirage.runtime import boot

    torch = boot.import_torch_for_fork_server()
    for name in PRELOADED_MODULES:
        importlib.import_module(name)
    if os.environ.get("MIRAGE_NCCL_PATH"):
        from mirage.runtime import distributed

        distributed.load_backend_module()
    gc.freeze()  # the collector never writes to the heap the children share
    server = interpreter.identity()
    server_threads = os.environ.get("OMP_NUM_THREADS")
    twins, dispatcher = _become_one_of_twins(prctl)
    listener.setblocking(False)  # accepted until none is left

    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(wake_read, selectors.EVENT_READ, "wake")
    if dispatcher is None:
        selector.register(listener, selectors.EVENT_READ, "listener")
    else:  # a twin takes its requests from the server alone
        listener.close()
        selector.register(dispatcher, selectors.EVENT_READ, "dispatched")
    children: dict[int, socket.socket | None] = {}  # child pid -> its waiter's connection (None: gone)
    running: dict[socket.socket, int] = {}     # waiter connection -> child pid
    while True:
        requests: list[tuple[socket.socket, dict, list[int]]] = []
        for key, _ in selector.select():
            if key.data == "listener":
                while True:  # every waiting process: their requests are sorted together
                    try:
                        connection, _ = listener.accept()
                    except BlockingIOError:
                        break
                    selector.register(connection, selectors.EVENT_READ, "request")
            elif key.data == "wake":
                while True:
                    try:
                        if not os.read(wake_read, 512):
                            break
                    except BlockingIOError:
                        break
                _reap(children, running, selector)
            elif key.data == "request":
                connection = key.fileobj
                selector.unregister(connection)
                request, fds = _receive(connection)
                if request is not None and interpreter.compatible(server, request.get("interpreter", {})):
                    requests.append((connection, request, fds))
                else:
                    _refuse(connection, fds, "another interpreter, or options it was started with")
            elif key.data == "dispatched":
                request, fds = _receive(key.fileobj)
                if request is None:
                    os._exit(0)  # the server that made this twin is gone
                requests.append((socket.socket(fileno=fds[0]), request, fds[1:]))
            else:  # "running": the only thing a waiter sends afterwards is its end
                connection = key.fileobj
                try:
                    alive = connection.recv(1)
                except OSError:
                    alive = b""
                if not alive:
                    pid = running.pop(connection)
                    selector.unregister(connection)
                    connection.close()
                    children[pid] = None
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
        requests.sort(key=_start_order)
        for position, (connection, request, fds) in enumerate(requests):
            turn = position % (len(twins) + 1)  # 0: this server's, k: twin k's
            if turn and _dispatch(twins[turn - 1], connection, request, fds):
                continue
            try:
                pid = os.fork()
            except OSError:  # no memory or process left: the waiter starts its program itself
                _refuse(connection, fds, "fork failed")
                continue
            if pid == 0:
                # Every socket closed through its object (closing its fd behind its back
                # would let a later garbage collection close a reused number); the other
                # requests' fds are closed with the rest the server had (_install_fds).
                for registered in list(selector.get_map().values()):
                    if isinstance(registered.fileobj, socket.socket):
                        registered.fileobj.close()
                for other, _, _ in requests:
                    other.close()
                for twin in twins:
                    twin.close()
                selector.close()
                os.close(wake_read)
                os.close(wake_write)
                return Handoff(request, fds, torch, server_threads)
            for fd in fds:
                os.close(fd)
            selector.register(connection, selectors.EVENT_READ, "running")
            children[pid] = connection
            running[connection] = pid
            try:
                connection.send(marshal.dumps({"pid": pid}))
            except OSError:
                pass  # the waiter is gone: its connection reads as closed next


def _receive(connection: socket.socket) -> tuple[dict | None, list[int]]:
    """One request and its fds; None for a closed connection or bytes that are not one."""
    try:
        message, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST_BYTES, MAX_FDS + 1)
    except OSError:
        return None, []
    try:
        request = marshal.loads(message) if message else None
    except (ValueError, EOFError, TypeError):
        request = None
    return (request if isinstance(request, dict) else None), fds


def _refuse(connection: socket.socket, fds: list[int], why: str) -> None:
    """Tells a waiter to start its program itself."""
    for fd in fds:
        os.close(fd)
    _last_word(connection, {"refused": why})


def _last_word(connection: socket.socket, message: dict) -> None:
    """Sends a waiter its last message (a waiter already gone misses it) and hangs up."""
    try:
        connection.send(marshal.dumps(message))
    except OSError:
        pass
    connection.close()


def _dispatch(twin: socket.socket, connection: socket.socket, request: dict, fds: list[int]) -> bool:
    """Hands a request and its waiter's connection to a twin, which forks it; False when it
    cannot (the twin is gone, or the request is too large for one message): forked here."""
    try:
        socket.send_fds(twin, [marshal.dumps(request)], [connection.fileno(), *fds])
    except OSError:
        return False
    for fd in fds:
        os.close(fd)
    connection.close()
    return True


def _start_order(received: tuple[socket.socket, dict, list[int]]) -> int:
    """Processes without a rank (a launcher such as torchrun's agent) first, then by RANK."""
    rank = received[1]["env"].get("RANK", "")
    return int(rank) if rank.isdigit() else -1


def _take_precedence() -> None:
    """The highest scheduling priority this process may take (root's: nice -20). A session's
    processes start while the server imports torch, single-threaded, for seconds: every rank
    waits for that import, so it is what should get a CPU first. Each child takes its waiter's
    own nice value back (Handoff.take_over), so no program runs at the server's priority."""
    for nice in (-20, -10, -5):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
            return
        except OSError:
            continue  # not allowed (no CAP_SYS_NICE, or RLIMIT_NICE): the next, or as it is


def _become_one_of_twins(prctl) -> tuple[list[socket.socket], socket.socket | None]:
    """Forks copies of the server, one per further CPU (at most MAX_SERVERS in all): each fork
    copies the server's page tables (about 12 ms for its ~300 MB), so one server forks a burst
    of 64 ranks one after the other. The server sorts a burst and hands every other request to
    a twin, which forks it and reports on it; a twin ends with the server that made it.
    Returns, in the server, its ends of the twins' connections (and None); in a twin, no twins
    and its end of the connection to the server."""
    server = os.getpid()
    twins: list[socket.socket] = []
    for _ in range(min(len(os.sched_getaffinity(0)), MAX_SERVERS) - 1):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.fork() == 0:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != server:  # the server ended before the line above
                os._exit(1)
            mine.close()
            for twin in twins:
                twin.close()
            return [], theirs
        theirs.close()
        twins.append(mine)
    return twins, None


def _reap(children: dict, running: dict, selector: selectors.BaseSelector) -> None:
    """Collects ended children and tells each one's waiter how it ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is None:
            continue
        running.pop(connection, None)
        selector.unregister(connection)
        _last_word(connection, {"status": status})


def main() -> None:
    listener = socket.socket(fileno=int(sys.argv[1]))
    handoff = serve(listener)
    handoff.take_over()


if __name__ == "__main__":
    main()
