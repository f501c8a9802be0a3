"""The environment a workload process gets, layered as the CLI contract says.

Order, later wins: the emulator's defaults (what the caller has not set: TRITON_INTERPRET=1, so
that user-written Triton kernels run through Triton's interpreter, on the device tensors' memory,
where a GPU build would compile them for the GPU), the caller's environment (or an almost empty one
with --clear-env-vars), the emulator's own variables, the user's --env, then the job identity. Identity and the
emulator's MIRAGE_* variables cannot be overridden by --env (a warning names each one), and
search lists are prepended to the caller's instead of replacing them. The profile vendor's smi
tools (mirage/runtime/smi_commands.py) come first on PATH, as the driver's are on a GPU box.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import mirage
from mirage import profiles

RUNTIME_SITE_DIR = Path(mirage.__file__).parent / "runtime" / "site"
SMI_BIN_DIR = Path(mirage.__file__).parent / "runtime" / "smi_bin"  # <vendor>/nvidia-smi, rocm-smi
KEPT_WHEN_CLEARED = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TERM", "TMPDIR", "SHELL")
SEARCH_LISTS = ("PYTHONPATH", "LD_LIBRARY_PATH", "LD_PRELOAD")
DEFAULTS = {"TRITON_INTERPRET": "1"}


def is_protected(key: str, identity: dict[str, str]) -> bool:
    """Variables --env may not set: the process's job identity and everything mirage exports."""
    return key in identity or key.startswith("MIRAGE_")


def parse_assignments(pairs: list[str]) -> dict[str, str]:
    """`--env KEY=VALUE` strings to a dict; raises ValueError naming a malformed one."""
    result: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum():
            raise ValueError(f"--env {pair!r} is not KEY=VALUE (example: --env NCCL_DEBUG=INFO)")
        result[key] = value
    return result


def _prepend(env: dict[str, str], key: str, value: str) -> None:
    separator = " " if key == "LD_PRELOAD" else os.pathsep
    env[key] = value + separator + env[key] if env.get(key) else value


def build(
    *,
    emulator: dict[str, str],
    user: dict[str, str],
    identity: dict[str, str],
    clear: bool = False,
    warn=lambda message: None,
) -> dict[str, str]:
    """The full environment of one workload process."""
    base = os.environ
    env = {k: base[k] for k in KEPT_WHEN_CLEARED if k in base} if clear else dict(base)
    env = {**DEFAULTS, **env}
    env.update(emulator)
    for key, value in user.items():
        if is_protected(key, identity):
            warn(f"--env {key} ignored: mirage sets {key} itself for every process")
        elif key in SEARCH_LISTS:
            _prepend(env, key, value)
        else:
            env[key] = value
    env.update(identity)
    _prepend(env, "PYTHONPATH", str(RUNTIME_SITE_DIR))
    # `python` in the command means the interpreter whose torch mirage checked and built for.
    _prepend(env, "PATH", str(Path(sys.executable).parent))
    if "MIRAGE_PROFILE" in emulator:
        _prepend(env, "PATH", _smi_dir(emulator["MIRAGE_PROFILE"]))
    return env


@functools.cache  # one read of the profile per run, not one per process it starts
def _smi_dir(profile_path: str) -> str:
    """The folder of the smi tools of the profile's vendor."""
    return str(SMI_BIN_DIR / profiles.load(profile_path).vendor)
