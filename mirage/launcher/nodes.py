"""Emulated nodes as machines of their own: one set of Linux namespaces per node.

On a real cluster each node has its own hostname, network interfaces, /dev/shm and System V IPC,
and traffic between nodes crosses a NIC. Code that groups ranks by hostname, binds to an
interface named in NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, or reaches MASTER_ADDR over the
network only behaves as on the cluster if the emulated nodes differ the same way. So, for a
session of several nodes, each node gets:

    UTS namespace     its own hostname (node0, node1, ... or --node-hostname's pattern)
    network namespace its own loopback and `eth0`, an address on the session's bridge
    IPC namespace     its own System V IPC and POSIX message queues
    mount namespace   its own /dev/shm (a tmpfs) and an /etc/hosts naming every node

    node0 (10.89.0.1) --eth0~veth--+
    node1 (10.89.0.2) --eth0~veth--+-- br0, in the session's "switch" namespace
    ...                            |

Everything lives in namespaces the session created: the host's own network namespace gets no
bridge, no veth and no address. Each namespace is held by one small process (`sleep`) that carries
the session's MIRAGE_SESSION, so the supervisor's teardown and the reaper (after a SIGKILLed run)
end it like any other process of the session; a namespace whose last process ends is gone, and with
it its veths, its bridge and its /dev/shm. Nothing has a name on the host (no `ip netns add`),
so nothing can be left behind.

The workload's processes enter their node with nsenter(1), which execs the command (its pid is
the one the supervisor started), so the rest of the launcher is unchanged.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SUBNET_PREFIX = "10.89"  # node k is 10.89.<k // 250>.<k % 250 + 1>/16; private to the session
INTERFACE = "eth0"
BRIDGE = "br0"
# Jumbo frames, as on a data-centre fabric; also what lets the veths carry bulk traffic at a
# useful fraction of memory bandwidth (1500-byte frames cost a packet per 1.5 KB).
MTU = 9000
HOSTNAME_PATTERN = "node{node}"
HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
TOOLS = ("unshare", "nsenter", "ip")
READY_TIMEOUT_SECONDS = 20.0
EXEC_TARGET = "MIRAGE_EXEC_NAMESPACES"  # `mirage exec`: the pid holding its node's namespaces

# Runs in the node's new namespaces: become the node, then hold them until killed. Its /dev/shm
# is a fresh tmpfs ($2 its size), or a host folder ($2 its path) that containers of the node
# mount too (--image: a container cannot join the node's mount namespace). sysfs shows
# the network devices of the namespace that mounted it, so the node's /sys/class/net (NCCL and
# users read interfaces and their counters there) comes from a sysfs mounted inside the node,
# bound over the host's; the rest of /sys (cgroups included) stays the host's.
NODE_HOLDER = (
    'hostname "$1" && case "$2" in /*) mount --bind "$2" /dev/shm ;; '
    '*) mount -t tmpfs -o mode=1777,size="$2" mirage-shm /dev/shm ;; esac && '
    'mount --bind "$3" /etc/hosts && ip link set lo up && mkdir "$4" && mount -t sysfs mirage-sys "$4" && '
    'mount --bind "$4/class/net" /sys/class/net && mount --bind "$4/devices/virtual/net" /sys/devices/virtual/net && '
    'umount -l "$4" && echo ready && exec sleep infinity </dev/null >/dev/null 2>&1'
)
SWITCH_HOLDER = (
    f"ip link add {BRIDGE} type bridge && ip link set {BRIDGE} mtu {MTU} up && echo ready && "
    "exec sleep infinity </dev/null >/dev/null 2>&1"
)


class IsolationError(Exception):
    """The nodes could not be put in namespaces of their own (why, and what to do)."""


def node_address(node: int) -> str:
    return f"{SUBNET_PREFIX}.{node // 250}.{node % 250 + 1}"


def hostnames(pattern: str, num_nodes: int) -> list[str]:
    """Each node's hostname from `pattern` ({node} is the node's index); raises ValueError
    naming what is wrong with the pattern."""
    if "{node}" not in pattern:
        raise ValueError(f"--node-hostname {pattern!r} must contain {{node}} so that each node's name "
                         "differs (example: --node-hostname 'gpu-{node}')")
    try:
        names = [pattern.format(node=node) for node in range(num_nodes)]
    except (KeyError, IndexError, ValueError):
        raise ValueError(f"--node-hostname {pattern!r}: only {{node}} may appear in braces "
                         "(example: --node-hostname 'gpu-{node}')") from None
    bad = [name for name in names if not HOSTNAME_RE.match(name)]
    if bad:
        raise ValueError(f"--node-hostname {pattern!r} gives {bad[0]!r}, not a valid hostname (letters, digits "
                         "and inner hyphens, at most 63)")
    return names


def unavailable_reason() -> str | None:
    """Why this machine cannot isolate nodes, or None if it can (as far as can be told before
    trying: the kernel may still refuse, which start() reports)."""
    if os.geteuid() != 0:
        return "creating network namespaces and veths needs root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (Debian: apt-get install util-linux iproute2)"
    return None


@dataclass
class NodeNamespaces:
    """The namespaces of a session's emulated nodes, from start() until close()."""

    session_id: str
    names: list[str]
    holders: list[subprocess.Popen] = field(default_factory=list)  # node holders, then the switch
    # Each node's /dev/shm as a host folder (made here, removed by the session's cleanup with its
    # segments), instead of a tmpfs private to the node; for containers (launcher/containers.py).
    shm_dirs: list[Path] | None = None

    @property
    def addresses(self) -> list[str]:
        return [node_address(node) for node in range(len(self.names))]

    def node_pid(self, node: int) -> int:
        """The process holding node `node`'s namespaces (nsenter's --target)."""
        return self.holders[node].pid

    def enter(self, node: int, argv: list[str], cwd: str | None) -> list[str]:
        """`argv` run inside node `node` in `cwd` (nsenter execs it: the pid stays the one started)."""
        return enter_argv(self.node_pid(node), argv, cwd)

    def start(self, session_dir: Path) -> None:
        """Creates the switch and every node, wires each node's eth0 to the bridge, and waits
        until all are ready; raises IsolationError (after closing what was made) if the kernel
        refuses any of it."""
        hosts = session_dir / "hosts"
        # Each node's name for its address, also in the IPv4-mapped IPv6 form a dual-stack server
        # (torch's TCPStore) sees its clients by: a cluster's DNS answers both.
        hosts.write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                         + "".join(f"{address}\t{name}\n::ffff:{address}\t{name}\n"
                                   for address, name in zip(self.addresses, self.names)))
        shm_size = str(_host_shm_bytes())
        for folder in self.shm_dirs or []:
            folder.mkdir(exist_ok=True)
            folder.chmod(0o1777)  # as a tmpfs /dev/shm
        environment = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
                       "MIRAGE_SESSION": self.session_id}
        try:
            for node, name in enumerate(self.names):
                shm = str(self.shm_dirs[node]) if self.shm_dirs else shm_size
                self.holders.append(self._hold(["--net", "--uts", "--ipc", "--mount", "--propagation", "private"],
                                               NODE_HOLDER, [name, shm, str(hosts), str(session_dir / f"sys-{name}")],
                                               environment))
            switch = self._hold(["--net"], SWITCH_HOLDER, [], environment)
            self.holders.append(switch)
            for holder in self.holders:
                self._wait_ready(holder)
            wiring = "".join(f"link add v{node} mtu {MTU} type veth peer name {INTERFACE} mtu {MTU} netns {pid}\n"
                             f"link set v{node} master {BRIDGE}\nlink set v{node} up\n"
                             for node, pid in enumerate(holder.pid for holder in self.holders[:-1]))
            _ip_batch(switch.pid, wiring)
            for node, address in enumerate(self.addresses):
                _ip_batch(self.node_pid(node), f"addr add {address}/16 dev {INTERFACE}\nlink set {INTERFACE} up\n")
        except (OSError, subprocess.SubprocessError, IsolationError) as err:
            self.close()
            raise IsolationError(str(err)) from None

    def close(self) -> None:
        """Ends the holders: the namespaces (and their veths, bridge, /dev/shm) go with them."""
        for holder in self.holders:
            if holder.poll() is None:
                holder.kill()
            holder.wait()

    @staticmethod
    def _hold(flags: list[str], script: str, args: list[str], environment: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(["unshare", *flags, "--", "sh", "-c", script, "mirage-node", *args],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=environment, start_new_session=True)

    @staticmethod
    def _wait_ready(holder: subprocess.Popen) -> None:
        line = holder.stdout.readline()  # the holder writes "ready", then closes its output
        if line.strip() != b"ready":
            holder.wait(timeout=READY_TIMEOUT_SECONDS)
            raise IsolationError(holder.stderr.read().decode(errors="replace").strip()
                                 or f"the namespace holder exited with code {holder.returncode}")
        holder.stdout.close()
        holder.stderr.close()


def enter_argv(pid: int, argv: list[str], cwd: str | None = None) -> list[str]:
    """`argv` run in the namespaces process `pid` holds, in `cwd` (default: ours; entering a
    mount namespace would otherwise start it in the holder's)."""
    return ["nsenter", f"--target={pid}", "--net", "--uts", "--ipc", "--mount",
            f"--wd={os.path.abspath(cwd or os.getcwd())}", "--", *argv]


def _ip_batch(pid: int, commands: str) -> None:
    result = subprocess.run(["nsenter", f"--target={pid}", "--net", "ip", "-batch", "-"], input=commands.encode(),
                            capture_output=True)
    if result.returncode != 0:
        raise IsolationError(f"ip failed: {result.stderr.decode(errors='replace').strip()}")


def _host_shm_bytes() -> int:
    """Each node's /dev/shm is as large as the host's, as nodes of one kind are alike."""
    stats = os.statvfs("/dev/shm")
    return stats.f_blocks * stats.f_frsize
