"""mirage: a virtual GPU cluster for PyTorch.

Usage:
    mirage run [--profile P] [--gpus-per-node N] [--num-nodes M] [--nproc-per-node K]
               [--timing [--trace PATH] [--virtual-clock] [--timing-tuning FILE]
                         [--predict-only [--stand-ins K [--stand-ins-stride N]] [--stand-ins-in-node T]]]
               [--isolate-nodes | --no-isolate-nodes] [--node-hostname PATTERN] [--image NAME]
               [--lazy-device-memory] [--check-races[=error|warn|off]] [--env K=V]... [--workdir DIR] [--clear-env-vars] [--no-fork-server]
               -- CMD ARGS...
    mirage plan --axis NAME={V1,V2,...}... [--jobs N] [--tokens-per-step EXPR] [--price-per-gpu-hour P]
                [--json] [--cache DIR] [run flags] -- CMD ARGS with {NAME}...
                                               rank a grid of configurations by predicted throughput
    mirage node [--rdzv-port P] [--rdzv-timeout S] [run flags] -- CMD ARGS...
                                               once per host, under Slurm's srun: one cluster
    mirage ps [--json]                         live sessions
    mirage smi [--session ID] [--json] [--watch [SECONDS]]
    mirage exec [--session ID] [--node N] -- CMD ARGS...
    mirage cleanup [--dry-run]                 reclaim what SIGKILLed runs left
    mirage paths [--json]
    mirage --version                           mirage, torch and the device shim's build key
    mirage profiles [--json]
    mirage profiles show NAME|PATH [--json] [--timing [--timing-tuning FILE]]

`mirage run` runs CMD (and every Python process it starts) with N emulated GPUs of profile P
(default mi350x, N defaults to the profile's GPUs per node) on each of M emulated nodes: once
per node, or K times per node with --nproc-per-node. Each process gets RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/MASTER_PORT, MIRAGE_NODE_RANK, MIRAGE_NUM_NODES, MIRAGE_SESSION and
NCCL_HOSTID; torchrun works inside (--standalone, or --nnodes=$MIRAGE_NUM_NODES
--node-rank=$MIRAGE_NODE_RANK --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT). The exit code is the workload's;
usage errors exit 2, mirage-level errors 1.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import json
import sys
from dataclasses import asdict

import mirage
from mirage import launcher, plan, profiles
from mirage.shim import build as shim_build
from mirage.launcher import cluster, nodes, sessions


def _all_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of a parser and its subcommands (argparse reports unknown ones at the top)."""
    flags = []
    for action in parser._actions:
        flags.extend(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags.extend(_all_flags(sub))
    return flags


class _Parser(argparse.ArgumentParser):
    """argparse, but an unknown flag suggests the closest known one."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "unrecognized arguments:" in message:
            bad = message.split(":", 1)[1].split()[0]
            known = _all_flags(self)
            close = difflib.get_close_matches(bad.split("=")[0], known, n=1)
            if close:
                message += f" (did you mean {close[0]}?)"
        self.print_usage(sys.stderr)
        print(f"mirage: error: {message}", file=sys.stderr)
        sys.exit(2)


def _build_parser() -> _Parser:
    parser = _Parser(prog="mirage", description=__doc__, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="store_true",
                        help="print mirage's version, the torch it runs on and the device shim's build key")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = commands.add_parser("run", help="run a command on emulated GPUs", allow_abbrev=False)
    run.add_argument("--profile", default=profiles.DEFAULT_PROFILE,
                     help=f"device profile name or TOML path (default {profiles.DEFAULT_PROFILE})")
    run.add_argument("--gpus-per-node", type=int, metavar="N",
                     help="emulated GPUs (default: the profile's GPUs per node)")
    run.add_argument("--num-nodes", type=int, default=1, metavar="M",
                     help="emulated nodes; the command runs once per node (default 1)")
    run.add_argument("--nproc-per-node", type=int, metavar="K",
                     help="start K ranks per node itself (no torchrun needed)")
    isolation = run.add_mutually_exclusive_group()
    isolation.add_argument("--isolate-nodes", dest="isolate_nodes", action="store_true", default=None,
                           help="each emulated node in namespaces of its own: hostname, network (eth0 on a "
                                "session bridge), /dev/shm, IPC (root, iproute2, util-linux; by default the "
                                "nodes are process groups sharing this host, as the reference tool's are)")
    isolation.add_argument("--no-isolate-nodes", dest="isolate_nodes", action="store_false",
                           help="the default, kept for scripts: every emulated node shares this host's hostname, "
                                "network and /dev/shm")
    run.add_argument("--node-hostname", default=nodes.HOSTNAME_PATTERN, metavar="PATTERN",
                     help="isolated nodes' hostnames, {node} the node's index (default node{node})")
    run.add_argument("--image", metavar="NAME",
                     help="run each node's processes in a podman container of image NAME, joined to the node's "
                          "namespaces (implies --isolate-nodes; root, podman; see scripts/podman_image.sh)")
    run.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                     help="set a variable in the workload's environment (repeatable)")
    run.add_argument("--workdir", metavar="DIR", help="run the command in DIR")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--daemon", dest="in_process", action="store_false",
                      help="host the session service (the default): shared GPU memory, smi, flight recorder")
    mode.add_argument("--in-process", dest="in_process", action="store_true",
                      help="no session service: each process keeps its own device state")
    run.set_defaults(in_process=False)
    run.add_argument("--hang-timeout", type=float, default=300.0, metavar="SECONDS",
                     help="end the session when ranks wait this long in a collective (default 300)")
    run.add_argument("--quiet", action="store_true", help="no summary table at the end")
    run.add_argument("--summary-json", metavar="PATH", help="write the end-of-session summary as JSON")
    run.add_argument("--fault", action="append", default=[], metavar="SPEC",
                     help="inject a fault, e.g. kill:rank=3:at=collective:120, oom:rank=1:at=alloc:40, "
                          "stall:rank=0:at=collective:5:for=60s (repeatable; mirage/launcher/faults.py)")
    run.add_argument("--faults", metavar="FILE", help="faults from a TOML file of [[fault]] tables")
    run.add_argument("--seed", type=int, metavar="N", help="the seed of faults whose count is 'random'")
    run.add_argument("--timing", action="store_true",
                     help="clocked mode: predict how long the job takes on the profiled hardware")
    run.add_argument("--trace", metavar="PATH", help="with --timing: write the predicted timeline (Perfetto)")
    run.add_argument("--virtual-clock", action="store_true",
                     help="with --timing: time.time/perf_counter/monotonic in the workload follow the prediction")
    run.add_argument("--timing-tuning", metavar="FILE",
                     help="with --timing: a TOML file overriding the profile's timing numbers")
    run.add_argument("--predict-only", action="store_true",
                     help="with --timing: predict without running the kernels (results hold no values)")
    run.add_argument("--stand-ins", metavar="K", type=int, default=1,
                     help="with --timing --predict-only: run 1/K of --num-nodes, each running rank standing for "
                          "K data-parallel replicas (docs/stand-in-replicas.md)")
    run.add_argument("--stand-ins-stride", metavar="N", type=int,
                     help="with --stand-ins: the data-parallel index changes every N ranks (torchtitan with "
                          "pipeline parallelism: TP x CP); default: data parallelism is the outermost dimension")
    run.add_argument("--stand-ins-in-node", metavar="T", type=int, default=1,
                     help="with --timing --predict-only: in each running node one of every T local ranks runs, "
                          "standing for the T ranks of its tensor-parallel group (docs/stand-in-replicas.md)")
    run.add_argument("--lazy-device-memory", action="store_true",
                     help="device memory costs host memory only where written, and freed blocks give it back "
                          "(for models larger than the host's RAM; collectives copy through shared memory)")
    run.add_argument("--check-races", nargs="?", const="error", default="off", choices=("error", "warn", "off"),
                     metavar="{error,warn,off}",
                     help="report what a GPU would run in an order the program does not ensure (streams, async "
                          "collectives, memory reused across streams, CPU reads); error (the default when given): "
                          "report, then fail the op; warn: report and go on (README: 'Finding races')")
    run.add_argument("--no-fork-server", dest="fork_server", action="store_false",
                     help="start every Python process on its own instead of forking it from a process "
                          "that has imported torch (slower start-up, more memory per rank)")
    run.add_argument("--clear-env-vars", action="store_true",
                     help="start from an almost empty environment (PATH, HOME, USER, LANG, ...)")

    planned = commands.add_parser("plan", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                                  usage="mirage plan --axis NAME={V1,V2,...} [...] [plan flags] [mirage run flags] "
                                        "-- CMD ARGS",
                                  help="rank a grid of configurations of a program by predicted throughput",
                                  description=plan.DESCRIPTION)
    plan.add_arguments(planned)
    node = commands.add_parser("node", allow_abbrev=False,
                               help="this host's share of a cluster across hosts (once per host, under srun)",
                               description="Takes every `mirage run` flag, plus these; --num-nodes counts the "
                                           "emulated nodes of the whole cluster (default: one per host).")
    _add_rendezvous_arguments(node)
    ps = commands.add_parser("ps", help="list live sessions", allow_abbrev=False)
    ps.add_argument("--json", action="store_true", help="print JSON")
    smi = commands.add_parser("smi", help="GPUs, memory, processes and collectives of a live session",
                              allow_abbrev=False)
    smi.add_argument("--session", metavar="ID", help="the session (default: the latest live one)")
    smi.add_argument("--json", action="store_true", help="print JSON")
    smi.add_argument("--watch", type=float, nargs="?", const=1.0, metavar="SECONDS",
                     help="refresh every SECONDS (default 1)")
    execute = commands.add_parser("exec", help="run a command in a live session with a node's identity",
                                  allow_abbrev=False)
    execute.add_argument("--session", metavar="ID", help="the session (default: the latest live one)")
    execute.add_argument("--node", type=int, default=0, metavar="N", help="the node whose identity to take")
    clean = commands.add_parser("cleanup", help="reclaim what SIGKILLed runs left behind", allow_abbrev=False)
    clean.add_argument("--dry-run", action="store_true", help="only show what would be reclaimed")
    where = commands.add_parser("paths", help="print the directories mirage uses", allow_abbrev=False)
    where.add_argument("--json", action="store_true", help="print JSON")

    shown = commands.add_parser("profiles", help="list device profiles", allow_abbrev=False)
    shown.add_argument("--json", action="store_true", help="print JSON")
    show_commands = shown.add_subparsers(dest="profiles_command", parser_class=_Parser)
    show = show_commands.add_parser("show", help="print one profile", allow_abbrev=False)
    show.add_argument("name", help="profile name or TOML path")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.add_argument("--timing", action="store_true",
                      help="print clocked mode's numbers, each with its kind and source")
    show.add_argument("--timing-tuning", metavar="FILE", help="with --timing: apply a tuning file's overrides")
    return parser


def _profile_json(profile: profiles.Profile) -> dict:
    data = asdict(profile)
    data["path"] = str(profile.path)
    return data


def _print_profiles(as_json: bool) -> int:
    all_profiles = profiles.load_all()
    if as_json:
        print(json.dumps([_profile_json(p) for p in all_profiles], indent=2))
        return 0
    header = ("PROFILE", "DEVICE", "ARCH", "MEMORY", "CUs/SMs", "BF16 TFLOP/s", "MEM BW", "GPUs/NODE")
    rows = [header] + [
        (p.name + (" (default)" if p.name == profiles.DEFAULT_PROFILE else ""), p.torch_name,
         p.arch, f"{p.memory_bytes / 2**30:.0f} GiB", str(p.compute_units),
         f"{p.peak_tflops.get('bf16', 0):g}", f"{p.memory_bandwidth_gbs / 1000:g} TB/s",
         str(p.gpus_per_node))
        for p in all_profiles
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _print_version() -> int:
    """`mirage --version`: the lines a bug report needs (the same figures are in --summary-json)."""
    try:
        identity = shim_build.build_identity()
    except importlib.metadata.PackageNotFoundError:
        print(f"mirage {mirage.__version__}\ntorch not installed for {sys.executable} "
              "(Fix: pip install torch==2.13.0)")
        return 1
    print(f"mirage {identity['mirage']}\n"
          f"torch {identity['torch']} ({identity['torch_path']}), Python {identity['python']}\n"
          f"device shim build key {identity['shim_build_key']}"
          f"{'' if identity['shim_built'] else ' (not built yet: the first mirage run builds it)'}\n"
          f"emulated NCCL build key {identity['nccl_build_key']}")
    return 0


def _report_error(message: str, as_json: bool) -> int:
    """A mirage-level error on stderr (`{"error": ...}` for --json callers); exit code 1."""
    print(json.dumps({"error": message}) if as_json else f"mirage: {message}", file=sys.stderr)
    return 1


def _print_profile(name: str, as_json: bool) -> int:
    try:
        profile = profiles.load(name)
    except profiles.ProfileError as err:
        return _report_error(str(err), as_json)
    if as_json:
        print(json.dumps(_profile_json(profile), indent=2))
        return 0
    for key, value in _profile_json(profile).items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v:g}" for k, v in value.items())
        print(f"{key:22} {value}")
    return 0


def _session_command(action, as_json: bool) -> int:
    """Runs a command against a live session; a missing session is a one-line error, exit 1."""
    try:
        return action()
    except sessions.SessionError as err:
        return _report_error(str(err), as_json)
    except KeyboardInterrupt:
        return 130


def _add_rendezvous_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rdzv-port", type=int, metavar="PORT",
                        help="the port the hosts meet at on the job's first host (default: from the job id)")
    parser.add_argument("--rdzv-timeout", type=float, default=cluster.DEFAULT_RDZV_TIMEOUT, metavar="SECONDS",
                        help=f"how long the hosts wait for each other (default {cluster.DEFAULT_RDZV_TIMEOUT:g})")


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Splits `run` arguments at the first `--`; (flags, command or None when no `--`)."""
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if argv and argv[0] not in ("cleanup", "-h", "--help"):
        sessions.reap_dead_sessions()
    if argv and argv[0] in ("run", "node"):
        flags, command = _split_command(argv[1:])
        rendezvous = None
        if argv[0] == "node":
            if "-h" in flags or "--help" in flags:
                parser.parse_args(["node", "--help"])
            rendezvous_parser = _Parser(prog="mirage node", add_help=False, allow_abbrev=False)
            _add_rendezvous_arguments(rendezvous_parser)
            rendezvous, flags = rendezvous_parser.parse_known_args(flags)
        if command is None:
            # A forgotten `--`: the first token that is not a flag or a flag's value.
            args, rest = parser.parse_known_args(["run", *flags])
            if rest and not rest[0].startswith("-"):
                parser.error(f"put `--` before the command: mirage run [flags] -- {' '.join(rest)}")
            parser.parse_args(["run", *flags])
            parser.error("no command to run; put it after `--`: mirage run -- python train.py")
        args = parser.parse_args(["run", *flags])
        request = launcher.RunRequest(
            command=command, profile=args.profile, gpus_per_node=args.gpus_per_node,
            num_nodes=args.num_nodes, nproc_per_node=args.nproc_per_node, in_process=args.in_process,
            hang_timeout=args.hang_timeout, quiet=args.quiet, summary_json=args.summary_json,
            env=args.env, workdir=args.workdir, clear_env=args.clear_env_vars, timing=args.timing,
            trace=args.trace, virtual_clock=args.virtual_clock, timing_tuning=args.timing_tuning,
            predict_only=args.predict_only, stand_ins=args.stand_ins, stand_ins_stride=args.stand_ins_stride,
            stand_ins_in_node=args.stand_ins_in_node,
            lazy_device_memory=args.lazy_device_memory, check_races=args.check_races, faults=args.fault, faults_file=args.faults, seed=args.seed, isolate_nodes=args.isolate_nodes,
            node_hostname=args.node_hostname, image=args.image, fork_server=args.fork_server,
        )
        try:
            if rendezvous is not None:
                return launcher.run_node(request, rendezvous.rdzv_port, rendezvous.rdzv_timeout)
            return launcher.run_session(request)
        except launcher.UsageError as err:
            print(f"mirage: error: {err}", file=sys.stderr)
            return 2
        except launcher.LaunchError as err:
            print(f"mirage: {err}", file=sys.stderr)
            return 1
    if argv and argv[0] == "plan":
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        return plan.main(argv[1:], subcommands["plan"], subcommands["run"])
    if argv and argv[0] == "exec":
        flags, command = _split_command(argv[1:])
        if not command:
            parser.error("no command to run; put it after `--`: mirage exec --node 1 -- python")
        args = parser.parse_args(["exec", *flags])
        return _session_command(lambda: sessions.exec_in_session(args.session, args.node, command), False)
    args = parser.parse_args(argv)
    if args.version:
        return _print_version()
    if args.command == "ps":
        found = sessions.live_sessions()
        print(json.dumps(found, indent=2) if args.json else sessions.ps_table(found))
        return 0
    if args.command == "smi":
        return _session_command(lambda: sessions.smi(args.session, args.json, args.watch), args.json)
    if args.command == "cleanup":
        return sessions.cleanup(args.dry_run)
    if args.command == "paths":
        return sessions.paths(args.json)
    if args.command == "profiles":
        if args.profiles_command == "show":
            if args.timing or args.timing_tuning:
                return _print_timing(args.name, args.timing_tuning, args.json)
            return _print_profile(args.name, args.json)
        return _print_profiles(args.json)
    parser.print_help()
    return 2


def _print_timing(name: str, tuning_path: str | None, as_json: bool) -> int:
    """`mirage profiles show NAME --timing`: clocked mode's numbers with their provenance."""
    try:
        profile = profiles.load(name)
        tuning = profiles.load_tuning(tuning_path) if tuning_path else None
        numbers = profiles.timing_numbers(profile, tuning)
    except profiles.ProfileError as err:
        print(f"mirage: error: {err}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps([asdict(n) for n in numbers], indent=2))
        return 0
    print(f"{profile.name}: clocked mode's model ({profile.path})")
    width = max(len(n.key) for n in numbers)
    for n in numbers:
        print(f"  {n.key:<{width}}  {n.value:<10g} {n.kind:<9}  {n.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
