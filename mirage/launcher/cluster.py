"""One emulated cluster across real hosts: `mirage node`, started once per host by Slurm.

    srun --nodes=2 --ntasks-per-node=1 mirage node --num-nodes 4 --gpus-per-node 8 -- \\
        torchrun --nnodes=$MIRAGE_NUM_NODES ... train.py       (or: --nproc-per-node 8 -- python train.py)

Each `mirage node` reads what Slurm tells every task (SLURM_JOB_ID, SLURM_JOB_NODELIST expanded by
`scontrol show hostnames`, SLURM_NODEID, SLURM_NTASKS_PER_NODE), and the hosts meet through a
torch c10d TCPStore on the job's first host (the field's own rendezvous; its port derives from the
job id, or --rdzv-port). Host 0 publishes the workload's MASTER_PORT; every host publishes its
address; then each host runs an ordinary mirage session for its share of the emulated nodes
(nodes h*K .. h*K+K-1 of --num-nodes, K per host), with the cluster's ranks, WORLD_SIZE and
MASTER_ADDR (host 0's address). The emulated nodes are apart (MIRAGE_ISOLATED_NODES): the emulated
NCCL uses shared memory within a node and its socket transport between nodes, so traffic between
hosts crosses the hosts' network. Nodes on one host share that host's network (the host is the
machine; --isolate-nodes applies to `mirage run` on one host).

While the job runs every host puts its `mirage smi` snapshot in the store each second, so `mirage
ps` / `mirage smi` on any host show every host's GPUs and ranks. Each host's session keeps its own
name (`<job>-host<h>`): its teardown and reaper then reach only that host's processes, also where
hosts share a process table (the test cluster's hosts are network namespaces of one machine).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

STATUS_INTERVAL_SECONDS = 1.0
DEFAULT_RDZV_TIMEOUT = 120.0


class ClusterError(Exception):
    """The hosts could not form the cluster (why, and what to do)."""


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm tells each task of the job about where it runs."""

    job_id: str
    hosts: list[str]
    host_index: int

    @classmethod
    def from_environment(cls, environ: dict[str, str]) -> SlurmJob:
        """Reads the SLURM_* variables; raises ClusterError naming what does not match."""
        job_id = environ.get("SLURM_JOB_ID")
        node_list = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not job_id or not node_list or "SLURM_NODEID" not in environ:
            raise ClusterError("mirage node runs as a Slurm task (SLURM_JOB_ID, SLURM_JOB_NODELIST and SLURM_NODEID "
                               "are not set): start it with srun, once per host: srun --ntasks-per-node=1 mirage "
                               "node ... -- CMD (on one machine, use mirage run)")
        tasks_per_node = environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0].split(",")[0]
        if tasks_per_node != "1":
            raise ClusterError(f"SLURM_NTASKS_PER_NODE={environ['SLURM_NTASKS_PER_NODE']}: mirage node runs once per "
                               "host and starts the ranks itself; use srun --ntasks-per-node=1")
        hosts = expand_node_list(node_list)
        expected = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
        if expected and int(expected) != len(hosts):
            raise ClusterError(f"the node list {node_list} names {len(hosts)} host(s) but SLURM_JOB_NUM_NODES is "
                               f"{expected}; run mirage node inside the job's own allocation (srun in the sbatch "
                               "script), not with variables copied from another job")
        index = int(environ["SLURM_NODEID"])
        if not 0 <= index < len(hosts):
            raise ClusterError(f"SLURM_NODEID={index} is outside the node list {node_list} ({len(hosts)} host(s))")
        return cls(job_id, hosts, index)


def expand_node_list(node_list: str) -> list[str]:
    """Slurm's compact host list ("host[0-3],gpu7") as names, by Slurm's own scontrol (a plain
    comma-separated list needs none)."""
    if "[" not in node_list:
        return node_list.split(",")
    if shutil.which("scontrol") is None:
        raise ClusterError(f"cannot expand the node list {node_list}: scontrol (Slurm's client) is not on PATH")
    result = subprocess.run(["scontrol", "show", "hostnames", node_list], capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterError(f"scontrol could not expand the node list {node_list}: {result.stderr.strip()}")
    return result.stdout.split()


def default_rdzv_port(job_id: str) -> int:
    """A port every host derives alike from the job id, so no host must be told it."""
    return 20000 + int("".join(ch for ch in job_id if ch.isdigit()) or "0") % 20000


@dataclass
class Cluster:
    """This host's place in the cluster, after the rendezvous."""

    job: SlurmJob
    store: object  # torch.distributed.TCPStore
    head_address: str
    master_port: int
    nodes_per_host: int
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return f"slurm-{self.job.job_id}"

    @property
    def first_node(self) -> int:
        return self.job.host_index * self.nodes_per_host

    def session_id(self) -> str:
        return f"{self.name}-host{self.job.host_index}"

    def share_status(self, local_status: Callable[[], dict]) -> None:
        """Publishes this host's snapshot every second until stop_sharing()."""
        def publish() -> None:
            while not self._stop.wait(STATUS_INTERVAL_SECONDS):
                try:
                    self.store.set(f"status/{self.job.host_index}", json.dumps(local_status()))
                except Exception:  # the store's host ended first: nothing to share with any more
                    return
        threading.Thread(target=publish, daemon=True, name="mirage-cluster-status").start()

    def other_hosts_status(self) -> list[dict]:
        """The other hosts' latest snapshots (a host that published none yet is left out)."""
        found = []
        for host in range(len(self.job.hosts)):
            key = f"status/{host}"
            try:
                if host != self.job.host_index and self.store.check([key]):
                    found.append(json.loads(self.store.get(key)))
            except Exception:
                break
        return found

    def stop_sharing(self) -> None:
        self._stop.set()


def rendezvous(job: SlurmJob, num_nodes: int, port: int, timeout: float, free_port: Callable[[], int],
               narrate: Callable[[str], None]) -> Cluster:
    """Meets the other hosts through a TCPStore on host 0; raises ClusterError naming the hosts
    that did not join within `timeout` seconds."""
    from torch.distributed import TCPStore  # only `mirage node` pays for torch's import here

    hosts = len(job.hosts)
    head = job.hosts[0]
    narrate(f"cluster {job.job_id}: host {job.host_index}/{hosts} ({socket.gethostname()}), meeting the others "
            f"at {head}:{port}")
    try:
        store = TCPStore(head, port, hosts, job.host_index == 0, timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as err:  # a client whose master never answered, or a port already taken on host 0
        raise ClusterError(f"could not reach the job's first host {head}:{port} within {timeout:g} s ({err}); "
                           "is mirage node running there, and is the port free? (--rdzv-port, --rdzv-timeout)") from None
    address = socket.gethostbyname(socket.gethostname())
    store.set(f"host/{job.host_index}", json.dumps({"hostname": socket.gethostname(), "address": address,
                                                    "pid": os.getpid()}))
    if job.host_index == 0:
        store.set("master_port", str(free_port()))
    deadline = time.monotonic() + timeout
    keys = [f"host/{h}" for h in range(hosts)]
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [job.hosts[h] for h in range(hosts) if not store.check([f"host/{h}"])]
            raise ClusterError(f"host(s) {', '.join(missing)} did not join within {timeout:g} s: start mirage node on "
                               "every host of the job (srun --ntasks-per-node=1 over the whole allocation), or raise "
                               "--rdzv-timeout")
        time.sleep(0.1)
    head_address = json.loads(store.get("host/0"))["address"]
    return Cluster(job, store, head_address, int(store.get("master_port")), num_nodes // hosts)
