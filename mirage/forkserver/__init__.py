"""The fork server: every Python process of a session starts as a copy-on-write fork of one
process that has already imported torch.

Why: a rank that starts on its own imports torch (about 1.6 CPU-seconds) and keeps a private
copy of the heap that import builds (about 140 MB), so 256 ranks cannot start, or fit, on one
small machine. A fork server imports torch and mirage's runtime once, freezes that heap
(`gc.freeze()`, so the collector never writes to the shared pages) and forks each new process
from it: the children share the pages until they write to them.

    mirage run (launcher)                 fork server (server.py, one per session)
      |  binds the socket, starts ------>   loads the shim, imports torch, gc.freeze(),
      v                                       ^  makes twins; accepts every waiting request,
                                              |  forks them in rank order (twins take turns)
    python train.py ... (any Python process   |
      of the session)                         |  argv, env, cwd, rlimits, umask, every fd
      sitecustomize -> client.hand_off() -----+  (SCM_RIGHTS), stdio settings
      becomes a waiter: forwards signals,        child: setsid, takes them over, completes
      exits as the child exits                   the runtime (per-process part) and runs
                                                 __main__ as the interpreter would
                                                 (interpreter.py)

The hook is mirage's sitecustomize, which every Python process of the session already runs.
A process that cannot be handed over faithfully (an interpreter option the server cannot take
on, an interactive or stdin program, another interpreter, a stdin that is a terminal) starts
normally. The waiter is the process its parent started (its pid is what Popen, torchrun and the
supervisor know); the child is the program. SIGKILL of the waiter kills the child (the server
sees the waiter's connection close). `mirage run --no-fork-server` starts every process on its own.

Environment: MIRAGE_FORK_SERVER names the server's socket (set for the workload, not for the
server itself); a process without it starts normally, which is how a workload opts a child out.
"""

SOCKET_ENV = "MIRAGE_FORK_SERVER"
SOCKET_NAME = "fork.sock"  # shorter than the daemon's mirage.sock: a Unix socket path has 107 bytes
