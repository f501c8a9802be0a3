"""What the session service and the workload runtime agree on (both import this, nothing else
of each other): where the socket is, and how the service asks a rank for its Python stack."""

import os
import signal

SOCKET_NAME = "mirage.sock"
# Real-time signal unused by PyTorch: a rank answers it by dumping its Python stacks (faulthandler).
STACK_SIGNAL = signal.SIGRTMIN + 5


def stack_path(session_dir: str, pid: int) -> str:
    """Where a rank's stack dumps go: its session's private directory."""
    return os.path.join(session_dir, f"stack-{pid}.txt")
