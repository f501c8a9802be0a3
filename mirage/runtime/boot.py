"""Loads the device shim before torch, then completes torch.cuda once torch is imported.

Torch creates its CUDA hooks object once, during `import torch`, so the shim (which registers
ours) must be in the process first. A meta-path finder sees `import torch` begin, loads the
shim with RTLD_GLOBAL, lets the real import run, and then installs the Python half
(`mirage.runtime.torch_cuda`). Processes that never import torch never load anything.

Environment read (exported by `mirage run`): MIRAGE_SHIM_PATH, MIRAGE_PROFILE (a profile TOML
path), MIRAGE_NUM_GPUS (the node's GPUs; CUDA_VISIBLE_DEVICES and ROCm's equivalents narrow
them, see visible_devices.py), and with a session service MIRAGE_SOCKET / MIRAGE_SHM.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType


def _export_for_shim() -> None:
    """The shim reads its figures from the environment at load time; derive them here: the
    profile's, and which of the node's GPUs this process sees (*_VISIBLE_DEVICES)."""
    from mirage import profiles
    from mirage.runtime import visible_devices

    profile = profiles.load(os.environ["MIRAGE_PROFILE"])
    os.environ["MIRAGE_GPU_MEMORY_BYTES"] = str(profile.memory_bytes)
    os.environ["MIRAGE_CONTEXT_BYTES"] = str(profile.context_bytes)
    os.environ["MIRAGE_VENDOR"] = profile.vendor
    visible = visible_devices.visible_gpus(int(os.environ.get("MIRAGE_NUM_GPUS", "0")), profile.is_amd, os.environ)
    os.environ["MIRAGE_VISIBLE_GPUS"] = ",".join(map(str, visible))
    if os.environ.get("MIRAGE_TIMING"):  # clocked mode's model, as the shim's cost model reads it
        tuning = os.environ.get("MIRAGE_TIMING_TUNING")
        os.environ["MIRAGE_TIMING_MODEL"] = profiles.timing_model(profile, profiles.load_tuning(tuning) if tuning else None)


def _join_the_full_world() -> None:
    """--stand-ins K / --stand-ins-in-node T: a torchrun worker is told its place in the full job,
    as torchrun on the full job would tell it. The job's ranks form K data-parallel replicas whose
    index changes every MIRAGE_STAND_INS_STRIDE ranks (default: the running world, data
    parallelism outermost); the running nodes are replica 0's, in order. So: WORLD_SIZE and
    ROLE_WORLD_SIZE are K times torchrun's, GROUP_WORLD_SIZE K times the running nodes, and RANK,
    ROLE_RANK and GROUP_RANK the worker's place among all. A worker whose local rank is not a
    multiple of T is stood in for by the one that is (its tensor-parallel group's first), so it
    exits here, before the program starts, with 0 as torchrun's agent expects of a finished worker.
    The running world and the stride are kept for the emulated NCCL
    (MIRAGE_STAND_INS_RUNNING_WORLD marks the rewrite as done for the worker's own children).
    torchrun's agent (no TORCHELASTIC_RUN_ID) keeps the running world its rendezvous needs."""
    copies = int(os.environ.get("MIRAGE_STAND_INS", "1"))
    in_node = int(os.environ.get("MIRAGE_STAND_INS_IN_NODE", "1"))
    if (copies == 1 and in_node == 1) or "TORCHELASTIC_RUN_ID" not in os.environ \
            or "MIRAGE_STAND_INS_RUNNING_WORLD" in os.environ:
        return
    if int(os.environ["LOCAL_RANK"]) % in_node:
        os._exit(0)
    running = int(os.environ["WORLD_SIZE"])
    stride = int(os.environ.get("MIRAGE_STAND_INS_STRIDE") or running)
    rank = int(os.environ["RANK"])
    full_rank = rank // stride * stride * copies + rank % stride
    os.environ.update(MIRAGE_STAND_INS_RUNNING_WORLD=str(running), MIRAGE_STAND_INS_STRIDE=str(stride),
                      RANK=str(full_rank), ROLE_RANK=str(full_rank),
                      GROUP_RANK=str(full_rank // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    for name in ("WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        if name in os.environ:
            os.environ[name] = str(int(os.environ[name]) * copies)


def _load_shim(torch_dir: str) -> None:
    """Maps this process's own torch libraries, then the shim that links to them. The shim (cached
    per torch binary, shared by environments holding the same wheel) carries no path to a torch
    installation: the loader matches its libc10/libtorch_cpu to the ones already mapped by name,
    and `import torch` then finds the same files mapped."""
    for library in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(os.path.join(torch_dir, "lib", library), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(os.environ["MIRAGE_SHIM_PATH"], mode=ctypes.RTLD_GLOBAL)


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Intercepts the first `import torch` of the process."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        _export_for_shim()
        _load_shim(spec.submodule_search_locations[0])
        run_torch_init = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            from mirage.runtime import session, torch_cuda

            session.attach()
            run_torch_init(module)
            torch_cuda.install(module)

        spec.loader.exec_module = exec_module
        return spec


def import_torch_for_fork_server() -> ModuleType:
    """The fork server's share of the hook (mirage/forkserver): the shim loaded, torch imported,
    nothing that depends on one process's environment. The shim reads its figures (visible GPUs,
    capacity, vendor) on first use, not at load, and nothing here uses it; the per-process
    rest is complete_forked_process's, in each child."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _TorchImportHook)]
    _load_shim(importlib.util.find_spec("torch").submodule_search_locations[0])
    import torch

    return torch


def complete_forked_process(torch: ModuleType) -> None:
    """What the hook does around `import torch` for this one process, in a child of the fork
    server, once it has taken over its process's environment."""
    from mirage.runtime import session, torch_cuda

    _join_the_full_world()
    _export_for_shim()
    # What the shim reads from the environment when it loads, read again for this process:
    # its slot in the session's memory table (node, rank) and its rank's faults.
    shim = ctypes.CDLL(os.environ["MIRAGE_SHIM_PATH"])
    shim.mirage_attach_session_table()
    shim.mirage_reload_faults()
    session.attach()
    torch_cuda.install(torch)


def arm() -> None:
    """Arms the torch import hook if this process belongs to a mirage session."""
    if not os.environ.get("MIRAGE_SHIM_PATH"):
        return
    _join_the_full_world()
    if "torch" in sys.modules:
        return
    sys.meta_path.insert(0, _TorchImportHook())
