"""Isolated emulated nodes (launcher/nodes.py, `--isolate-nodes`): each node its own hostname,
network, /dev/shm; the emulated NCCL crosses eth0 only between nodes; nothing left on the host
afterwards. By default nodes share this host, whoever runs mirage; asking for isolation where it
cannot be had is refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, mirage
from escapees import HIDING_COUNT, WatchedCgroup, hiding_workload, recorded, still_running
from test_session import session_of, start
from mirage.launcher import nodes
from mirage.launcher.supervisor import session_processes

needs_isolation = pytest.mark.skipif(nodes.unavailable_reason() is not None,
                                     reason=f"cannot isolate nodes here: {nodes.unavailable_reason()}")
MIB = 16


def host_network() -> dict[str, int]:
    """What could be left on the host: network namespaces in use (by inode), and links in ours."""
    namespaces = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                namespaces.add(os.stat(entry / "ns" / "net").st_ino)
            except OSError:
                pass
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout.splitlines()
    return {"namespaces": len(namespaces), "links": len(links)}


@needs_isolation
def test_each_node_has_its_own_hostname_network_and_shared_memory_and_nccl_crosses_eth0_only_between_nodes():
    result = mirage("run", "--quiet", "--isolate-nodes", "--num-nodes", "2", "--gpus-per-node", "2",
                    "--nproc-per-node", "2", "--", "python", "tests/workloads/isolated_nodes.py", str(MIB))
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = {line["rank"]: line for line in
             (json.loads(text.split("] ", 1)[1]) for text in result.stdout.splitlines() if '"rank"' in text)}
    assert sorted(ranks) == [0, 1, 2, 3]
    for rank, seen in ranks.items():
        node = rank // 2
        assert seen["hostname"] == f"node{node}" and seen["resolves"] == nodes.node_address(node)
        assert seen["master"] == nodes.node_address(0)
        # Only this node's ranks' files: /dev/shm is the node's own.
        assert seen["shm"] == [f"isolated-nodes-test-rank{r}" for r in (2 * node, 2 * node + 1)]
        assert seen["sum"] == (4.0 if rank % 2 == 0 else 2.0)  # the node's sum, then (rank 0 of each) both nodes'
    payload = MIB << 20
    for node in (0, 1):
        seen = ranks[2 * node]  # both ranks of a node read the same eth0
        # Within a node: shared memory, nothing on the wire (a few hundred bytes of gloo's barriers).
        assert seen["sent_within"] < payload // 100
        # Across: the node's whole contribution leaves through eth0.
        assert seen["sent_across"] >= payload


@needs_isolation
def test_hostnames_follow_the_users_pattern_and_a_bad_pattern_is_refused():
    result = mirage("run", "--quiet", "--isolate-nodes", "--num-nodes", "3", "--node-hostname", "gpu-{node}-a", "--",
                    "hostname")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split()) == ["[0]", "[1]", "[2]", "gpu-0-a", "gpu-1-a", "gpu-2-a"]
    for pattern, why in (("gpu", "must contain {node}"), ("gpu_{node}", "not a valid hostname"),
                         ("{rank}-{node}", "only {node} may appear")):
        refused = mirage("run", "--isolate-nodes", "--num-nodes", "2", "--node-hostname", pattern, "--", "hostname")
        assert refused.returncode == 2 and why in refused.stderr and "node" not in refused.stdout


@pytest.mark.parametrize("flags", [[], ["--no-isolate-nodes"]], ids=["default", "no-isolate-nodes"])
def test_nodes_share_the_hosts_network_by_default(flags):
    """An emulated node is by default what the reference tool's is: processes of this host, on
    its network, root or not (--no-isolate-nodes is kept as an alias for scripts)."""
    result = mirage("run", "--quiet", "--num-nodes", "2", *flags, "--", "sh", "-c", "hostname; echo $MASTER_ADDR")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"] {os.uname().nodename}") == 2 and result.stdout.count("] 127.0.0.1") == 2


def test_isolation_is_refused_where_it_cannot_be_had(tmp_path):
    """--isolate-nodes is never dropped silently: without iproute2/util-linux (here: not on PATH)
    it is refused before anything starts, with the reason and the fix, exit 2."""
    result = mirage("run", "--isolate-nodes", "--num-nodes", "2", "--", "true",
                    env={**os.environ, "PATH": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert "--isolate-nodes:" in result.stderr and "not found (Debian: apt-get install util-linux iproute2)" in \
        result.stderr and "Fix:" in result.stderr
    assert "session" not in result.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to another user")
def test_isolation_is_refused_for_a_user_who_is_not_root(tmp_path):
    """The same command as a user who is not root: refused with exit 2, not run without isolation."""
    tmp_path.chmod(0o777)
    result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                             "mirage", "run", "--isolate-nodes", "--num-nodes", "2", "--", "true"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
                                 "XDG_RUNTIME_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert "--isolate-nodes: creating network namespaces and veths needs root" in result.stderr


@needs_isolation
def test_loopback_as_the_nccl_interface_across_nodes_fails_as_on_a_cluster():
    """A multi-node bug reproduced: NCCL_SOCKET_IFNAME=lo works on one box, not across nodes."""
    result = mirage("run", "--quiet", "--isolate-nodes", "--num-nodes", "2", "--gpus-per-node", "1",
                    "--env", "NCCL_SOCKET_IFNAME=lo",
                    "--env", "NCCL_SHM_DISABLE=1", "--env", "NCCL_P2P_DISABLE=1", "--",
                    "python", "tests/fixtures/ml/dist_smoke.py")
    assert result.returncode != 0
    assert "connecting to group rank 0 at 127.0.0.1" in result.stderr and "reach each other on eth0" in result.stderr


@needs_isolation
def test_sigkill_of_mirage_leaves_no_namespace_veth_bridge_or_process(tmp_path):
    """Processes are found without mirage's rule: the pids the workload recorded, one of them with
    an empty environment in a session of its own, and the test's cgroup (tests/escapees.py)."""
    before = host_network()
    record = tmp_path / "pids"
    watched = WatchedCgroup()
    proc = start("--isolate-nodes", "--num-nodes", "3", "--", *hiding_workload(record), watched=watched)
    session = session_of(proc)
    deadline = time.monotonic() + 60
    while host_network()["namespaces"] < before["namespaces"] + 4 and time.monotonic() < deadline:
        time.sleep(0.1)  # 3 nodes and the switch
    assert host_network()["namespaces"] == before["namespaces"] + 4
    assert host_network()["links"] == before["links"]  # the bridge and veths are in the session's namespaces
    hidden = recorded(record, 3 * HIDING_COUNT, proc)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20  # a guard against hanging: the reaper's work
        while time.monotonic() < deadline:
            alive = session_processes(session) + watched.processes() + still_running(hidden)
            if not alive and host_network() == before:
                break
            time.sleep(0.2)
        assert not alive and host_network() == before
    finally:
        watched.remove()

