"""Emulated NCCL/RCCL: `init_process_group("nccl")` on emulated GPUs.

Transport is gloo. The shim routes every c10d op on device tensors to the CPU kernel with CPU
views of the same memory, which hands them to the process group's CPU backend; so a gloo
backend registered for both `cpu` and `cuda` moves device memory without a copy to a CPU
tensor. Here, process-group creation is steered accordingly: wherever NCCL was asked for
(`"nccl"`, the cuda default, `"cuda:nccl,cpu:gloo"`), one gloo backend serves both devices,
while `dist.get_backend()` still answers what the user asked for.

Gloo in torch 2.13 can abort a correct program at interpreter exit if a process group is still
alive (see the shim design notes); `_tear_down_at_exit` destroys them before Python finalizes.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from pathlib import Path
from types import ModuleType

_EMULATED_DEVICE_MAP = "cpu:gloo,cuda:gloo"


def _steer_to_gloo(backend) -> str | None:
    """The backend string to build instead, or None when nothing NCCL-like was asked for."""
    text = str(backend).lower() if backend is not None else "undefined"
    if text in ("undefined", "nccl") or "nccl" in text:
        if text not in ("undefined", "nccl"):
            devices = dict(part.split(":", 1) for part in text.split(",") if ":" in part)
            if any(b not in ("nccl", "gloo") for b in devices.values()):
                return None  # a user's own plugin backend: leave it alone
        return _EMULATED_DEVICE_MAP
    return None


def _log_nccl_init(c10d: ModuleType, pg, backend: str) -> None:
    """NCCL_DEBUG=INFO prints one init line per rank and communicator, as NCCL does."""
    if os.environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        return
    import torch

    library = "RCCL" if torch.version.hip else "NCCL"
    print(
        f"{os.uname().nodename}:{os.getpid()} [{torch.cuda.current_device()}] {library} INFO "
        f"comm {c10d._get_group_tag(pg) or 'default'} rank {pg.rank()} nRanks {pg.size()} "
        f"node {os.environ.get('MIRAGE_NODE_RANK', '0')} localRank {os.environ.get('LOCAL_RANK', '0')} "
        f"cudaDev {torch.cuda.current_device()} profile {Path(os.environ['MIRAGE_PROFILE']).stem} "
        f"backend {backend} - Init COMPLETE (mirage emulated, transport gloo)",
        file=sys.stderr, flush=True,
    )


def _tear_down_at_exit(c10d: ModuleType) -> None:
    """Destroys every process group before the interpreter finalizes (see module docstring)."""
    if not c10d.is_initialized():
        return
    try:
        c10d.destroy_process_group()
    except Exception:
        pass
    gc.collect()


def install(torch: ModuleType) -> None:
    """Wires emulated NCCL into torch.distributed. Called right after `import torch`."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    c10d = dist.distributed_c10d
    create_group = c10d._new_process_group_helper

    def new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        steered = _steer_to_gloo(backend)
        if steered is None:
            return create_group(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)
        pg, store = create_group(group_size, group_rank, global_ranks_in_group,
                                 c10d.Backend(steered), *args, **kwargs)
        if pg is not c10d.GroupMember.NON_GROUP_MEMBER and pg in c10d._world.pg_map:
            asked = "nccl" if backend is None or str(backend).lower() == "undefined" else backend
            c10d._world.pg_map[pg] = (c10d.Backend(asked) if "," not in str(asked) else asked,
                                      c10d._world.pg_map[pg][1])
            _log_nccl_init(c10d, pg, str(asked))
        return pg, store

    c10d._new_process_group_helper = new_process_group_helper
    default_timeout = c10d._get_default_timeout
    c10d._get_default_timeout = lambda backend: default_timeout(
        c10d.Backend.GLOO if _steer_to_gloo(backend) else backend)
    c10d.is_nccl_available = dist.is_nccl_available = lambda: True
    atexit.register(_tear_down_at_exit, c10d)
