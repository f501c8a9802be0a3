"""The session service (what users call the emulator daemon), hosted in the `mirage run` process.

It owns the session's shared device-memory table (shared_table.py) and serves one Unix socket,
`mirage.sock`, in the session's private directory (mode 0600; nothing listens on a network
port). The socket is the registration: a socket nobody answers on is a dead session.

Every workload process that imports torch connects at boot and stays connected; the open
connection is how the service knows it is alive, and its closing (exit, crash, SIGKILL) is how
its memory comes back. If the service dies, every process sees its connection close and fails
fast with "mirage daemon died" instead of hanging. Requests are JSON lines:

    {"op": "hello", "pid", "rank", "node"}   a workload process registers (connection held)
    {"op": "status"}                         a snapshot for `mirage smi` / `mirage ps`
    {"op": "exec", "node"}                   a lease for `mirage exec`: the node's environment
    {"op": "collective", ...}                flight-recorder entries (one-way, no reply)
"""

from __future__ import annotations

import collections
import json
import os
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mirage import unix_sockets
from mirage.daemon import shared_table
from mirage.profiles import Profile, temperature_celsius
from mirage.daemon.flight_recorder import FlightRecorder
from mirage.daemon.protocol import SOCKET_NAME, STACK_SIGNAL, stack_path

REAP_INTERVAL_SECONDS = 0.5
STACK_WAIT_SECONDS = 1.0


@dataclass
class Registration:
    pid: int
    rank: int | None
    node: int


@dataclass
class SessionService:
    """One session's service; `start()` before the workload, `stop()` after it."""

    session_id: str
    session_dir: Path
    profile_name: str
    torch_name: str
    capacity: int
    num_nodes: int
    gpus_per_node: int
    node_env: Callable[[int], dict[str, str]]
    recorder: FlightRecorder
    started: float = field(default_factory=time.time)
    processes: dict[int, Registration] = field(default_factory=dict)
    leases: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: socketserver.ThreadingUnixStreamServer | None = None
    _table: shared_table.SharedTable | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)
    peaks: dict[tuple[int, int], int] = field(default_factory=dict)
    profile: Profile | None = None  # for the modelled power and the clock `mirage smi` shows
    # A cluster across hosts (launcher/cluster.py): the nodes this host runs, and the other hosts'
    # snapshots, which status() adds so that smi on any host shows the whole cluster.
    local_nodes: range | None = None
    other_hosts: Callable[[], list[dict]] | None = None
    # (monotonic time, busy ns) per GPU, sampled by the reaper every REAP_INTERVAL_SECONDS
    _busy_samples: dict[tuple[int, int], collections.deque] = field(default_factory=dict)

    @property
    def socket_path(self) -> Path:
        return self.session_dir / SOCKET_NAME

    def environment(self) -> dict[str, str]:
        """What workload processes need to attach."""
        return {"MIRAGE_SHM": str(self._table.path), "MIRAGE_SOCKET": str(self.socket_path)}

    def start(self) -> None:
        self._table = shared_table.SharedTable.create(self.session_id, self.num_nodes, self.gpus_per_node,
                                                      self.capacity)
        service = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                service._serve(self.rfile, self.wfile)

        server = socketserver.ThreadingUnixStreamServer(str(self.socket_path), Handler, bind_and_activate=False)
        try:
            unix_sockets.bind(server.socket, self.socket_path)
            server.server_activate()
        except OSError:
            server.server_close()
            raise
        self._server = server  # stop() shuts down only a server that serves
        self._server.daemon_threads = True
        os.chmod(self.socket_path, 0o600)
        threading.Thread(target=self._server.serve_forever, name="mirage-service", daemon=True).start()
        threading.Thread(target=self._reap_dead, name="mirage-reaper", daemon=True).start()

    def stop(self) -> None:
        """Closes the socket and the shared table (after recording the peaks)."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.socket_path.unlink(missing_ok=True)
        if self._table is not None:
            self.peaks = {(n, g): self._table.gpu_usage(n, g)[1]
                          for n in range(self.num_nodes) for g in range(self.gpus_per_node)}
            self._table.close()
            self._table = None

    def wait_for_leases(self, narrate: Callable[[str], None]) -> None:
        """The session stays up while a `mirage exec` holds it."""
        if self.leases:
            narrate(f"waiting for {self.leases} `mirage exec` command(s) to finish")
        while self.leases and not self._stopping.is_set():
            time.sleep(0.1)

    # -- requests --------------------------------------------------------------------------

    def _serve(self, rfile, wfile) -> None:
        registered: int | None = None
        leased = False
        try:
            for line in rfile:
                request = json.loads(line)
                op = request.get("op")
                if op == "hello":
                    registered = int(request["pid"])
                    with self._lock:
                        self.processes[registered] = Registration(
                            registered, request.get("rank"), int(request.get("node", 0)))
                elif op == "collective":
                    request["pid"] = registered
                    self.recorder.record(request)
                elif op == "status":
                    wfile.write((json.dumps(self.status()) + "\n").encode())
                    wfile.flush()
                    return
                elif op == "exec":
                    node = int(request.get("node", 0))
                    if not 0 <= node < self.num_nodes:
                        reply = {"error": f"node {node} does not exist; this session has nodes 0..{self.num_nodes - 1}"}
                    else:
                        reply = {"env": self.node_env(node)}
                        with self._lock:
                            self.leases += 1
                        leased = True
                    wfile.write((json.dumps(reply) + "\n").encode())
                    wfile.flush()
        except (OSError, ValueError):
            pass
        finally:
            if registered is not None:
                with self._lock:
                    self.processes.pop(registered, None)
                self.recorder.process_gone(registered)
                self._release_if_dead(registered)
            if leased:
                with self._lock:
                    self.leases -= 1

    def status(self, with_other_hosts: bool = True) -> dict:
        """The session as `mirage smi --json` prints it (in a cluster, with the other hosts' GPUs
        and ranks unless `with_other_hosts` is false)."""
        table = self._table
        slots = table.slots() if table else []
        with self._lock:
            processes = dict(self.processes)
        gpus = []
        for node in self.local_nodes or range(self.num_nodes):
            for gpu in range(self.gpus_per_node):
                used, peak = table.gpu_usage(node, gpu) if table else (0, 0)
                users = [{"pid": v.pid, "rank": v.rank if v.rank >= 0 else None, "bytes": v.bytes_per_gpu[gpu]}
                         for _, v in slots if v.node == node and v.bytes_per_gpu[gpu]]
                busy = self.utilization(node, gpu)
                figures = {"utilization_percent": round(100 * busy), "temperature_c": temperature_celsius(busy),
                           "power_watts": round(self.profile.power_watts(busy)) if self.profile else None,
                           "clock_mhz": round(self.profile.clock_ghz * 1000) if self.profile else None}
                gpus.append({"node": node, "gpu": gpu, "name": self.torch_name, "used_bytes": used,
                             "peak_bytes": peak, "total_bytes": self.capacity, **figures, "processes": users})
        ranks = [{"rank": r.rank, "pid": r.pid, "node": r.node,
                  "last_collective": self.recorder.last_collective(r.rank)}
                 for r in sorted(processes.values(), key=lambda r: (r.rank is None, r.rank or 0, r.pid))]
        status = {"session": self.session_id, "run_pid": os.getpid(), "started": self.started,
                  "profile": self.profile_name, "device": self.torch_name, "num_nodes": self.num_nodes,
                  "gpus_per_node": self.gpus_per_node, "gpus": gpus, "processes": ranks,
                  "hang_watch": self.recorder.watch_state()}
        if with_other_hosts and self.other_hosts is not None:
            others = self.other_hosts()
            status["hosts"] = [self.session_id] + [other["session"] for other in others]
            for other in others:
                status["gpus"] += other["gpus"]
                status["processes"] += other["processes"]
            status["gpus"].sort(key=lambda g: (g["node"], g["gpu"]))
            status["processes"].sort(key=lambda r: (r["rank"] is None, r["rank"] or 0, r["pid"]))
        return status

    def stack_of(self, rank: int) -> str | None:
        """The innermost frames of a rank's main thread now (the rank dumps them on a signal)."""
        with self._lock:
            pids = [p.pid for p in self.processes.values() if p.rank == rank]
        if not pids:
            return None
        path = stack_path(str(self.session_dir), pids[0])
        try:
            before = os.path.getsize(path)
            os.kill(pids[0], STACK_SIGNAL)
        except OSError:
            return None
        deadline = time.monotonic() + STACK_WAIT_SECONDS
        while time.monotonic() < deadline and os.path.getsize(path) == before:
            time.sleep(0.05)
        time.sleep(0.1)  # let the dump finish
        with open(path) as f:
            f.seek(before)
            dump = f.read()
        main = dump.split("Current thread", 1)[-1]
        frames = [line.strip() for line in main.splitlines() if line.strip().startswith("File ")]
        return "\n".join(frames[:4]) or None

    # -- memory of dead processes -------------------------------------------------------------

    def _release_if_dead(self, pid: int) -> None:
        if self._table is None or _alive(pid):
            return
        for slot, view in self._table.slots():
            if view.pid == pid:
                self._table.release(slot)

    def utilization(self, node: int, gpu: int) -> float:
        """The share of the last sample period (at least 1/6 s, NVML's shortest, and at most the
        sampling history) in which the GPU ran kernels; 0 before two samples exist."""
        samples = list(self._busy_samples.get((node, gpu), ()))
        if not samples or self._table is None:
            return 0.0
        now, busy = time.monotonic(), self._table.gpu_busy_ns(node, gpu)
        older = [sample for sample in samples if now - sample[0] >= 1 / 6] or samples[:1]
        then, busy_then = older[-1]
        return min(1.0, max(0.0, (busy - busy_then) / 1e9 / max(now - then, 1e-9)))

    def _reap_dead(self) -> None:
        """Frees the slots of processes that died without closing a connection (never attached,
        or killed between claiming a slot and saying hello); samples each GPU's busy time."""
        while not self._stopping.wait(REAP_INTERVAL_SECONDS):
            table = self._table
            if table is None:
                return
            for slot, view in table.slots():
                if not _alive(view.pid):
                    table.release(slot)
            now = time.monotonic()
            for node in range(self.num_nodes):
                for gpu in range(self.gpus_per_node):
                    history = self._busy_samples.setdefault((node, gpu), collections.deque(maxlen=4))
                    history.append((now, table.gpu_busy_ns(node, gpu)))


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def request(socket_path: Path, message: dict, timeout: float = 5.0) -> dict:
    """One request/reply to a session's service (for smi, ps, exec)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        unix_sockets.connect(conn, socket_path)
        conn.sendall((json.dumps(message) + "\n").encode())
        return json.loads(conn.makefile().readline())
