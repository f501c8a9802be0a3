"""PyTorch's CUDA Sanitizer on emulated GPUs, as on CUDA: both ways of turning it on work, the
classic race (a tensor written on the default stream, read on a side stream with no wait_stream)
is reported with PyTorch's own message and both accesses' stack traces, and correct programs,
from one stream's wait_stream to DDP, FSDP2 and tensor parallel, report nothing. The emulated
device reports events, streams, synchronisations and allocations to torch's GPU trace, which is
where the sanitizer learns the order a GPU would keep."""

import pytest

from conftest import mirage

PROGRAM = """
import sys
import torch
if "in-program" in sys.argv:
    import torch.cuda._sanitizer
    torch.cuda._sanitizer.enable_cuda_sanitizer()
a = torch.ones(1000, device="cuda")  # written on the default stream
side = torch.cuda.Stream()
if "ordered" in sys.argv:
    side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    b = a * 2  # read on the side stream
torch.cuda.current_stream().wait_stream(side)
print("result", b[0].item())
"""


@pytest.mark.parametrize("how", ["in-program", "TORCH_CUDA_SANITIZER=1"])
def test_the_classic_race_is_reported_with_both_stack_traces(tmp_path, how):
    script = tmp_path / "race.py"
    script.write_text(PROGRAM)
    env = ["--env", how] if "=" in how else []
    result = mirage("run", "--quiet", *env, "--", "python", str(script), how, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    report = result.stderr
    assert "CSAN detected a possible data race on tensor with data pointer" in report, report[-3000:]
    assert "Access by stream" in report and "aten::mul.Tensor" in report and "reading from argument(s) self" in report
    assert "Previous access by stream 0 during kernel:" in report and "aten::ones" in report
    assert f'File "{script}", line 12' in report and f'File "{script}", line 7' in report  # b = a * 2; a = ones
    assert "CUDASanitizerErrors: detected 1 errors" in report and "result" not in result.stdout


@pytest.mark.parametrize("how", ["in-program", "TORCH_CUDA_SANITIZER=1"])
def test_the_same_program_with_wait_stream_reports_nothing(tmp_path, how):
    script = tmp_path / "ordered.py"
    script.write_text(PROGRAM)
    env = ["--env", how] if "=" in how else []
    result = mirage("run", "--quiet", *env, "--", "python", str(script), how, "ordered", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "result 2.0" and "CSAN" not in result.stderr


def test_fsdp2_tensor_parallel_and_ddp_report_nothing():
    result = mirage("run", "--quiet", "--nproc-per-node", "4", "--gpus-per-node", "4", "--env",
                    "TORCH_CUDA_SANITIZER=1", "--", "python", "tests/workloads/parallelisms.py", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0] parallelisms_ok" in result.stdout and "CSAN" not in result.stderr
