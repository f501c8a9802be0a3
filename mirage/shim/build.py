"""Builds mirage's native parts against the installed torch, once, and caches them: the device
shim (this folder; a plain library loaded before `import torch`) and the emulated NCCL backend
(mirage/nccl; a Python extension module, loaded once torch is imported, next to the shim).

The cache key covers both parts' sources, this builder (its compiler flags), the torch release and
the exact binaries of its libraries (their hashes, from the wheel's RECORD), and the Python
version, so a change to any of them rebuilds, while two environments holding the same torch wheel
share one build: the libraries carry no path to a torch installation (no rpath), and the process
that loads them maps its own torch's libc10/libtorch_cpu first (mirage.runtime.boot), so each
environment's workload links to its own. Building imports torch, which must happen in a process where the shim is
NOT being loaded; the launcher therefore runs this module as `python -m mirage.shim.build` in a
clean subprocess and reads the library path from its stdout. Concurrent builders serialise on a
file lock, so two `mirage run`s started together build once. Objects are compiled in a build
folder per torch + Python (not per source), so a change to one source file recompiles that file
only (ninja), and the finished library is copied to its source-keyed path.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import sys
from pathlib import Path

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
LIBRARY_NAME = "mirage_shim"
NCCL_DIR = Path(__file__).parent.parent / "nccl"
NCCL_SOURCES = sorted(NCCL_DIR.glob("*.cpp"))
# The backend reads the shim's shared device memory through this header's C interface (and its
# clock through device_clock.h's, found with dlsym like the arena).
NCCL_HEADERS = sorted(NCCL_DIR.glob("*.h")) + [Path(__file__).parent / "shared_device_memory.h"]
NCCL_MODULE_NAME = "mirage_nccl"


def cache_root() -> Path:
    """Where built shims live: $MIRAGE_CACHE_DIR, else the user's cache directory."""
    explicit = os.environ.get("MIRAGE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mirage"


def library_path() -> Path:
    """The path the shim for this source + torch + Python has (or will have) once built."""
    return cache_root() / f"shim-{_key(SOURCES + HEADERS)}" / f"{LIBRARY_NAME}.so"


# The torch libraries mirage's native parts link to; their hashes identify the binaries.
LINKED_TORCH_LIBRARIES = ("torch/lib/libc10.so", "torch/lib/libtorch_cpu.so", "torch/lib/libtorch_python.so")


def _torch_binaries() -> str:
    """The installed torch's release and the hashes its wheel's RECORD gives the libraries we link
    to (reading RECORD is cheap; hashing 400 MB of libraries is not). A torch without those
    records (a source build) is named by its installation directory instead, so it never shares."""
    torch = importlib.metadata.distribution("torch")
    records = {}
    for line in (torch.read_text("RECORD") or "").splitlines():
        path, _, rest = line.partition(",")
        if path in LINKED_TORCH_LIBRARIES:
            records[path] = rest.partition(",")[0]
    if len(records) != len(LINKED_TORCH_LIBRARIES) or not all(records.values()):
        records = {"installation": str(Path(torch.locate_file("torch")).resolve())}
    return f"{torch.version} {sorted(records.items())}"


def _key(sources: list[Path]) -> str:
    key = hashlib.sha256()
    for source in sources + [Path(__file__)]:  # the code and how it is compiled
        key.update(source.read_bytes())
    key.update(_torch_binaries().encode())
    key.update(sys.version.encode())
    return key.hexdigest()[:16]


def objects_dir() -> Path:
    """Where the shim's objects are compiled (ninja's build folder): one per torch binary and Python,
    not per source, so a change to one source recompiles that file only."""
    return cache_root() / f"objects-{_key([])}"


def nccl_module_path() -> Path:
    """The path the emulated NCCL extension for this source + torch + Python has once built."""
    return cache_root() / f"nccl-{_key(NCCL_SOURCES + NCCL_HEADERS)}" / f"{NCCL_MODULE_NAME}.so"


def build_identity() -> dict[str, str | bool]:
    """What a bug report needs to name this installation: mirage's version, the torch it runs on
    (version and where it is installed) and the native parts' build keys (the cache folders'
    names), with whether they are built yet. Reads metadata only: no torch import, no build."""
    import mirage

    torch = importlib.metadata.distribution("torch")
    return {
        "mirage": mirage.__version__,
        "torch": torch.version,
        "torch_path": str(Path(torch.locate_file("torch")).resolve()),
        "python": sys.version.split()[0],
        "shim_build_key": library_path().parent.name.removeprefix("shim-"),
        "shim_built": library_path().exists(),
        "nccl_build_key": nccl_module_path().parent.name.removeprefix("nccl-"),
    }


def build() -> Path:
    """Compiles the shim and the NCCL extension if not cached yet; returns the shim's path."""
    target = library_path()
    if target.exists() and nccl_module_path().exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(cache_root() / ".build-lock", "w") as lock:  # one builder at a time: they share objects
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists() and nccl_module_path().exists():
            return target
        # cpp_extension serialises builds with a "lock" file of its own that a killed build
        # leaves behind, after which every build waits forever. Holding our flock, we are the
        # only builder, so any such file is stale.
        nccl_dir = nccl_module_path().parent
        nccl_dir.mkdir(parents=True, exist_ok=True)
        for build_dir in (target.parent, nccl_dir):
            (build_dir / "lock").unlink(missing_ok=True)
        import torch.utils.cpp_extension as cpp_extension

        verbose = os.environ.get("MIRAGE_VERBOSE_BUILD") == "1"
        if not target.exists():
            objects = objects_dir()
            objects.mkdir(parents=True, exist_ok=True)
            (objects / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=LIBRARY_NAME, sources=[str(source) for source in SOURCES], build_directory=str(objects),
                # The shim is loaded before `import torch`, after the process's own libtorch
                # (boot.py), and must not drag in libtorch_python (--as-needed).
                extra_ldflags=["-Wl,--as-needed"], extra_cflags=["-O3"], is_python_module=False,
                # libkineto's plugin interface (profiler_activities.cpp), shipped in the wheel
                extra_include_paths=[str(Path(cpp_extension.TORCH_LIB_PATH).parent / "include" / "kineto")],
                verbose=verbose)
            partial = target.with_suffix(".partial")
            shutil.copy2(objects / f"{LIBRARY_NAME}.so", partial)
            partial.rename(target)
        if not nccl_module_path().exists():
            # The backend subclasses c10d's pybind Backend: a Python extension, imported after
            # torch, so it links libtorch_python like any torch extension.
            cpp_extension.load(
                name=NCCL_MODULE_NAME, sources=[str(source) for source in NCCL_SOURCES],
                build_directory=str(nccl_dir), extra_cflags=["-O3"], is_python_module=True,
                verbose=verbose)
    return target


if __name__ == "__main__":
    print(build())
