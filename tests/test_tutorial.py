"""The reference tutorial's commands, verbatim: the product's contract.

Each command here is typed as the tutorial (and README.md) gives it, against the tutorial's own
environment `.venv-mi350` that its runner creates. A change that breaks one of these is wrong
unless an issue says otherwise: do not edit a command or a promised line to fit a change.
Nothing here asks for isolated nodes: whoever runs the commands, root or not, gets one result.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

TUTORIAL_VENV = REPO / ".venv-mi350"
TUTORIAL_PYTHON = ".venv-mi350/bin/python3"
TUTORIAL_NCCL_ENV = ["--env", "NCCL_P2P_DISABLE=1", "--env", "NCCL_SHM_DISABLE=1", "--env", "NCCL_SOCKET_IFNAME=lo"]


def shell(command: str, extra_env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """Runs a tutorial line as a user types it in the repository root. VENV is dropped so that
    the runner's own default (.venv-mi350) applies, as it does for a user."""
    env = {k: v for k, v in os.environ.items() if k != "VENV"}
    env.update(extra_env or {})
    return subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def tutorial_mirage(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`.venv-mi350/bin/mirage ARGS` from the repository root (the tutorial's mirage)."""
    return subprocess.run([str(TUTORIAL_VENV / "bin" / "mirage"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def first_run() -> subprocess.CompletedProcess:
    """The tutorial's first command, which sets up .venv-mi350 (on a fresh clone: creates it)."""
    return shell("./tests/run_ddp_mlp_mi350.sh")


def assert_ddp_trained(result: subprocess.CompletedProcess, gpus: int, steps: int) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if not line.startswith("==> installing")]
    assert lines[0].startswith("[rank 0] loss: ") and f"over {steps} steps" in lines[0], lines
    assert lines[1:] == ["[rank 0] all ranks converged with identical replicas", "ddp_mlp_ok",
                         f"==> PASS: DDP MLP trained on {gpus} emulated mi350x GPUs via torchrun"], lines


def test_runner_sets_up_and_trains_ddp_on_two_gpus(first_run):
    assert_ddp_trained(first_run, gpus=2, steps=50)


def test_runner_again_without_install(first_run):
    assert_ddp_trained(shell("SKIP_INSTALL=1 ./tests/run_ddp_mlp_mi350.sh"), gpus=2, steps=50)


def test_runner_on_four_gpus_for_100_steps(first_run):
    assert_ddp_trained(shell("NPROC=4 STEPS=100 SKIP_INSTALL=1 ./tests/run_ddp_mlp_mi350.sh"), gpus=4, steps=100)


def test_multi_node_ddp_on_the_loopback_socket_transport(first_run):
    result = tutorial_mirage("run", "--profile", "mi350x", "--num-nodes", "2", "--gpus-per-node", "2",
                             *TUTORIAL_NCCL_ENV, "--env", "NCCL_DEBUG=INFO", "--", TUTORIAL_PYTHON,
                             "tests/fixtures/ml/ddp_mlp.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0] [rank 0] all ranks converged with identical replicas" in result.stdout
    assert "[0] ddp_mlp_ok" in result.stdout
    assert_loopback_sockets(result.stderr)


def test_multi_node_dist_smoke_prints_the_promised_lines(first_run):
    result = tutorial_mirage("run", "--profile", "mi350x", "--num-nodes", "2", "--gpus-per-node", "2",
                             *TUTORIAL_NCCL_ENV, "--env", "NCCL_DEBUG=INFO", "--", TUTORIAL_PYTHON,
                             "tests/fixtures/ml/dist_smoke.py")
    assert result.returncode == 0, result.stderr[-3000:]
    for promised in ("[rank 1] current device = 1 (cuda:1)", "[rank 0] post all_reduce: tensor = 3.0",
                     "dist_smoke_ok"):
        assert promised in result.stdout, result.stdout
    assert_loopback_sockets(result.stderr)


def assert_loopback_sockets(stderr: str) -> None:
    """What the tutorial says its NCCL variables do: the collectives go over the socket
    transport, on loopback, between the two nodes (NCCL_DEBUG=INFO's lines, as NCCL prints them)."""
    assert "RCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>" in stderr, stderr[-3000:]
    assert any(line.endswith("RCCL INFO Channel 00/0 : 0[0] -> 1 via NET/Socket/0") for line in stderr.splitlines())
    assert "P2P direct copies" not in stderr


def test_in_process_with_two_ranks(first_run):
    result = tutorial_mirage("run", "--in-process", "--profile", "mi350x", "--gpus-per-node", "2", "--", "torchrun",
                             "--standalone", "--nproc_per_node=2", "tests/fixtures/ml/ddp_mlp.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank 0] all ranks converged with identical replicas" in result.stdout and "ddp_mlp_ok" in result.stdout


def test_troubleshooting_two_ranks_pinned_to_one_gpu_fail_with_duplicate_gpu(first_run, tmp_path: Path):
    """The tutorial's troubleshooting case: both ranks of a node use cuda:0. NCCL refuses it at
    the first collective; every rank ends (the run returns instead of hanging)."""
    script = tmp_path / "same_gpu.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "torch.cuda.set_device(0)\n"
                      "dist.init_process_group('nccl')\n"
                      "t = torch.ones(4, device='cuda')\n"
                      "dist.all_reduce(t)\n"
                      "print('unreachable', flush=True)\n")
    result = tutorial_mirage("run", "--profile", "mi350x", "--gpus-per-node", "2", "--", "torchrun", "--standalone",
                             "--nproc_per_node=2", str(script))
    assert result.returncode != 0
    assert "unreachable" not in result.stdout
    assert "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0" in result.stderr, result.stderr[-3000:]


def test_single_rank(first_run):
    assert_ddp_trained(shell("NPROC=1 SKIP_INSTALL=1 ./tests/run_ddp_mlp_mi350.sh"), gpus=1, steps=50)
