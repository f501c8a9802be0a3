"""Emulated NCCL/RCCL: `init_process_group("nccl")` on emulated GPUs.

Transport: all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast of a device
tensor go through shared memory between the ranks (the shim's shm_collectives.cpp;
NCCL_SHM_DISABLE=1 turns it off, as it turns off NCCL's). Every other c10d op on device tensors
goes to the CPU kernel with CPU views of the same memory, which hands
them to the process group's CPU backend; so a gloo backend registered for both `cpu` and `cuda`
moves device memory without a copy to a CPU tensor. Here, process-group creation is steered
accordingly: wherever NCCL was asked for
(`"nccl"`, the cuda default, `"cuda:nccl,cpu:gloo"`), one gloo backend serves both devices,
while `dist.get_backend()` still answers what the user asked for.

Gloo in torch 2.13 can abort a correct program at interpreter exit if a process group is still
alive (see the shim design notes); `_tear_down_at_exit` destroys them before Python finalizes.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import ModuleType

from mirage.runtime import session

_EMULATED_DEVICE_MAP = "cpu:gloo,cuda:gloo"
_NCCL_DEFAULT_TIMEOUT = timedelta(minutes=10)  # torch's default_pg_nccl_timeout in a CUDA build


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
        f"backend {backend} - Init COMPLETE (mirage emulated, transport {_transport()})",
        file=sys.stderr, flush=True,
    )


def _transport() -> str:
    """What carries this communicator's collectives (see the module docstring)."""
    if os.environ.get("NCCL_SHM_DISABLE", "0") not in ("", "0"):
        return "gloo"
    return "shm (all_reduce, all_gather, reduce_scatter, broadcast), gloo"


def _forget_groups_when_destroyed(dist: ModuleType, c10d: ModuleType, torch: ModuleType) -> None:
    """The shim keeps each group's shared-memory segment keyed by the group's address, and holds
    no reference to it (that would keep gloo alive into interpreter exit). Destroying a group
    tells the shim to forget it, before its address can hold another group."""
    destroy = c10d.destroy_process_group

    def destroy_process_group(group=None):
        doomed = list(c10d._world.pg_map) if group is None or group is c10d.GroupMember.WORLD else [group]
        for pg in doomed:
            torch.ops.mirage.forget_process_group(pg.group_name)
        destroy(group)

    destroy_process_group.__wrapped__ = destroy
    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group


def _tear_down_at_exit(c10d: ModuleType) -> None:
    """Destroys every process group before the interpreter finalizes (see module docstring)."""
    _native_watch["stop"] = True
    if not c10d.is_initialized():
        return
    try:
        c10d.destroy_process_group()
    except Exception:
        pass
    gc.collect()


# PREMUL_SUM ops handed out by dist._make_nccl_premul_sum, by id, with their factor. The C++
# ReduceOp does not expose its factor to Python, so we remember it (and keep the op alive so
# its id stays unique).
_premul_factors: dict[int, tuple[object, object]] = {}


def _add_reduce_op_emulation(dist: ModuleType, c10d: ModuleType) -> None:
    """AVG and PREMUL_SUM are NCCL reduce ops gloo lacks: emulate them around a SUM.

    PREMUL_SUM scales the input first; AVG divides the result by the group size, after the
    collective completed (so an async_op=True call completes before returning)."""
    ReduceOp = dist.ReduceOp
    make_premul_sum = dist._make_nccl_premul_sum

    def premul_sum(factor):
        op = make_premul_sum(factor)
        _premul_factors[id(op)] = (op, factor)
        return op

    dist._make_nccl_premul_sum = premul_sum

    def wrap(name: str, op_at: int, group_at: int, input_at: int, output_at: int):
        """Wraps c10d.<name>, whose positional arguments have op, group, input and output at
        the given positions."""
        collective = getattr(c10d, name)
        keywords = {op_at: "op", group_at: "group"}

        def argument(args: list, kwargs: dict, position: int, default=None):
            return args[position] if position < len(args) else kwargs.get(keywords.get(position, ""), default)

        def replace(args: list, kwargs: dict, position: int, keyword: str, value) -> None:
            if position < len(args):
                args[position] = value
            else:
                kwargs[keyword] = value

        def emulated(*args, **kwargs):
            args = list(args)
            op = argument(args, kwargs, op_at, ReduceOp.SUM)
            premul = _premul_factors.get(id(op))
            if premul is None and op != ReduceOp.AVG:
                return collective(*args, **kwargs)
            replace(args, kwargs, op_at, "op", ReduceOp.SUM)
            if premul is not None:
                tensors = args[input_at]
                if input_at == output_at:  # in place: scaling the input is the real semantics
                    tensors.mul_(premul[1])
                elif isinstance(tensors, list):
                    args[input_at] = [t * premul[1] for t in tensors]
                else:
                    args[input_at] = tensors * premul[1]
                return collective(*args, **kwargs)
            work = collective(*args, **kwargs)
            if work is not None:
                work.wait()
            output = args[output_at]
            size = c10d.get_world_size(argument(args, kwargs, group_at))
            for tensor in output if isinstance(output, list) else [output]:
                if tensor.is_floating_point() or tensor.is_complex():
                    tensor.div_(size)
                else:
                    tensor.floor_divide_(size)
            return work

        emulated.__wrapped__ = collective
        emulated.__doc__ = collective.__doc__
        setattr(c10d, name, emulated)
        setattr(dist, name, emulated)

    wrap("all_reduce", op_at=1, group_at=2, input_at=0, output_at=0)
    wrap("reduce", op_at=2, group_at=3, input_at=0, output_at=0)
    wrap("reduce_scatter", op_at=2, group_at=3, input_at=1, output_at=0)
    wrap("reduce_scatter_tensor", op_at=2, group_at=3, input_at=1, output_at=0)


_RECORDED = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier")
_sequence: dict[str, int] = {}


def _call_site() -> str:
    """The first frame outside torch and mirage: where the user's code called the collective."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in name and f"{os.sep}mirage{os.sep}" not in name:
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _tensors_of(args) -> list:
    import torch

    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


def _add_flight_recording(dist: ModuleType, c10d: ModuleType) -> None:
    """Tells the session's flight recorder when each collective starts and returns."""
    for name in _RECORDED:
        collective = getattr(c10d, name)

        def recorded(*args, _collective=collective, _name=name, **kwargs):
            group = kwargs.get("group") or next((a for a in args if isinstance(a, c10d.ProcessGroup)), None)
            pg = group or c10d._get_default_group()
            seq = _sequence[pg.group_name] = _sequence.get(pg.group_name, -1) + 1
            tensors = _tensors_of(args)
            rank = c10d.get_rank()
            reduce_op = kwargs.get("op")
            session.send({
                "op": "collective", "phase": "enter", "rank": rank, "group": pg.group_name, "seq": seq,
                "group_ranks": c10d.get_process_group_ranks(pg), "name": _name,
                "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
                "shapes": [list(t.shape) for t in tensors[:4]], "numel": sum(t.numel() for t in tensors),
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "reduce_op": str(reduce_op).removeprefix("RedOpType.") if reduce_op is not None else None,
                "callsite": _call_site(),
            })
            with _python_collectives_lock:
                _python_collectives[0] += 1
            try:
                return _collective(*args, **kwargs)
            finally:
                with _python_collectives_lock:
                    _python_collectives[0] -= 1
                session.send({"op": "collective", "phase": "exit", "rank": rank})

        recorded.__wrapped__ = collective
        recorded.__doc__ = collective.__doc__
        setattr(c10d, name, recorded)
        setattr(dist, name, recorded)


# Python-level recorded collectives in progress in this process (any thread).
_python_collectives = [0]
_python_collectives_lock = threading.Lock()
_native_watch = {"started": False, "stop": False}
_NATIVE_WAIT_REPORTED_AFTER_MS = 1000
_NATIVE_WAIT_POLL_S = 0.5


def _watch_native_waits(torch: ModuleType, c10d: ModuleType) -> None:
    """DDP's reducer issues its collectives from C++, where the wrappers above never see them.
    This thread asks the shim which shared-memory collectives the process is asleep in; one asleep
    for a second, with no Python-level collective in progress, is entered in the flight recorder
    like any other, so a hang there is reported the same way (who waits, who never came, where
    that rank is now)."""
    reported: set[tuple[str, int]] = set()
    while not _native_watch["stop"]:
        time.sleep(_NATIVE_WAIT_POLL_S)
        if _native_watch["stop"]:
            return
        waits = [] if _python_collectives[0] else json.loads(torch.ops.mirage.shm_waits())
        asleep = {(f"{w['group']} (C++ calls)", w["seq"]): w for w in waits
                  if w["waited_ms"] >= _NATIVE_WAIT_REPORTED_AFTER_MS}
        rank = c10d.get_rank() if asleep or reported else None
        for (group, seq), wait in asleep.items():
            if (group, seq) in reported:
                continue
            session.send({
                "op": "collective", "phase": "enter", "native": True, "rank": rank, "group": group, "seq": seq,
                "group_ranks": c10d.get_process_group_ranks(c10d._resolve_process_group(wait["group"])),
                "name": wait["name"], "dtype": wait["dtype"], "shapes": [[wait["numel"]]], "numel": wait["numel"],
                "callsite": "C++ (DDP's reducer, or another caller outside Python)",
            })
        for group, seq in reported - asleep.keys():
            session.send({"op": "collective", "phase": "exit", "rank": rank, "group": group, "seq": seq})
        reported = set(asleep)


def _start_native_wait_watch(torch: ModuleType, c10d: ModuleType) -> None:
    if _native_watch["started"] or not session.connected():
        return
    _native_watch["started"] = True
    threading.Thread(target=_watch_native_waits, args=(torch, c10d), name="mirage-native-wait-watch",
                     daemon=True).start()


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
            _start_native_wait_watch(torch, c10d)
        return pg, store

    c10d._new_process_group_helper = new_process_group_helper
    default_timeout = c10d._get_default_timeout
    # A CPU build has no NCCL default timeout (it warns and gives gloo's 30 minutes); emulated
    # NCCL gets what a CUDA build's NCCL gets, so a hang surfaces when it would on the real box.
    c10d._get_default_timeout = lambda backend: (
        _NCCL_DEFAULT_TIMEOUT if _steer_to_gloo(backend) else default_timeout(backend))
    c10d.is_nccl_available = dist.is_nccl_available = lambda: True
    _add_reduce_op_emulation(dist, c10d)
    _forget_groups_when_destroyed(dist, c10d, torch)
    if session.connected():
        _add_flight_recording(dist, c10d)
    atexit.register(_tear_down_at_exit, c10d)
