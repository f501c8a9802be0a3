"""`mirage run --check-races` (issue 36): what a GPU would run in an order the program does not
ensure is reported deterministically, naming the rank, the op, the tensor and both accesses'
lines, and the run fails; `=warn` only reports; without it the same programs run and give the
right answer, as emulated kernels run in order. Correct programs, from DDP to FSDP2, DeepSpeed
ZeRO-3, tensor and pipeline parallelism in torchtitan and Megatron-core, report nothing.

The seeded bugs are tests/workloads/races/*.py, one per kind the checker covers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, mirage
from test_megatron import megatron_path  # noqa: F401 (a fixture)
from test_torchtitan import STEPS, assets, torchtitan_path, train  # noqa: F401 (fixtures)

RACES = "tests/workloads/races"
REPORT = "mirage --check-races: a data race on"


def run(*flags: str, ranks: int = 1) -> tuple[int, str, str]:
    command = (["torchrun", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else ["python"])
    result = mirage("run", "--quiet", "--gpus-per-node", str(max(ranks, 1)), *flags[:-1], "--", *command,
                    *flags[-1].split(), timeout=300)
    return result.returncode, result.stdout, result.stderr


def reports(stderr: str) -> list[str]:
    """Each report's text, header to footer."""
    return re.findall(r"={16} mirage --check-races: a data race on .*?\n={16} \(mirage runs", stderr, re.S)


def accesses(report: str) -> tuple[str, str]:
    """The 'now' and 'earlier' stack sections of a report."""
    now = report.split("  now, from:\n")[1].split("  earlier, from:\n")[0]
    return now, report.split("  earlier, from:\n")[1]


@pytest.mark.parametrize("program, kind, now, earlier, now_line, earlier_line", [
    pytest.param("cpu_read.py", "a CPU read of device memory with no synchronisation",
                 "aten::_local_scalar_dense reads it on the default stream of cuda:0",
                 "aten::sum wrote it on stream", 16, 13, id="item-of-a-side-streams-result"),
    pytest.param("cpu_read.py cpu", "a CPU read of device memory with no synchronisation",
                 "Memcpy DtoH (copy_) reads it on the default stream of cuda:0",
                 "aten::sum wrote it on stream", 16, 13, id="cpu-of-a-side-streams-result"),
    pytest.param("memory_reuse.py", "memory reuse across streams", "aten::zero_ writes it on the default stream",
                 "aten::mul read that memory on stream", 18, 14, id="freed-without-record-stream"),
    pytest.param("side_stream.py", "stream ordering", "aten::mm reads it on stream",
                 "aten::fill_ wrote it on the default stream", 16, 12, id="parameter-read-on-a-side-stream"),
    pytest.param("pinned_copy.py", "a CPU read of device memory with no synchronisation",
                 "the host reads it (aten::sum)", "Memcpy DtoH (copy_) wrote it on the default stream", 15, 12,
                 id="non-blocking-copy-read-before-synchronize"),
])
def test_a_seeded_race_fails_the_run_with_both_lines(program, kind, now, earlier, now_line, earlier_line):
    code, stdout, stderr = run("--check-races", f"{RACES}/{program}")
    assert code == 1 and "result" not in stdout, stderr[-3000:]
    [report] = reports(stderr)
    assert f"({kind})" in report and now in report and earlier in report, report
    now_stack, earlier_stack = accesses(report)
    file = program.split()[0]
    assert f'{file}", line {now_line}' in now_stack and f'{file}", line {earlier_line}' in earlier_stack, report
    assert f"RuntimeError: mirage --check-races: {kind}" in stderr


def test_a_report_names_the_parameter():
    _, _, stderr = run("--check-races", f"{RACES}/side_stream.py")
    [report] = reports(stderr)
    assert "tensor: float32[64, 64], parameter 'weight' of Linear" in report, report


def in_one_session(*flags: str, programs: list[str]) -> tuple[int, list[str], str]:
    """Runs each of `programs` (a script and its arguments) in turn in one session; the exit code
    of the last to fail (0: none did), each one's output, and the session's stderr."""
    loop = "; ".join(f'python {RACES}/{p}; code=$(( $? ? $? : ${{code:-0}} )); echo "--- end"' for p in programs)
    result = mirage("run", "--quiet", "--gpus-per-node", "1", *flags, "--", "bash", "-c", loop + "; exit $code",
                    timeout=300)
    return result.returncode, [out.strip() for out in result.stdout.split("--- end")[:-1]], result.stderr


def test_without_the_checker_the_same_programs_give_the_right_answer():
    programs = ["cpu_read.py", "memory_reuse.py", "side_stream.py", "pinned_copy.py"]
    for flags in ((), ("--check-races=off",)):  # off is the default
        code, outputs, stderr = in_one_session(*flags, programs=programs)
        assert code == 0 and REPORT not in stderr, stderr[-3000:]
        assert outputs == ["result 1024.0", "result 1.0 0.0", "result 128.0", "result 4096.0"], outputs


def test_without_the_checker_an_async_collective_used_early_gives_the_right_answer():
    code, stdout, stderr = run(f"{RACES}/async_collective.py write", ranks=2)
    assert code == 0 and "result 2.0 expected 2.0" in stdout and REPORT not in stderr, stderr[-3000:]


def test_the_corrected_programs_report_nothing():
    code, outputs, stderr = in_one_session("--check-races", programs=[
        "cpu_read.py ordered", "cpu_read.py ordered cpu", "memory_reuse.py recorded", "side_stream.py ordered",
        "pinned_copy.py synchronized"])
    assert code == 0 and REPORT not in stderr, stderr[-3000:]
    assert [out.split()[0] for out in outputs] == ["result"] * 5, outputs


def test_a_program_that_catches_the_error_still_fails():
    program = ("import torch\n"
               "a = torch.ones(8, device='cuda')\n"
               "side = torch.cuda.Stream()\n"
               "try:\n"
               "    with torch.cuda.stream(side):\n"
               "        b = a * 2\n"
               "except RuntimeError:\n"
               "    print('caught')\n")
    result = mirage("run", "--quiet", "--check-races", "--", "python", "-c", program, timeout=300)
    assert result.returncode == 1 and result.stdout.strip() == "caught", result.stderr[-3000:]
    assert "exiting with status 1: a data race was reported above" in result.stderr


def test_warn_reports_and_goes_on():
    code, stdout, stderr = run("--check-races=warn", f"{RACES}/side_stream.py")
    assert code == 0 and stdout.strip() == "result 128.0", stderr[-3000:]
    assert len(reports(stderr)) == 1 and "RuntimeError" not in stderr


@pytest.mark.parametrize("misuse, line, issued_at", [
    ("write", 20, 18),  # its input written before work.wait()
    ("read", 23, 18),   # its output read before work.wait()
    ("functional", 29, 28),  # a functional collective's output read before wait_tensor
    ("ddp-hook", 38, 37),  # a DDP comm hook writing the bucket its all-reduce reads
])
def test_an_async_collectives_tensor_used_before_its_wait_is_reported_on_every_rank(misuse, line, issued_at):
    code, stdout, stderr = run("--check-races", f"{RACES}/async_collective.py {misuse}", ranks=2)
    assert code != 0, stderr[-3000:]
    found = reports(stderr)
    assert {re.search(r"on rank (\d)", r).group(1) for r in found} == {"0", "1"}, stderr[-3000:]
    for report in found:
        assert "(an async collective's tensor used before its wait)" in report
        assert "nccl:all_reduce" in report and "on the NCCL stream of process group" in report, report
        now_stack, earlier_stack = accesses(report)
        assert f'async_collective.py", line {line}' in now_stack, report
        assert f'async_collective.py", line {issued_at}' in earlier_stack, report


def test_an_async_collective_waited_for_reports_nothing_and_is_right():
    code, stdout, stderr = run("--check-races", f"{RACES}/async_collective.py ordered", ranks=2)
    assert code == 0 and "result 2.0 expected 2.0" in stdout and REPORT not in stderr, stderr[-3000:]


def test_an_unknown_mode_predict_only_and_a_plan_are_refused():
    result = mirage("run", "--check-races=sometimes", "--", "python", "-c", "pass")
    assert result.returncode == 2 and "invalid choice: 'sometimes' (choose from 'error', 'warn', 'off')" in result.stderr
    result = mirage("run", "--check-races", "--timing", "--predict-only", "--", "python", "-c", "pass")
    assert result.returncode == 2 and "--check-races with --predict-only" in result.stderr
    result = mirage("plan", "--axis", "x={1,2}", "--check-races", "--", "python", "-c", "pass")
    assert result.returncode == 2 and "--check-races is not for a plan" in result.stderr


def test_ddp_fsdp2_and_tensor_parallel_report_nothing():
    result = mirage("run", "--quiet", "--nproc-per-node", "4", "--gpus-per-node", "4", "--check-races", "--",
                    "python", "tests/workloads/parallelisms.py", timeout=600)
    assert result.returncode == 0 and "[0] parallelisms_ok" in result.stdout, result.stderr[-3000:]
    assert REPORT not in result.stderr


@pytest.mark.parametrize("tp, pp", [
    pytest.param(2, 2, id="tp2-pp2"),
    pytest.param(1, 2, id="pp2-dp2-distributed-optimizer", marks=pytest.mark.slow),
])
def test_megatron_core_with_tensor_and_pipeline_parallelism_reports_nothing(megatron_path, tp, pp):  # noqa: F811
    result = mirage("run", "--quiet", "--profile", "mi300x", "--nproc-per-node", "4", "--gpus-per-node", "4",
                    "--check-races", "--env", f"MEGATRON_TP={tp}", "--env", f"MEGATRON_PP={pp}", "--",
                    "python", "tests/workloads/megatron_gpt.py",
                    env={**os.environ, "PYTHONPATH": str(megatron_path)}, timeout=600)
    assert result.returncode == 0 and " losses " in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
    assert REPORT not in result.stderr


@pytest.fixture(scope="module")
def deepspeed_path() -> Path:
    """DeepSpeed and its pure-Python requirements in .venv-deepspeed/ (ignored by git), installed once:
    DeepSpeed itself without dependencies, as its requirements name torch (which must stay the CPU build)."""
    target = REPO / ".venv-deepspeed"
    if not (target / "deepspeed" / "__init__.py").exists():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(target)]
        subprocess.run([*pip, "hjson==3.1.0", "msgpack==1.2.4", "psutil==7.2.2", "py-cpuinfo==9.0.0",
                        "pydantic==2.14.4", "tqdm==4.70.1", "einops==0.8.2"], check=True, timeout=900)
        subprocess.run([*pip, "--no-deps", "deepspeed==0.19.8"], check=True, timeout=900)
    return target


def test_deepspeed_zero3_with_overlapped_communication_reports_nothing(deepspeed_path):
    result = mirage("run", "--quiet", "--gpus-per-node", "2", "--check-races", "--", "torchrun", "--standalone",
                    "--nproc_per_node=2", "tests/workloads/deepspeed_zero3.py",
                    env={**os.environ, "PYTHONPATH": str(deepspeed_path)}, timeout=600)
    assert result.returncode == 0 and REPORT not in result.stderr, result.stdout[-2000:] + result.stderr[-3000:]
    losses = [float(x) for x in result.stdout.split("zero3 losses ")[1].split()]
    assert len(losses) == 8 and losses[-1] < losses[0], losses


@pytest.mark.parametrize("flags", [
    # all slow (13 s each); the default suite's clean runs are the ones above
    pytest.param([], marks=pytest.mark.slow, id="fsdp"),
    pytest.param(["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
                 marks=pytest.mark.slow, id="tp"),
    pytest.param(["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], marks=pytest.mark.slow,
                 id="pp-interleaved"),
    pytest.param(["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"],
                 marks=pytest.mark.slow, id="cp"),
    pytest.param(["--activation_checkpoint.mode", "full"], marks=pytest.mark.slow, id="full-ac"),
    # (ops inside compiled graphs are not checked; the eager rest and the collectives are)
    pytest.param(["--compile.enable", "--activation_checkpoint.mode", "selective"], marks=pytest.mark.slow,
                 id="compile-selective-ac"),
])
def test_torchtitan_reports_nothing(assets, torchtitan_path, triton_path, flags, tmp_path):  # noqa: F811
    losses = train(assets, torchtitan_path, triton_path, 2, *flags, workdir=tmp_path,
                   mirage_flags=("--check-races",))
    assert sorted(losses) == list(range(1, STEPS + 1))
