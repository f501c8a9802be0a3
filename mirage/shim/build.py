"""Builds the device shim against the installed torch, once, and caches it.

The cache key covers the shim sources, this builder (its compiler flags), the torch version and
the Python version, so a change to any of them rebuilds. Building imports torch, which must happen in a process where the shim is
NOT being loaded; the launcher therefore runs this module as `python -m mirage.shim.build` in a
clean subprocess and reads the library path from its stdout. Concurrent builders serialise on a
file lock, so two `mirage run`s started together build once.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import sys
from pathlib import Path

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
LIBRARY_NAME = "mirage_shim"


def cache_root() -> Path:
    """Where built shims live: $MIRAGE_CACHE_DIR, else the user's cache directory."""
    explicit = os.environ.get("MIRAGE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mirage"


def library_path() -> Path:
    """The path the shim for this source + torch + Python has (or will have) once built."""
    key = hashlib.sha256()
    for source in SOURCES + HEADERS + [Path(__file__)]:  # the code and how it is compiled
        key.update(source.read_bytes())
    key.update(importlib.metadata.version("torch").encode())
    key.update(sys.version.encode())
    return cache_root() / f"shim-{key.hexdigest()[:16]}" / f"{LIBRARY_NAME}.so"


def build() -> Path:
    """Compiles the shim if it is not cached yet; returns the library path."""
    target = library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        # cpp_extension serialises builds with a "lock" file of its own that a killed build
        # leaves behind, after which every build waits forever. Holding our flock, we are the
        # only builder, so any such file is stale.
        (target.parent / "lock").unlink(missing_ok=True)
        import torch.utils.cpp_extension as cpp_extension

        torch_lib = Path(cpp_extension.TORCH_LIB_PATH)
        cpp_extension.load(
            name=LIBRARY_NAME,
            sources=[str(source) for source in SOURCES],
            build_directory=str(target.parent),
            # The shim is loaded before `import torch`, so it must find libtorch on its own
            # (rpath) and must not drag in libtorch_python (--as-needed).
            extra_ldflags=["-Wl,--as-needed", f"-Wl,-rpath,{torch_lib}"],
            extra_cflags=["-O3"],
            is_python_module=False,
            verbose=os.environ.get("MIRAGE_VERBOSE_BUILD") == "1",
        )
    return target


if __name__ == "__main__":
    print(build())
