"""`mirage run --image NAME`: each emulated node's processes run in podman containers of an image,
joined to the node's namespaces (launcher/nodes.py), so the node keeps its hostname, eth0, bridge
address and IPC; only the filesystem (Python, torch, libraries) is the image's.

What podman can and cannot join is in docs/podman-notes.md. In short, each workload process is

    podman [--runtime runc] run --rm --name mirage-<session>-node<k>-rank<r>
        --ulimit nofile=H:H --ulimit nproc=P:P --pid host --cap-add SYS_PTRACE
        --network ns:/proc/<holder>/ns/net --uts ns:... --ipc ns:...
        -v <node shm dir>:/dev/shm -v <session hosts>:/etc/hosts:ro
        -v <mirage package's folder>:...:ro -v <shim cache> -v <session dir> -v <cwd> -w <cwd>
        --env-file <session dir>/env-rank<r> IMAGE CMD...

* The mount namespace cannot be joined, so the node's /dev/shm is a host folder
  (/dev/shm/mirage-<uid>-<session>.node<k>, named like the session's other segments so every
  cleanup path removes it) that the holder binds over its /dev/shm and each container mounts.
* `--pid host`: the workload's processes have host pids and carry MIRAGE_SESSION, so teardown
  and the reaper end them as they end any process of the session (SIGKILL of `podman run`
  is not forwarded to the container); the containers' names are recorded in the session folder
  and removed with `podman rm -f` by teardown, the reaper and `mirage cleanup`.
* SYS_PTRACE: the emulator opens /proc/<pid>/fd/<n> of host processes (the session service's
  memfds), which the kernel refuses to a process with fewer capabilities than the target.
* The shim: the image's torch is not the host's, so the shim and emulated NCCL are built for
  it, inside the image, into the shared cache (prepare(); once per image and mirage source).
* The environment goes through an --env-file, without the host's PATH (the image's PATH wins;
  a `python` that runs python3 comes last, for images that, like Debian's, have none).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mirage
from mirage.daemon import shared_table

BUILD_IMAGE_HINT = "scripts/podman_image.sh builds one (localhost/mirage-node:test: Debian 12, Python 3.11, CPU torch)"
CONTAINERS_FILE = "containers"  # in the session folder: the names of the session's containers
PODMAN_NPROC_CEILING = 32768  # podman lowers its own RLIMIT_NPROC to this before starting the runtime
HOST_ONLY_VARIABLES = ("PATH", "HOME", "VIRTUAL_ENV", "PYTHONHOME", "HOSTNAME", "OLDPWD", "PWD", "SHLVL", "_")
FALLBACK_BIN = "container-bin"  # in the session folder: `python` -> python3, last on the container's PATH
PACKAGE_ROOT = Path(mirage.__file__).resolve().parent.parent  # the folder holding the `mirage` package


class ImageError(Exception):
    """--image cannot be used (why, and the fix)."""


def unavailable_reason(image: str) -> str | None:
    """Why `--image image` cannot run here, or None; the message names the fix."""
    if os.geteuid() != 0:
        return "joining a node's namespaces with podman needs root (rootful podman); run mirage as root"
    if shutil.which("podman") is None:
        return ("podman not found. Fix: apt-get install podman runc (Debian), or run scripts/podman_image.sh, "
                "which installs them and builds an image")
    try:
        present = subprocess.run(["podman", "image", "exists", image], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError) as err:
        return f"podman does not answer ({err})"
    if not present:
        return (f"no image {image!r} in podman's storage (`podman images` lists them). Fix: build or import one: "
                f"{BUILD_IMAGE_HINT}; or `podman load -i FILE` / `podman pull NAME`")
    return None


def node_shm_dir(session_id: str, node: int) -> Path:
    """Node `node`'s /dev/shm, a host folder: `mirage-<uid>-<session>.node<k>` is the pattern of the
    session's shared-memory segments, so shared_table.segments() and the reaper find it."""
    return shared_table.SHM_DIR / f"{shared_table.PREFIX}{os.getuid()}-{session_id}.node{node}"


def _rlimit(kind: int, ceiling: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)


def _podman() -> list[str]:
    # crun (podman's default) refuses cgroup v1 "hybrid" hosts; runc works on v1 and v2 alike.
    return ["podman", "--runtime", "runc"] if shutil.which("runc") else ["podman"]


def _run_flags(rlimit_nofile: int | None = None) -> list[str]:
    """Rlimits no higher than ours: podman's default (1048576) fails where root lacks CAP_SYS_RESOURCE."""
    nofile = rlimit_nofile or _rlimit(resource.RLIMIT_NOFILE, 1 << 20)
    nproc = _rlimit(resource.RLIMIT_NPROC, PODMAN_NPROC_CEILING)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def _mounts(paths: list[tuple[Path, bool]]) -> list[str]:
    """-v flags, each folder at its own path; a folder given twice is mounted once (rw wins)."""
    chosen: dict[str, bool] = {}
    for path, read_only in paths:
        key = str(Path(path).resolve())
        if key == "/":
            continue  # never over the image's root
        chosen[key] = chosen.get(key, True) and read_only
    return [flag for path in sorted(chosen) for flag in ("-v", f"{path}:{path}{':ro' if chosen[path] else ''}")]


def prepare(image: str, cache: Path, narrate) -> tuple[str, str]:
    """The shim and emulated NCCL for the image's torch (built inside the image into the shared
    cache if not there yet); returns their paths, the same inside the container and here."""
    base = _podman() + ["run", "--rm", "--network", "none", *_run_flags(),
                        *_mounts([(PACKAGE_ROOT, True), (cache, False)]),
                        "-e", f"PYTHONPATH={PACKAGE_ROOT}", "-e", f"MIRAGE_CACHE_DIR={cache}", image, "python3", "-c"]
    lookup = ("import json; from mirage.shim import build as b; s, n = b.library_path(), b.nccl_module_path(); "
              "print(json.dumps([str(s), str(n), s.exists() and n.exists()]))")
    found = subprocess.run(base + [lookup], capture_output=True, text=True)
    try:
        shim, nccl, built = json.loads(found.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ImageError(f"image {image!r} cannot run mirage (it needs python3 and torch): "
                         + (found.stderr.strip()[-2000:] or f"exit code {found.returncode}")) from None
    if not built:
        narrate(f"building the device shim inside image {image} (first run only: a few minutes on 2 cores)")
        result = subprocess.run(base + ["from mirage.shim import build; build.build()"], capture_output=True, text=True)
        if result.returncode != 0 or not Path(shim).exists() or not Path(nccl).exists():
            raise ImageError(f"building the device shim inside image {image!r} failed (the image needs g++, "
                             f"python3-dev and ninja, as {BUILD_IMAGE_HINT.split(' builds')[0]}'s have):\n"
                             + result.stderr[-4000:])
    return shim, nccl


@dataclass
class NodeContainers:
    """How the session's workload processes are started in containers of `image`."""

    image: str
    session_id: str
    session_dir: Path
    cache: Path
    shim: str
    nccl: str

    def __post_init__(self) -> None:
        fallback = self.session_dir / FALLBACK_BIN
        fallback.mkdir(mode=0o755, exist_ok=True)
        (fallback / "python").write_text('#!/bin/sh\nexec python3 "$@"\n')
        (fallback / "python").chmod(0o755)
        self.image_path = _image_path(self.image)

    def name(self, node: int, rank: int) -> str:
        return f"mirage-{self.session_id}-node{node}-rank{rank}"

    def argv(self, node: int, rank: int, holder: int, argv: list[str], env: dict[str, str], user: dict[str, str],
             cwd: str | None, interactive: bool) -> list[str]:
        """`argv` in a container of the image, joined to the namespaces `holder` holds."""
        name = self.name(node, rank)
        env_file = self.session_dir / f"env-{name}"
        env_file.write_text("".join(f"{key}={value}\n" for key, value in self._environment(env, user).items()))
        env_file.chmod(0o600)
        with open(self.session_dir / CONTAINERS_FILE, "a") as names:
            names.write(name + "\n")
        workdir = os.path.abspath(cwd or os.getcwd())
        return [*_podman(), "run", "--rm", *(["-i"] if interactive else []), "--name", name, *_run_flags(),
                "--pid", "host", "--cap-add", "SYS_PTRACE",
                *(flag for kind in ("net", "uts", "ipc")
                  for flag in (f"--{'network' if kind == 'net' else kind}", f"ns:/proc/{holder}/ns/{kind}")),
                "-v", f"{node_shm_dir(self.session_id, node)}:/dev/shm", "-v", f"{self.session_dir / 'hosts'}:/etc/hosts:ro",
                *_mounts([(PACKAGE_ROOT, True), (self.cache, False), (self.session_dir, False), (Path(workdir), False)]),
                "-w", workdir, "--env-file", str(env_file), self.image, *argv]

    def _environment(self, env: dict[str, str], user: dict[str, str]) -> dict[str, str]:
        """The process's environment as the container sees it: no host-only paths (the image's PATH,
        HOME), mirage importable, the shim built for the image's torch."""
        inside = {key: value for key, value in env.items() if key not in HOST_ONLY_VARIABLES and "\n" not in value}
        path = user.get("PATH") or self.image_path
        inside["PATH"] = f"{path}:{self.session_dir / FALLBACK_BIN}"
        inside["PYTHONPATH"] = f"{inside['PYTHONPATH']}:{PACKAGE_ROOT}" if inside.get("PYTHONPATH") else str(PACKAGE_ROOT)
        inside.update({"MIRAGE_SHIM_PATH": self.shim, "MIRAGE_NCCL_PATH": self.nccl, "MIRAGE_CACHE_DIR": str(self.cache),
                       "MIRAGE_IMAGE": self.image})
        return inside


def _image_path(image: str) -> str:
    """The PATH the image sets (its config's Env), else the usual one."""
    result = subprocess.run(["podman", "image", "inspect", "--format", "{{json .Config.Env}}", image],
                            capture_output=True, text=True)
    try:
        for entry in json.loads(result.stdout) or []:
            if entry.startswith("PATH="):
                return entry[5:]
    except ValueError:
        pass
    return "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def remove_containers(session_dir: Path) -> None:
    """`podman rm -f` of the session's containers (named in its folder): those a SIGKILL of
    `podman run` or of mirage left. Quiet when they are gone already (--rm)."""
    try:
        names = (session_dir / CONTAINERS_FILE).read_text().split()
    except OSError:
        return
    if names and shutil.which("podman"):
        subprocess.run(["podman", "rm", "--force", "--ignore", "--time", "0", *names],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
