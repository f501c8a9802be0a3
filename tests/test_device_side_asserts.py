"""An index out of bounds that a CUDA kernel checks on the device (a label >= the class count in
F.cross_entropy, x[idx] with a tensor index, gather, an embedding's token) is, on a GPU, "CUDA
error: device-side assert triggered", after which every CUDA call of the process fails the same
way. The CPU kernel the device runs raises an IndexError instead, which a program on a GPU never
sees; a Python int index (x[5]) is a host check on both and stays an IndexError."""

from __future__ import annotations

import pytest

from conftest import mirage

SCRIPT = """
import sys, torch, torch.nn.functional as F
case = sys.argv[1]
x = torch.arange(6.0, device="cuda")
for host_check in (lambda: x[5 + 1], lambda: x.gather(1, torch.tensor([0], device="cuda"))):
    try:
        host_check()
    except IndexError as e:
        print("host check:", e)
bad = {"cross_entropy": lambda: F.cross_entropy(torch.randn(4, 10, device="cuda"), torch.tensor([1, 2, 10, 3], device="cuda")),
       "index": lambda: x[torch.tensor([7], device="cuda")],
       "gather": lambda: x.gather(0, torch.tensor([9], device="cuda")),
       "embedding": lambda: torch.nn.Embedding(3, 2).cuda()(torch.tensor([[0, 3]], device="cuda"))}[case]
for attempt in ("the op", "a later op", "synchronize"):
    try:
        {"the op": bad, "a later op": lambda: torch.ones(2, device="cuda") * 2, "synchronize": torch.cuda.synchronize}[attempt]()
        print(attempt, "ran")
    except torch.AcceleratorError as e:
        print(attempt, "raised:", str(e).splitlines()[0])
print("cpu", torch.ones(2).sum().item())
"""


@pytest.mark.parametrize("case, host_words", [("cross_entropy", "Target 10 is out of bounds"),
                                              ("index", "index 7 is out of bounds"),
                                              ("gather", "index 9 is out of bounds"),
                                              ("embedding", "index out of range")])
def test_an_index_a_cuda_kernel_checks_is_a_sticky_device_side_assert(case, host_words):
    result = mirage("run", "--profile", "h100", "--gpus-per-node", "1", "--", "python", "-c", SCRIPT, case)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[:2] == ["host check: index 6 is out of bounds for dimension 0 with size 6",
                         "host check: Dimension out of range (expected to be in range of [-1, 0], but got 1)"]
    assert lines[2:5] == [f"{attempt} raised: CUDA error: device-side assert triggered"
                          for attempt in ("the op", "a later op", "synchronize")]
    assert lines[5] == "cpu 2.0"  # the host is unaffected
    assert "mirage: device-side assert in aten::" in result.stderr and host_words in result.stderr


def test_a_rocm_build_says_hip():
    result = mirage("run", "--profile", "mi350x", "--gpus-per-node", "1", "--", "python", "-c", SCRIPT, "gather")
    assert "the op raised: HIP error: device-side assert triggered" in result.stdout.splitlines()
