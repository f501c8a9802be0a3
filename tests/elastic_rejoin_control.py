"""Control for tests/test_faults.py's rejoin test: the same elastic job with plain torchrun, gloo on
the CPU and no mirage, asking whether a node that is killed and rejoins needs
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torch itself (the rejoin test sets it).

    python tests/elastic_rejoin_control.py [--share-store] [--deadline SECONDS]

Two torchrun agents on this host (node 0 hosts the c10d rendezvous store), each in its own session;
node 0's agent binds the store itself on a port the system picks (port 0) and publishes it in a file
that node 1's agent reads, so no free port is guessed and later reused;
once node 1 has trained a step in the two-node world its agent and worker are SIGKILLed, and 4 s
later it is started again. Prints one JSON line: whether node 0's agent finished within the deadline,
its exit code and each node's last step line (and node 0's log when it failed). Not a test: a run that hangs waits for the deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).parent / "workloads" / "elastic.py"


PORT = "{port}"  # in an agent's arguments: the rendezvous store's port, once node 0 has bound it


def agent(node: int, port_file: Path, folder: Path, steps: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    """One node's torchrun agent, in its own session so that a node kill reaches its worker too.
    Node 0's runs through host_agent (this file), which binds the store and writes `port_file`."""
    torchrun = ["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{PORT}", "--rdzv-id=elastic",
                "--rdzv-conf", f"is_host={int(node == 0)},last_call_timeout=3", str(WORKER), str(folder), str(steps)]
    if node == 0:
        command = [sys.executable, __file__, "host-agent", str(port_file), *torchrun]
    else:
        command = [sys.executable, "-m", "torch.distributed.run",
                   *(arg.replace(PORT, published_port(port_file)) for arg in torchrun)]
    return subprocess.Popen(command, env={**env, "MIRAGE_NODE_RANK": str(node)}, stdout=log.open("a"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def host_agent(port_file: Path, torchrun_args: list[str]) -> None:
    """Node 0's agent: binds the rendezvous store on port 0 in this process, multi-tenant, so that
    torchrun's c10d rendezvous (multi-tenant too: torch/distributed/elastic/rendezvous/
    c10d_rendezvous_backend.py, _create_tcp_store) serves from the same server; publishes the port,
    then runs torchrun with it."""
    from torch.distributed import TCPStore
    from torch.distributed.run import main as torchrun

    store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    written = port_file.with_suffix(".tmp")
    written.write_text(str(store.port))
    written.rename(port_file)  # whole or absent for the reader
    torchrun([arg.replace(PORT, str(store.port)) for arg in torchrun_args])


def published_port(port_file: Path, deadline: float = 120.0) -> str:
    """The port node 0's agent bound, once it has written it."""
    waited = time.monotonic()
    while not port_file.exists():
        if time.monotonic() - waited > deadline:
            sys.exit(f"node 0's agent never published its store's port in {port_file}")
        time.sleep(0.05)
    return port_file.read_text()


def kill_node(agent_pid: int) -> None:
    """SIGKILL an agent and every process below it at once, as a node's loss does (torchrun starts its
    workers in sessions of their own, so the agent's process group alone would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    below, todo = [], [agent_pid]
    while todo:
        pid = todo.pop()
        below.append(pid)
        todo.extend(children.get(pid, []))
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def step_lines(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"step"')]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share-store", action="store_true", help="leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset")
    parser.add_argument("--deadline", type=float, default=240.0)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIRAGE", "TORCH_DISABLE_SHARE"))}
    if not args.share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        logs = [Path(folder) / f"node{n}.log" for n in (0, 1)]
        port_file = Path(folder) / "port"
        node0 = agent(0, port_file, Path(folder), args.steps, env, logs[0])
        node1 = agent(1, port_file, Path(folder), args.steps, env, logs[1])
        started = time.monotonic()
        while not any(s["world"] == 2 for s in step_lines(logs[1])):  # node 1 trained in the two-node world
            if node0.poll() is not None or time.monotonic() - started > args.deadline:
                sys.exit(f"the two-node world never formed:\n{logs[0].read_text()[-2000:]}")
            time.sleep(0.1)
        kill_node(node1.pid)
        node1.wait()
        killed_at = time.monotonic()
        time.sleep(4)  # the scenario's rejoin delay (kill-node ... rejoin=4s), not a synchronisation
        node1 = agent(1, port_file, Path(folder), args.steps, env, logs[1])
        try:
            node0.wait(timeout=args.deadline)
            finished = True
        except subprocess.TimeoutExpired:
            finished = False
        for process in (node0, node1):
            if process.poll() is None:
                kill_node(process.pid)
                process.wait()
        last = step_lines(logs[0])[-1:]
        print(json.dumps({"share_store": args.share_store, "finished": finished, "exit_code": node0.returncode,
                          "seconds_after_kill": round(time.monotonic() - killed_at, 1), "node0_last": last,
                          "node1_last": step_lines(logs[1])[-1:]}), flush=True)
        if not finished or node0.returncode != 0:
            print(logs[0].read_text()[-3000:], file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:2] == ["host-agent"]:
        host_agent(Path(sys.argv[2]), sys.argv[3:])
    else:
        main()
