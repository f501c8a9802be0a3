"""The launcher: turns a `mirage run` request into a live session and its exit code.

    CLI (mirage.cli) -> launcher.run_session -> Supervisor (workload processes)
                                             -> environment.build (what each process sees)

One concern a module:
    request.py        RunRequest and the checks made before anything starts (UsageError)
    run.py            run_session (one host's session) and run_node (`mirage node`, a host's share
                      of a cluster across hosts), from the shim's build to the teardown
    supervisor.py     process groups, signal ladder, teardown, the reaper
    environment.py    what each process sees
    sessions.py       ps/smi/exec/cleanup, and reaping what a SIGKILLed run left
    nodes.py          each emulated node's namespaces (--isolate-nodes); containers.py: --image
    cluster.py        `mirage node` under Slurm: the hosts' rendezvous
    faults.py         --fault specs; capacity.py: what the machine can hold
    timing_report.py  clocked mode's report and trace; summary.py: the end-of-session summary

The names the CLI and tests use are importable from the package itself.
"""

from mirage.launcher.request import LaunchError, RunRequest, UsageError
from mirage.launcher.run import RUN_PID_NAME, ensure_shim, process_start_time, run_node, run_session, runtime_root

__all__ = ["LaunchError", "RUN_PID_NAME", "RunRequest", "UsageError", "ensure_shim", "process_start_time", "run_node",
           "run_session", "runtime_root"]
