"""A session from a checked request: `mirage run` (run_session) and `mirage node`, a host's share
of a cluster across hosts (run_node).

It builds the device shim if it is not cached, creates the session's private directory, starts
the fork server, the nodes' namespaces, the session service and the workload with the runtime
armed, and tears everything down however the run ends.
"""

from __future__ import annotations

import os
import secrets
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mirage import forkserver, profiles
from mirage.forkserver import server as fork_server_process
from mirage.launcher import environment
from mirage.daemon import shared_table
from mirage.daemon.flight_recorder import FlightRecorder
from mirage.daemon.service import SessionService
from mirage.launcher import cluster as clusters, containers, containment, faults as fault_specs, nodes, summary, timing_report
from mirage.launcher.request import LaunchError, RunRequest, UsageError, validate
from mirage.launcher.supervisor import Supervisor, start_reaper, stdin_has_input, write_or_discard
from mirage.runtime import visible_devices
from mirage.shim import build as shim_build

HEAD_ADDR = "127.0.0.1"  # where node 0 is reached when the nodes share this host's network


def narrate(message: str) -> None:
    """Progress and warnings go to stderr, never stdout (the workload owns stdout)."""
    write_or_discard(sys.stderr, f"mirage: {message}\n".encode())


def runtime_root() -> Path:
    """The per-user directory holding live sessions ($XDG_RUNTIME_DIR/mirage or /tmp)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(xdg) / "mirage" if xdg and os.access(xdg, os.W_OK) else Path(tempfile.gettempdir()) / f"mirage-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


def ensure_shim() -> Path:
    """The device shim (and the emulated NCCL next to it) for the installed torch, built in a
    clean subprocess if not cached; returns the shim's path."""
    path = shim_build.library_path()
    if path.exists() and shim_build.nccl_module_path().exists():
        return path
    narrate("building the device shim for this torch (first run only: a few minutes on 2 cores)")
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith("MIRAGE_SHIM")}
    result = subprocess.run([sys.executable, "-m", "mirage.shim.build"], env=clean_env,
                            capture_output=True, text=True)
    if result.returncode != 0 or not path.exists() or not shim_build.nccl_module_path().exists():
        raise LaunchError("building the device shim failed (a C++ compiler, g++, is needed):\n"
                          + result.stderr[-4000:])
    return path


def write_output(flag: str, path: str, write: Callable[[str], object]) -> bool:
    """Writes an end-of-session file; a failure (disk full, the folder gone) is one line on stderr,
    not a traceback, so the workload's exit code still stands. True when written."""
    try:
        write(str(Path(path).expanduser()))
        return True
    except OSError as err:
        write_or_discard(sys.stderr, f"mirage: {flag} {path} not written: {err.strerror or err}\n".encode())
        return False


def free_port() -> int:
    """A TCP port that nothing on this host listens on now (for MASTER_PORT; isolated nodes have
    all their ports free, and this one is as good as any there)."""
    with socket.socket() as probe:
        probe.bind((HEAD_ADDR, 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Placement:
    """One workload process: which node it is on and the identity it gets."""

    node: int
    local_rank: int
    rank: int
    world_size: int


def placements(num_nodes: int, nproc_per_node: int | None) -> list[Placement]:
    """Without --nproc-per-node the command runs once per node (rank = node); with it, K ranks
    per node, RANK = node * K + LOCAL_RANK, as torchrun numbers them."""
    per_node = nproc_per_node or 1
    world = num_nodes * per_node
    return [Placement(node, local, node * per_node + local, world)
            for node in range(num_nodes) for local in range(per_node)]


def identity(session_id: str, session_dir: Path, place: Placement, num_nodes: int, port: int,
             head: str = HEAD_ADDR) -> dict[str, str]:
    """The job identity of one process: set last, never overridable by --env.

    A one-process job gets no rank variables, as `python train.py` on a real box has none (a
    launcher that starts its own workers unless LOCAL_RANK is set must not take itself for
    one); --env may set them. A multi-process job gets torchrun's (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, GROUP_RANK) and NODE_RANK."""
    ranks = {} if place.world_size == 1 else {
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_WORLD_SIZE": str(place.world_size // num_nodes),
        "GROUP_RANK": str(place.node),
        "NODE_RANK": str(place.node),
    }
    return {
        **ranks,
        "MASTER_ADDR": head,
        "MASTER_PORT": str(port),
        "MIRAGE_HEAD_ADDR": head,
        "MIRAGE_HEAD_PORT": str(port),
        "MIRAGE_NODE_RANK": str(place.node),
        "MIRAGE_NUM_NODES": str(num_nodes),
        "MIRAGE_SESSION": session_id,
        "MIRAGE_RUNTIME": str(session_dir),
        "NCCL_HOSTID": f"mirage-{session_id}-node{place.node}",
    }


def _warn_if_every_gpu_hidden(env: dict[str, str], gpus: int, amd: bool) -> None:
    """The workload inherits *_VISIBLE_DEVICES, which the emulated GPUs honour; a value meant for
    the host (CI boxes hide real GPUs with CUDA_VISIBLE_DEVICES="") would leave it none."""
    if gpus and not visible_devices.visible_gpus(gpus, amd, env):
        chosen = ", ".join(f"{key}={env[key]!r}" for key in visible_devices.variables(amd) if key in env)
        narrate(f"warning: {chosen} hides every emulated GPU from the workload (torch.cuda.device_count() "
                f"will be 0). Unset it, or pick GPUs 0-{gpus - 1} with --env CUDA_VISIBLE_DEVICES=...")


RUN_PID_NAME = "run.pid"


def record_run(session_dir: Path) -> None:
    """Names this process as the session's run: `<pid> <start time>` (the start time tells a
    reused pid apart)."""
    (session_dir / RUN_PID_NAME).write_text(f"{os.getpid()} {process_start_time(os.getpid())}\n")


def process_start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[19]


def _finish_timing(request: RunRequest, profile: profiles.Profile, directory: Path) -> dict | None:
    """Clocked mode's end: the predicted timing report on stderr, and the trace file."""
    if not request.timing:
        return None
    reports = timing_report.collect(directory)
    report = timing_report.build(reports, profile, request.stand_ins * request.stand_ins_in_node)
    write_or_discard(sys.stderr, (timing_report.render(report) + "\n").encode())
    if request.trace:
        written: list[int] = []
        if write_output("--trace", request.trace, lambda path: written.append(timing_report.write_trace(reports, path))):
            narrate(f"trace of the predicted timeline: {request.trace} ({written[0]} events; open it in ui.perfetto.dev)")
    return report


def _isolate(request: RunRequest, session_id: str, session_dir: Path) -> nodes.NodeNamespaces | None:
    """Puts each emulated node in namespaces of its own (launcher/nodes.py) when asked for with
    --isolate-nodes or --image. By default emulated nodes are what the reference tool's nodes are:
    groups of processes on this host, sharing its network, so one command gives one result
    whoever runs it (isolation needs root). validate() has refused a request this machine cannot
    meet; what is left is the kernel refusing, which is reported, never dropped silently."""
    if not (request.isolate_nodes or request.image is not None):
        return None
    namespaces = nodes.NodeNamespaces(session_id, nodes.hostnames(request.node_hostname, request.num_nodes))
    if request.image is not None:  # a container cannot join the node's mount namespace: host folders
        namespaces.shm_dirs = [containers.node_shm_dir(session_id, node) for node in range(request.num_nodes)]
    try:
        namespaces.start(session_dir)
    except nodes.IsolationError as err:
        flag = "--image" if request.image is not None else "--isolate-nodes"
        raise UsageError(f"{flag}: the kernel refused: {err}. Fix: run where namespaces can be created (root, or "
                         "a container started with --privileged), or drop {flag}") from None
    return namespaces


def run_node(request: RunRequest, rdzv_port: int | None, rdzv_timeout: float) -> int:
    """`mirage node`: this host's share of a cluster across hosts started by Slurm
    (launcher/cluster.py); returns the exit code of this host's workload."""
    if request.image is not None:
        raise UsageError("--image applies to mirage run on one host; across hosts, run mirage node in the image "
                         "itself (srun --container-image=..., or your site's container wrapper)")
    if request.isolate_nodes:
        raise UsageError("--isolate-nodes applies to mirage run on one host; across hosts each host is a machine "
                         "of its own already (drop --isolate-nodes)")
    request.isolate_nodes = False
    if request.stand_ins != 1 or request.stand_ins_in_node != 1:
        raise UsageError("--stand-ins and --stand-ins-in-node apply to mirage run on one host (they exist to fit a "
                         "large job on one); "
                         "across hosts, run every rank")
    validate(request)
    try:
        job = clusters.SlurmJob.from_environment(dict(os.environ))
    except clusters.ClusterError as err:
        raise UsageError(str(err)) from None
    if request.num_nodes == 1 and len(job.hosts) > 1:
        request.num_nodes = len(job.hosts)  # default: one emulated node per host
    if request.num_nodes % len(job.hosts):
        raise UsageError(f"--num-nodes {request.num_nodes} does not split over the job's {len(job.hosts)} host(s); "
                         f"give a multiple of {len(job.hosts)} (each host runs the same number of emulated nodes)")
    try:
        cluster = clusters.rendezvous(job, request.num_nodes, rdzv_port or clusters.default_rdzv_port(job.job_id),
                                      rdzv_timeout, free_port, narrate)
    except clusters.ClusterError as err:
        raise LaunchError(str(err)) from None
    return run_session(request, cluster)


def run_session(request: RunRequest, cluster: clusters.Cluster | None = None) -> int:
    """Runs the request as one session (in a cluster across hosts, this host's share of it);
    returns the exit code for the shell."""
    profile, gpus = validate(request)
    stand_ins = request.stand_ins  # the session runs 1/stand_ins of the job's nodes
    request = replace(request, num_nodes=request.num_nodes // stand_ins)
    session_id = cluster.session_id() if cluster else time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    session_dir = runtime_root() / session_id
    start_reaper(session_dir)  # before arm_signals makes this process a subreaper
    supervisor = Supervisor(session_id, narrate)
    supervisor.arm_signals()
    session_dir.mkdir(mode=0o700)
    record_run(session_dir)
    cgroup = containment.enter_session_cgroup(session_id, session_dir)  # before anything starts
    service: SessionService | None = None
    exit_code = 1
    started = time.time()
    timer: fault_specs.FaultTimer | None = None
    node_killer: fault_specs.NodeKiller | None = None
    namespaces: nodes.NodeNamespaces | None = None
    in_image: containers.NodeContainers | None = None
    fork_server: fork_server_process.ForkServer | None = None
    seed = request.seed if request.seed is not None else secrets.randbelow(2**31)
    faults = fault_specs.load(request.faults, request.faults_file, seed, request.num_nodes * gpus, request.num_nodes,
                              request.timing)
    if request.seed is None and any(f.drawn for f in faults):
        narrate(f"faults at random counts drawn with seed {seed} (--seed {seed} draws the same)")
    try:
        shim = ensure_shim()
        scratch = session_dir / "tmp"
        scratch.mkdir(mode=0o700)
        if request.image is not None:
            cache = shim_build.cache_root().resolve()
            try:
                image_shim, image_nccl = containers.prepare(request.image, cache, narrate)
            except containers.ImageError as err:
                raise LaunchError(str(err)) from None
            in_image = containers.NodeContainers(request.image, session_id, session_dir, cache, image_shim, image_nccl)
        timing_dir = session_dir / "timing"
        processes = placements(request.num_nodes, request.nproc_per_node)
        local_nodes = range(cluster.first_node, cluster.first_node + cluster.nodes_per_host) if cluster else None
        if local_nodes:
            processes = [place for place in processes if place.node in local_nodes]
        emulator = {
            "MIRAGE_SHIM_PATH": str(shim),
            "MIRAGE_NCCL_PATH": str(shim_build.nccl_module_path()),
            "MIRAGE_PROFILE": str(profile.path),
            "MIRAGE_NUM_GPUS": str(gpus),
            # Scratch (torchrun's error files, tempfile) lives and dies with the session.
            "TMPDIR": str(scratch),
            # What outlives a run on a real box beside those files (inductor's compile cache,
            # /tmp/torchinductor_<user>) stays in the user's own temp dir: mirage/runtime/inductor.py
            "MIRAGE_USER_TMPDIR": tempfile.gettempdir(),
        }
        if request.lazy_device_memory:
            emulator["MIRAGE_LAZY_DEVICE_MEMORY"] = "1"
        if request.check_races != "off":
            emulator["MIRAGE_CHECK_RACES"] = request.check_races  # mirage/shim/race_checker.h
        if request.timing:
            timing_dir.mkdir(mode=0o700)
            # MIRAGE_CLOCK_EPOCH_NS: where predicted time 0 lies on the wall clock, one for the
            # whole job, so that traces of the predicted GPU side line up across ranks
            emulator.update({"MIRAGE_TIMING": "1", "MIRAGE_TIMING_DIR": str(timing_dir),
                             "MIRAGE_CLOCK_EPOCH_NS": str(time.time_ns())})
            if request.trace:
                emulator["MIRAGE_TRACE"] = "1"
            if request.virtual_clock:
                emulator["MIRAGE_VIRTUAL_CLOCK"] = "1"
            if request.predict_only:
                emulator["MIRAGE_PREDICT_ONLY"] = "1"
            if stand_ins > 1 or request.stand_ins_in_node > 1:
                emulator["MIRAGE_STAND_INS"] = str(stand_ins)
                emulator["MIRAGE_STAND_INS_IN_NODE"] = str(request.stand_ins_in_node)
                if request.stand_ins_stride:
                    emulator["MIRAGE_STAND_INS_STRIDE"] = str(request.stand_ins_stride)
            if request.timing_tuning:
                emulator["MIRAGE_TIMING_TUNING"] = str(Path(request.timing_tuning).expanduser().resolve())
        if faults:
            (session_dir / "faults").mkdir(mode=0o700)
            emulator.update(fault_specs.environment(faults))
            for fault in faults:
                narrate(f"fault {fault.id} armed: {fault.describe()}")
            fault_specs.fire_at_start(session_dir / "faults", faults, narrate)
            if any(f.kind == "kill-node" and f.trigger == "collective" for f in faults):
                node_killer = fault_specs.NodeKiller(faults, session_id, session_dir / "faults", narrate, supervisor)
                node_killer.start()
        user = environment.parse_assignments(request.env)
        port = cluster.master_port if cluster else free_port()
        per_node = request.nproc_per_node or 1
        if per_node > 1 and "OMP_NUM_THREADS" not in user and (request.clear_env or "OMP_NUM_THREADS" not in os.environ):
            # As torchrun does for several processes a node: each rank's OpenMP workers would
            # otherwise spin on cores the other ranks need (with backward on the calling thread,
            # libgomp no longer throttles them: tests/test_distributed's 8-rank DDP took 15x longer).
            narrate("setting OMP_NUM_THREADS=1 for each rank, as torchrun does; set it yourself to change it")
            user = {**user, "OMP_NUM_THREADS": "1"}
        # The session's processes start as forks of it (mirage/forkserver); not in containers of
        # another image, whose torch is not the server's. Started first: its import of torch
        # (seconds) is what the first rank waits for, and needs neither the nodes nor the service.
        if request.fork_server and request.image is None:
            try:
                fork_server = fork_server_process.start(
                    environment.build(emulator=emulator, user=user, clear=request.clear_env,
                                      identity=identity(session_id, session_dir, processes[0], request.num_nodes, port)),
                    session_dir / forkserver.SOCKET_NAME)
                emulator[forkserver.SOCKET_ENV] = str(fork_server.socket_path)
            except OSError as err:
                narrate(f"the fork server could not start ({err}); every process starts on its own")
        namespaces = _isolate(request, session_id, session_dir)
        head = cluster.head_address if cluster else namespaces.addresses[0] if namespaces else HEAD_ADDR
        # Isolated nodes: the emulated NCCL goes through each node's eth0 between nodes, and gloo
        # finds its address from the hostname (/etc/hosts), as on a cluster. Otherwise every
        # emulated node is on loopback (gloo groups a user asks for included).
        emulator.update({"MIRAGE_ISOLATED_NODES": "1"} if namespaces or cluster else {"GLOO_SOCKET_IFNAME": "lo"})
        narrate(f"session {session_id} ({request.num_nodes} node(s) x {gpus} x {profile.torch_name}, "
                f"{len(processes)} process(es)" + (f", in containers of image {request.image})" if in_image else ")"))
        if stand_ins > 1 or request.stand_ins_in_node > 1:
            in_node = request.stand_ins_in_node
            narrate(f"stand-ins: {request.num_nodes} of the job's {request.num_nodes * stand_ins} nodes run"
                    + (f", 1 of every {in_node} ranks of each" if in_node > 1 else "")
                    + f"; each running rank stands for {stand_ins * in_node} ranks (itself included)")

        def node_environment(node: int, exec_lease: bool = False) -> dict[str, str]:
            place = Placement(node, 0, node * per_node, request.num_nodes * per_node)
            env = environment.build(emulator=emulator, user=user, clear=request.clear_env,
                                    identity=identity(session_id, session_dir, place, request.num_nodes, port, head))
            if exec_lease:
                env["MIRAGE_EXEC"] = "1"
                if namespaces:
                    env[nodes.EXEC_TARGET] = str(namespaces.node_pid(node))
            return env

        if not request.in_process:
            def diagnosis(report: str, code: int) -> None:
                narrate(report)
                narrate(f"ending the session (exit code {code})")
                supervisor.abort(code)

            recorder = FlightRecorder(request.hang_timeout, diagnosis)
            service = SessionService(session_id, session_dir, profile.name, profile.torch_name, profile.memory_bytes,
                                     request.num_nodes, gpus, lambda node: node_environment(node, True), recorder,
                                     profile=profile)
            recorder.locate = service.stack_of
            if cluster:
                service.local_nodes, service.other_hosts = local_nodes, cluster.other_hosts_status
                cluster.share_status(lambda: service.status(with_other_hosts=False))
            try:
                service.start()
            except OSError as err:
                raise LaunchError(f"the session service could not start ({err}); it needs a writable "
                                  f"/dev/shm and {session_dir}. Fix: free them, or run with --in-process") from None
            recorder.start()
            emulator.update(service.environment())
        single = len(processes) == 1
        if not single and stdin_has_input():
            narrate("stdin has input, but no rank of a multi-process job reads stdin")
        for place in processes:
            if request.num_nodes > 1 and place.local_rank == 0:
                narrate(f"starting node {place.node + 1}/{request.num_nodes}")
            env = environment.build(
                emulator=emulator, user=user,
                identity=identity(session_id, session_dir, place, request.num_nodes, port, head),
                clear=request.clear_env, warn=narrate if place.rank == 0 else (lambda _: None),
            )
            if place.rank == 0:
                _warn_if_every_gpu_hidden(env, gpus, profile.is_amd)
            if in_image and namespaces:
                argv = in_image.argv(place.node, place.rank, namespaces.node_pid(place.node), request.command, env, user,
                                     request.workdir, interactive=single)
            elif namespaces:
                argv = namespaces.enter(place.node, request.command, request.workdir)
            else:
                argv = request.command
            try:
                supervisor.start(argv, env, request.workdir, label=None if single else str(place.rank))
            except FileNotFoundError:
                narrate(f"command not found: {request.command[0]}")
                exit_code = 127
                return exit_code
            except PermissionError:
                narrate(f"command is not executable: {request.command[0]}")
                exit_code = 126
                return exit_code
        if any(f.trigger == "after" for f in faults):
            timer = fault_specs.FaultTimer(faults, session_id, session_dir / "faults", started, narrate, supervisor)
            timer.start()
        exit_code = supervisor.wait()
        if service is not None:
            service.wait_for_leases(narrate)
        return exit_code
    finally:
        if timer is not None:
            timer.stopped.set()
        if node_killer is not None:
            node_killer.stop()
        if cluster is not None:
            cluster.stop_sharing()
        supervisor.teardown()
        if fork_server is not None:
            fork_server.stop()
        if in_image is not None:
            containers.remove_containers(session_dir)
        if namespaces is not None:
            namespaces.close()
        supervisor.kill_the_rest(cgroup)
        timing = _finish_timing(request, profile, session_dir / "timing")
        if service is not None:
            service.stop()
            report = summary.build(service, supervisor.exit_codes, exit_code)
            if faults:
                report["faults"] = fault_specs.fired(session_dir / "faults", faults, started)
                report["fault_effects"] = fault_specs.effects(session_dir / "faults", report["faults"], started)
            if timing is not None:
                report["timing"] = timing
            if not request.quiet:
                write_or_discard(sys.stderr, (summary.render(report) + "\n").encode())
            if request.summary_json:
                write_output("--summary-json", request.summary_json, lambda path: summary.write(report, path))
        shutil.rmtree(session_dir, ignore_errors=True)
        # Communicator segments a rank left mapped-by-one-side only (it died, or its peer never
        # came): gone with the session, with or without a service (--in-process).
        for segment in shared_table.segments(session_id):
            shared_table.remove(segment)
