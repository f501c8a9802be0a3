"""`--check-races`'s Python half: what a report says a tensor is, and the exit status.

The checker (mirage/shim/race_checker.cpp) sees storages and addresses; a user thinks in
parameters and gradients. When it reports a race it asks `owner_of` here, once per report, so
the search through the program's modules costs nothing while no race is found. In "error" mode
the op that raced raises; `install` makes the process fail at its end even if the program
caught that error.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from types import ModuleType

import torch


def install(torch_module: ModuleType) -> None:
    """With --check-races (error mode), an exit hook registered before the program's own, so that
    it runs after theirs: the process ends with status 1 if a race was reported."""
    if os.environ.get("MIRAGE_CHECK_RACES") != "error":
        return

    def fail_if_a_race_was_reported() -> None:
        if torch_module.ops.mirage.races_failed() == 0:
            return
        print("mirage --check-races: exiting with status 1: a data race was reported above "
              "(--check-races=warn lets the run succeed)", file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(1)

    atexit.register(fail_if_a_race_was_reported)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's sharded parameter's) local shard; any other tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def _storage_address(tensor: torch.Tensor | None) -> int | None:
    if tensor is None or not isinstance(tensor, torch.Tensor):
        return None
    try:
        return _local(tensor).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a fake or storage-less tensor
        return None


def owner_of(address: int) -> str:
    """'parameter 'net.0.weight' of Net', 'gradient of ...', 'buffer ...': the first module tree
    holding a tensor whose storage's bytes are at `address`; '' if none does."""
    modules = [obj for obj in gc.get_objects() if isinstance(obj, torch.nn.Module)]
    children = {id(child) for module in modules for child in module.children()}
    for root in (module for module in modules if id(module) not in children):
        owner = type(root).__name__
        for name, parameter in root.named_parameters(remove_duplicate=False):
            if _storage_address(parameter) == address:
                return f"parameter '{name}' of {owner}"
            if _storage_address(parameter.grad) == address:
                return f"gradient of parameter '{name}' of {owner}"
        for name, buffer in root.named_buffers(remove_duplicate=False):
            if _storage_address(buffer) == address:
                return f"buffer '{name}' of {owner}"
    return ""
