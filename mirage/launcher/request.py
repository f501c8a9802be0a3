"""What `mirage run` was asked to do (RunRequest) and the checks made before anything starts:
the profile, GPU and node counts, flags that need others, paths the session writes at its end,
what the machine can hold, and a CPU build of torch. A request refused here exits with code 2
(UsageError); one that passes may still fail to come up (LaunchError, code 1)."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mirage import profiles
from mirage.launcher import capacity, containers, environment, faults as fault_specs, nodes

MAX_GPUS_PER_NODE = 64
MAX_NODES = 64


class UsageError(Exception):
    """A request mirage refuses before bringing anything up (exit code 2)."""


class LaunchError(Exception):
    """The session could not come up (exit code 1)."""


@dataclass
class RunRequest:
    """Everything `mirage run` was asked to do."""

    command: list[str]
    profile: str = profiles.DEFAULT_PROFILE
    gpus_per_node: int | None = None
    num_nodes: int = 1
    nproc_per_node: int | None = None
    env: list[str] = field(default_factory=list)
    workdir: str | None = None
    clear_env: bool = False
    in_process: bool = False
    hang_timeout: float = 300.0
    quiet: bool = False
    summary_json: str | None = None
    timing: bool = False                 # clocked mode: predict the run on the profiled hardware
    trace: str | None = None             # write the predicted timeline (Chrome/Perfetto trace)
    virtual_clock: bool = False          # the workload's time.* follow the predicted clock
    timing_tuning: str | None = None     # a TOML file overriding the model's numbers
    predict_only: bool = False           # place kernels on the timeline without running them
    stand_ins: int = 1                   # each running rank stands for this many data-parallel replicas
    stand_ins_stride: int | None = None  # the data-parallel index changes every this many ranks (None: outermost)
    stand_ins_in_node: int = 1           # in each running node, one of every this many local ranks runs
    lazy_device_memory: bool = False     # device memory is host memory only where written
    check_races: str = "off"             # --check-races: "error", "warn" or "off"
    faults: list[str] = field(default_factory=list)  # --fault specs (mirage/launcher/faults.py)
    faults_file: str | None = None       # --faults FILE
    seed: int | None = None              # draws the counts of faults at 'random'
    # Namespaces per node (launcher/nodes.py), only when asked for; None is the default (the nodes
    # share this host), False an explicit --no-isolate-nodes (which --image refuses).
    isolate_nodes: bool | None = None
    node_hostname: str = nodes.HOSTNAME_PATTERN
    image: str | None = None             # each node's processes in podman containers (launcher/containers.py)
    fork_server: bool = True             # Python processes forked from one that imported torch


def check_torch_is_cpu_build() -> None:
    """mirage emulates the GPU inside a CPU build of torch; a CUDA/ROCm build cannot host it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        raise UsageError(f"torch is not installed for {sys.executable}; install the CPU build: "
                         "pip install torch==2.13.0")
    lib = Path(spec.origin).parent / "lib"
    for gpu_lib in ("libtorch_cuda.so", "libtorch_hip.so"):
        if (lib / gpu_lib).exists():
            raise UsageError(f"the torch at {lib.parent} is a GPU build ({gpu_lib}); mirage needs the "
                             "CPU build: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")


def validate(request: RunRequest) -> tuple[profiles.Profile, int]:
    """Checks the request; returns the profile and the GPU count per node."""
    if not request.command:
        raise UsageError("no command to run; put it after `--`: mirage run -- python train.py")
    try:
        profile = profiles.load(request.profile)
    except profiles.ProfileError as err:
        raise UsageError(str(err)) from None
    gpus = profile.gpus_per_node if request.gpus_per_node is None else request.gpus_per_node
    if not 1 <= gpus <= MAX_GPUS_PER_NODE:
        raise UsageError(f"--gpus-per-node {gpus} is out of range; use 1 to {MAX_GPUS_PER_NODE}")
    if not 1 <= request.num_nodes <= MAX_NODES:
        raise UsageError(f"--num-nodes {request.num_nodes} is out of range; use 1 to {MAX_NODES}")
    _validate_stand_ins(request, gpus)
    if request.nproc_per_node is not None and not 1 <= request.nproc_per_node <= MAX_GPUS_PER_NODE:
        raise UsageError(f"--nproc-per-node {request.nproc_per_node} is out of range; use 1 to {MAX_GPUS_PER_NODE}")
    if not request.hang_timeout > 0:  # also refuses nan
        raise UsageError(f"--hang-timeout {request.hang_timeout:g} must be a positive number of seconds "
                         "(e.g. --hang-timeout 600)")
    if request.workdir and not Path(request.workdir).is_dir():
        raise UsageError(f"--workdir {request.workdir} is not a directory")
    try:
        environment.parse_assignments(request.env)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if request.summary_json:
        check_output_path("--summary-json", request.summary_json, "summary.json")
    try:
        fault_specs.load(request.faults, request.faults_file, request.seed, request.num_nodes * gpus,
                         request.num_nodes, request.timing)
    except fault_specs.FaultError as err:
        raise UsageError(str(err)) from None
    _validate_timing(request, profile)
    if request.check_races not in ("error", "warn", "off"):
        raise UsageError(f"--check-races={request.check_races} is not a mode; use error, warn or off")
    if request.check_races != "off" and request.predict_only:
        raise UsageError("--check-races with --predict-only: the checker follows the kernels as they run, and "
                         "--predict-only runs none. Fix: drop one of them")
    try:
        nodes.hostnames(request.node_hostname, request.num_nodes)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if request.image is not None:
        _validate_image(request)
    if request.node_hostname != nodes.HOSTNAME_PATTERN and not (request.isolate_nodes or request.image is not None):
        raise UsageError("--node-hostname names isolated nodes; without --isolate-nodes every node has this host's "
                         "hostname. Fix: add --isolate-nodes")
    if request.isolate_nodes and (reason := nodes.unavailable_reason()):
        raise UsageError(f"--isolate-nodes: {reason}. Fix: run mirage as root with util-linux and iproute2, "
                         "or drop --isolate-nodes (the nodes then share this host's network)")
    check_torch_is_cpu_build()
    try:
        capacity.check(request.command, request.num_nodes // request.stand_ins, request.nproc_per_node, gpus,
                       request.fork_server)
    except capacity.CapacityError as err:
        raise UsageError(str(err)) from None
    return profile, gpus


def _validate_image(request: RunRequest) -> None:
    """--image: containers joined to isolated nodes' namespaces; refused before anything starts
    where that cannot work."""
    if request.isolate_nodes is False:
        raise UsageError("--image runs each node's processes in a container joined to the node's own namespaces, "
                         "so it needs isolated nodes. Fix: drop --no-isolate-nodes")
    if not request.image:
        raise UsageError("--image needs an image name, e.g. --image localhost/mirage-node:test")
    if reason := containers.unavailable_reason(request.image):
        raise UsageError(f"--image {request.image}: {reason}")
    if reason := nodes.unavailable_reason():
        raise UsageError(f"--image needs isolated nodes, and {reason}. Fix: run mirage as root with util-linux "
                         "and iproute2")


def _validate_stand_ins(request: RunRequest, gpus: int) -> None:
    """--stand-ins K and --stand-ins-in-node T: refused where their assumption cannot hold. The
    session runs 1/K of the job's nodes (run.py), 1/T of each node's ranks go on past start-up, and
    their workers are told the full world (runtime/boot.py)."""
    copies, in_node = request.stand_ins, request.stand_ins_in_node
    if copies < 1:
        raise UsageError(f"--stand-ins {copies} must be a positive number of replicas each running rank stands "
                         "for (e.g. --stand-ins 8)")
    if in_node < 1 or gpus % in_node:
        raise UsageError(f"--stand-ins-in-node {in_node} must divide --gpus-per-node {gpus}: each running rank "
                         "stands for the ranks of its tensor-parallel group on its node. Fix: the tensor-parallel "
                         "degree, e.g. --stand-ins-in-node 8")
    if copies == 1 and request.stand_ins_stride is not None:
        raise UsageError("--stand-ins-stride says how --stand-ins lays out the replicas. Fix: add --stand-ins K")
    if copies == 1 and in_node == 1:
        return
    flag = "--stand-ins" if copies > 1 else "--stand-ins-in-node"
    if not (request.timing and request.predict_only):
        raise UsageError(f"{flag} needs --timing --predict-only: a stood-in rank computes nothing, so only "
                         "a prediction can stand for it. Fix: add --timing --predict-only")
    if request.num_nodes % copies:
        raise UsageError(f"--stand-ins {copies} does not divide --num-nodes {request.num_nodes}: the job's nodes "
                         f"run in {copies} identical replicas. Fix: a --stand-ins that divides {request.num_nodes}")
    stride = request.stand_ins_stride
    if stride is not None and (stride < 1 or stride % gpus or (request.num_nodes * gpus) % (stride * copies)):
        raise UsageError(f"--stand-ins-stride {stride} must be a whole number of nodes' ranks (a multiple of "
                         f"--gpus-per-node {gpus}) whose {copies} replicas tile the job's "
                         f"{request.num_nodes * gpus} ranks. Fix: the ranks of one data-parallel index, e.g. "
                         "torchtitan's TP x CP degree")
    if request.nproc_per_node is not None:
        raise UsageError(f"{flag} needs the ranks launched by torchrun: ranks mirage starts itself "
                         "(--nproc-per-node) meet at rank 0's store, which waits for every rank of the world, "
                         "stood-in ones included. Fix: drop --nproc-per-node and run torchrun --nnodes=$MIRAGE_NUM_NODES "
                         "--node-rank=$MIRAGE_NODE_RANK --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT ...")
    if request.faults or request.faults_file:
        raise UsageError(f"{flag} with --fault: a stood-in rank cannot fail on its own. Fix: drop one of them")


def _validate_timing(request: RunRequest, profile: profiles.Profile) -> None:
    """Clocked mode's flags, refused before anything starts when they cannot work."""
    for flag, given in (("--trace", request.trace), ("--virtual-clock", request.virtual_clock),
                        ("--timing-tuning", request.timing_tuning), ("--predict-only", request.predict_only)):
        if given and not request.timing:
            raise UsageError(f"{flag} needs clocked mode: add --timing (mirage run --timing {flag} ... -- CMD)")
    if not request.timing:
        return
    try:
        tuning = profiles.load_tuning(request.timing_tuning) if request.timing_tuning else None
        profiles.timing_model(profile, tuning)
    except profiles.ProfileError as err:
        raise UsageError(str(err)) from None
    if request.trace:
        check_output_path("--trace", request.trace, "trace.json")


def check_output_path(flag: str, path: str, example: str) -> None:
    """An output file the session writes at its end, refused now if it cannot be written then:
    a long job must not run to completion and lose its exit code to a path typo."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file path, e.g. {target / example}")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{flag} {path}: cannot write there ({folder} is not a writable directory); "
                         "choose a path in a directory you can write")
