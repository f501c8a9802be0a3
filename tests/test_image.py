"""`mirage run --image NAME` (launcher/containers.py): each node's processes in podman containers
joined to the node's namespaces. The runs need root, podman and the image (MIRAGE_TEST_IMAGE,
default localhost/mirage-node:test, which scripts/podman_image.sh builds in ~5 min; its first
run also builds the shim inside the image, ~6 min on 2 cores); without them they are skipped,
saying so. The refusals need no image; the missing-image one runs the real podman, which the
`podman` fixture installs from Debian where it is missing (scripts/podman_image.sh --install-only).

What a session leaves is found without mirage's own rule (tests/escapees.py): the workload records
its processes' host pids (--pid host), among them one with an empty environment in a session of
its own and an orphan; podman lists the containers; /dev/shm the node folders."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, mirage
from escapees import HIDING_COUNT, hiding_then, hiding_workload, recorded, still_running
from mirage.launcher import containers, nodes

IMAGE = os.environ.get("MIRAGE_TEST_IMAGE", "localhost/mirage-node:test")
_reason = containers.unavailable_reason(IMAGE) or nodes.unavailable_reason()
needs_image = pytest.mark.skipif(_reason is not None, reason=f"--image {IMAGE} cannot run here: {_reason} "
                                 "(scripts/podman_image.sh installs podman and builds the image)")
IMAGE_TORCH = "/usr/local/lib/python3.11/dist-packages/torch/"  # where the image's pip put torch

SMOKE = ("import socket, runpy, torch; print('where', socket.gethostname(), torch.__file__, flush=True); "
         f"runpy.run_path('{REPO}/tests/fixtures/ml/dist_smoke.py', run_name='__main__')")


@pytest.fixture(scope="module")
def podman() -> None:
    """The real podman (and runc), installed from Debian where it is missing: about 30 MB, 17 s
    here (2026-12-04); skipped where it cannot be (not root, or no apt-get)."""
    if shutil.which("podman") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            pytest.skip("podman is missing and cannot be installed here (needs root and apt-get)")
        installed = subprocess.run([str(REPO / "scripts" / "podman_image.sh"), "--install-only"],
                                   capture_output=True, text=True, timeout=600)
        assert installed.returncode == 0, installed.stderr[-3000:]


def session_leftovers(session: str, hidden: list[tuple[int, str]]) -> list[str]:
    """What a session could leave: the processes its workload recorded (`hidden`, by pid and start
    time), its containers, its /dev/shm folders."""
    found = [f"process {pid}" for pid in still_running(hidden)]
    listed = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True).stdout
    found += [f"container {name}" for name in listed.split() if session in name]
    found += [f"shm {path}" for path in Path("/dev/shm").glob(f"mirage-*{session}*")]
    return found


@needs_image
def test_two_nodes_run_in_the_image_with_their_hostnames_and_nccl_across_eth0(tmp_path):
    # run from tmp_path, which the containers mount (their cwd), so that the record is seen on both sides
    record = tmp_path / "pids"
    result = mirage("run", "--quiet", "--image", IMAGE, "--num-nodes", "2", "--gpus-per-node", "1",
                    "--workdir", str(tmp_path), "--", *hiding_then(record, ["python", "-c", SMOKE]))
    assert result.returncode == 0, result.stderr[-4000:]
    where = sorted(line.split("] ", 1)[1].split()[1:] for line in result.stdout.splitlines() if "] where " in line)
    assert [hostname for hostname, _ in where] == ["node0", "node1"]
    assert all(torch_file.startswith(IMAGE_TORCH) for _, torch_file in where), where  # the image's torch
    assert "dist_smoke_ok" in result.stdout and "all_reduce sum = 3 (expected 3) on 2 ranks" in result.stdout
    assert "in containers of image" in result.stderr
    session = result.stderr.split("session ", 1)[1].split()[0]
    hidden = [(int(pid), started) for pid, started in (line.split() for line in record.read_text().splitlines())]
    assert len(hidden) == 2 * HIDING_COUNT
    assert session_leftovers(session, hidden) == []


@needs_image
def test_containers_of_a_node_share_its_shm_and_exit_codes_pass_through():
    # Two ranks of one node, each in its own container: the node's /dev/shm (a host folder both
    # mount) is the same for both, and the emulated NCCL between them goes through it.
    result = mirage("run", "--quiet", "--image", IMAGE, "--gpus-per-node", "2", "--nproc-per-node", "2", "--", "sh", "-c",
                    "touch /dev/shm/mark-$RANK && python tests/fixtures/ml/dist_smoke.py && ls /dev/shm && hostname")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "dist_smoke_ok" in result.stdout
    for rank in (0, 1):
        assert f"[{rank}] mark-0" in result.stdout and f"[{rank}] mark-1" in result.stdout
        assert f"[{rank}] node0" in result.stdout  # one node is isolated too
    failed = mirage("run", "--quiet", "--image", IMAGE, "--", "sh", "-c", "exit 7")
    assert failed.returncode == 7, failed.stderr[-3000:]


@needs_image
def test_sigkill_of_mirage_leaves_no_container_process_or_shm_folder(tmp_path):
    """Mutation (2026-12-04): with containers.remove_containers a no-op, this fails with the process
    each node's container started with `env -i setsid` still running (found by its recorded pid) and
    both containers still listed."""
    record = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-m", "mirage", "run", "--image", IMAGE, "--num-nodes", "2",
                             "--workdir", str(tmp_path), "--", *hiding_workload(record)],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    line = ""
    while "session " not in line:
        line = proc.stderr.readline()
        assert line, "mirage ended before starting its session"
    session = line.split("session ", 1)[1].split()[0]
    hidden = recorded(record, 2 * HIDING_COUNT, proc)  # both nodes' containers run their workload
    assert sum(n.startswith("container") for n in session_leftovers(session, hidden)) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while (left := session_leftovers(session, hidden)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []


def test_a_missing_image_is_refused_before_anything_starts(podman):
    """The real podman answers `podman image exists` for an image it does not hold; mirage refuses
    on that answer, before a session starts."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the needs-root refusal is tested instead)")
    result = mirage("run", "--image", "localhost/no-such-image:0", "--", "true")
    assert result.returncode == 2
    assert "no image 'localhost/no-such-image:0'" in result.stderr and "scripts/podman_image.sh" in result.stderr
    assert "session" not in result.stderr


def test_missing_podman_and_no_isolate_nodes_are_refused():
    env = {**os.environ, "PATH": "/nonexistent"}
    result = mirage("run", "--image", IMAGE, "--", "true", env=env)
    assert result.returncode == 2
    expected = "podman not found" if os.geteuid() == 0 else "needs root"
    assert expected in result.stderr and ("apt-get install podman runc" in result.stderr or expected == "needs root")
    result = mirage("run", "--image", IMAGE, "--no-isolate-nodes", "--", "true")
    assert result.returncode == 2 and "drop --no-isolate-nodes" in result.stderr
