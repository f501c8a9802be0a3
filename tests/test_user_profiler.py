"""The user's own torch.profiler under mirage (issue 39): a training step profiled with
ProfilerActivity CPU and CUDA, with_stack=True and record_function nesting
(tests/workloads/user_profiler.py) shows nothing of mirage, with or without clocked mode:
no mirage:: operator and no frame of mirage's Python code in key_averages() or in the exported
Chrome trace, and none of the CPU build's "Failed to record CUDA event" warnings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# relative to ROOT (the working directory): frames name it so, whatever the checkout is called
WORKLOAD = "tests/workloads/user_profiler.py"

def mirages_in(names: list[str]) -> list[str]:
    """The names that show mirage (its operators, its Python files)."""
    return [name for name in names if "mirage" in name.lower()]


@pytest.mark.parametrize("timing", [False, True], ids=["host-times", "clocked"])
def test_the_users_profile_shows_nothing_of_mirage(tmp_path: Path, timing: bool) -> None:
    trace = tmp_path / "trace.json"
    result = subprocess.run(
        [sys.executable, "-m", "mirage", "run", "--gpus-per-node", "1", *(["--timing"] if timing else []), "--",
         "python", WORKLOAD, str(trace)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Failed to record CUDA event" not in result.stderr
    table = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    # the profile is there: the step's ops, the record_function ranges, the Python frames
    assert {"aten::mm", "aten::addmm", "train_step", "matmul", "attention"} <= set(table["keys"])
    assert any(key.startswith(WORKLOAD) for key in table["keys"])
    assert mirages_in(table["keys"]) == []
    # Python frames are checked in the trace's python_function events below: torch 2.13's
    # key_averages(group_by_stack_n=...) gives empty stacks in this mode, so a check there checks nothing
    events = json.loads(trace.read_text())["traceEvents"]
    assert {"cpu_op", "python_function", "user_annotation"} <= {event.get("cat") for event in events}
    named = [event["name"] for event in events if "name" in event]
    assert mirages_in(named) == []
    strings = [value for event in events for value in event.get("args", {}).values() if isinstance(value, str)]
    assert mirages_in(strings) == []


DEVICE_TIME = """
import torch
from torch.profiler import profile, ProfilerActivity
a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    for _ in range(3):
        b = a @ a
    torch.cuda.synchronize()
mm = [e for e in p.key_averages() if e.key == "aten::mm"][0]
print(mm.count, mm.device_time_total, torch.ops.mirage.clock_predict_gemm_ns(1024, 1024, 1024, torch.bfloat16))
"""


def test_cuda_time_in_key_averages_is_the_predicted_kernel_time_in_clocked_mode() -> None:
    """ProfilerActivity.CUDA gives each op the time of the kernels it launched, which the shim's
    Kineto plugin (mirage/shim/profiler_activities.cpp) reports as CUPTI would; under --timing
    those are the predicted kernels, so an op's CUDA time is its predicted kernel time, to the
    nanosecond, as the profile's cost model gives it."""
    result = subprocess.run(
        [sys.executable, "-m", "mirage", "run", "--timing", "--profile", "h100", "--gpus-per-node", "1", "--",
         "python", "-c", DEVICE_TIME], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    count, device_us, predicted_ns = result.stdout.split()[-3:]
    assert int(count) == 3
    assert float(device_us) * 1000 == pytest.approx(3 * int(predicted_ns), abs=1)


COPIES = """
import json, torch
from torch.profiler import profile, ProfilerActivity
a = torch.randn(256, 256, device="cuda")
b = torch.empty_like(a)
with profile(activities=[ProfilerActivity.CUDA]) as p:
    b.copy_(a)
    c = a.to(torch.bfloat16)
    b.copy_(a.t())
    torch.cuda.synchronize()
print(json.dumps([e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]))
"""


@pytest.mark.parametrize("timing", [False, True], ids=["host-times", "clocked"])
def test_a_copy_is_a_memcpy_only_where_cuda_makes_it_one(timing: bool) -> None:
    """CUDA's copy_ within a device is a cudaMemcpyAsync where both tensors have one dtype and one
    dense layout, and ATen's direct copy kernel otherwise: a conversion (`.to(torch.bfloat16)`,
    RMSNorm's `.float()`) or a strided copy is a kernel in the profile, as on a CUDA build (and,
    clocked, a kernel that hides communication beside it, which a memcpy does not)."""
    profile = ["--timing", "--profile", "h100"] if timing else []
    result = subprocess.run(
        [sys.executable, "-m", "mirage", "run", *profile, "--gpus-per-node", "1", "--", "python", "-c", COPIES],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    same, conversion, strided = json.loads(result.stdout.splitlines()[-1])
    assert same == "Memcpy DtoD (Device -> Device)"
    for name in (conversion, strided):
        assert not name.startswith("Memcpy") and "copy" in name, name


GPU_PROFILE = "tests/workloads/gpu_profile.py"


def kernel_rows(events: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """The trace's GPU activities (kernels and memcpys) by (device, stream) row, in time order."""
    rows: dict[tuple[int, int], list[dict]] = {}
    for event in events:
        if event.get("cat") in ("kernel", "gpu_memcpy"):
            rows.setdefault((event["pid"], event["tid"]), []).append(event)
    return {row: sorted(activities, key=lambda e: e["ts"]) for row, activities in rows.items()}


@pytest.mark.parametrize("timing", [False, True], ids=["host-times", "clocked"])
def test_the_trace_has_a_gpu_side_as_on_a_cuda_build(tmp_path: Path, timing: bool) -> None:
    """Two ranks of a DDP step with attention under torch.profiler(activities=[CPU, CUDA],
    profile_memory=True): ProfilerActivity.CUDA is supported, and each rank's exported trace has
    what CUPTI gives a CUDA build's: kernels and memcpys on the device's stream rows, named as the
    profiled GPU's libraries name them, each linked to the CPU op that launched it (External id)
    and to its launch (a cuda_runtime event on the op's thread, joined by an ac2g flow); NCCL's
    all_reduce on a stream of its own, a send and its receive; allocations and frees of device
    memory. Clocked: the
    kernels and their launches are the predicted ones (a GEMM's duration is the cost model's, a
    kernel starts after its launch, a stream runs one kernel at a time), on one time axis for
    all ranks (their all_reduce starts at the same time on both)."""
    profile = ["--timing", "--profile", "h100"] if timing else []  # host times on the default MI350X
    result = subprocess.run(
        [sys.executable, "-m", "mirage", "run", *profile, "--gpus-per-node", "2", "--", "torchrun", "--standalone",
         "--nproc_per_node=2", GPU_PROFILE, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.report.json"))]
    assert len(reports) == 2
    all_reduce_starts = []
    for report in reports:
        rank = report["rank"]
        assert "ProfilerActivity.CUDA" in report["supported"]
        assert report["mm_count"] == 2 and report["mm_device_us"] > 0 and report["loss_is_finite"]
        trace = json.loads((tmp_path / f"rank{rank}.json").read_text())
        events = trace["traceEvents"]
        assert trace["mirage_device_time"].startswith("predicted" if timing else "host")
        assert {"kernel", "gpu_memcpy", "cuda_runtime", "ac2g"} <= {event.get("cat") for event in events}
        rows = kernel_rows(events)
        activities = [activity for row in rows.values() for activity in row]
        assert {pid for pid, _ in rows} == {rank}  # each rank's GPU, cuda:LOCAL_RANK
        # each activity: launched by a CPU op of this trace, from a cuda_runtime event of its own
        cpu_ops = {event["args"]["External id"] for event in events if event.get("cat") == "cpu_op"}
        launches = {event["args"]["correlation"]: event for event in events if event.get("cat") == "cuda_runtime"}
        flow_starts = {event["id"] for event in events if event.get("cat") == "ac2g" and event["ph"] == "s"}
        flow_ends = {event["id"] for event in events if event.get("cat") == "ac2g" and event["ph"] == "f"}
        for activity in activities:
            args = activity["args"]
            assert args["External id"] in cpu_ops, activity
            assert launches[args["correlation"]]["args"]["External id"] == args["External id"]
            assert args["correlation"] in flow_starts and args["correlation"] in flow_ends
        names = [activity["name"] for activity in activities]
        # cuBLAS's bf16 kernel on an H100, hipBLASLt's (Tensile's BBS: bf16 in and out) on an MI350X
        gemm = "sm90_xmma_gemm_bf16bf16" if timing else "Cijk_Alik_Bljk_BBS"
        assert sum(name.startswith(gemm) for name in names) == 2
        assert "Memcpy DtoH (Device -> Pageable)" in names  # loss.cpu()
        collectives = [a for a in activities if a["name"].startswith("ncclDevKernel_AllReduce_Sum_bf16")]
        assert len(collectives) == 1 and collectives[0]["tid"] != 7  # DDP's bucket, on NCCL's stream
        # the send and its receive (completed on the communicator's worker thread: still the
        # CPU op that posted it, checked with every activity above)
        assert sum(name.startswith("ncclDevKernel_SendRecv") for name in names) == 1
        all_reduce_starts.append(collectives[0]["ts"])
        memory = [e["args"] for e in events if e.get("name") == "[memory]" and e["args"]["Device Type"] == 1]
        assert any(m["Bytes"] > 0 for m in memory) and any(m["Bytes"] < 0 for m in memory)
        assert {m["Device Id"] for m in memory} == {rank}
        # the CPU memory a GPU box's step allocates: the loss copied to the host, scalars; not the
        # CPU kernels' results and scratch that stand for device kernels here (the smallest
        # device tensor of the step is 64 KiB)
        host = [e["args"]["Bytes"] for e in events if e.get("name") == "[memory]" and e["args"]["Device Type"] == 0]
        assert all(abs(size) <= 8 for size in host), host
        # fused attention, one kernel each way (without --timing too: its ATen ops are not listed)
        forward, backward = (("void pytorch_flash::flash_fwd_kernel", "void pytorch_flash::flash_bwd") if timing
                             else ("attn_fwd", "bwd_kernel_dk_dv"))  # FlashAttention-2 on CUDA, AOTriton on ROCm
        assert sum(name.startswith(forward) for name in names) == 1
        assert sum(name.startswith(backward) for name in names) == 1
        assert not any("scaled_dot_product" in name or "aten::bmm" in name for name in names)
        if timing:
            durations_ns = {round(a["dur"] * 1000) for a in activities if a["name"].startswith(gemm)}
            assert report["gemm_predicted_ns"] in durations_ns
            for row in rows.values():
                for before, after in zip(row, row[1:]):
                    assert before["ts"] + before["dur"] <= after["ts"] + 1e-3, (before, after)
            for activity in activities:  # launched by the predicted host before it starts
                assert launches[activity["args"]["correlation"]]["ts"] <= activity["ts"] + 1e-3
    if timing:  # the ranks' GPU sides on one time axis: the all_reduce starts on both at once
        assert all_reduce_starts[0] == pytest.approx(all_reduce_starts[1], abs=1e-3)


# 45 s and the trace tools' own environment: MIRAGE_SLOW_TESTS=1 (docs/benchmarks.md, "The default suite");
# the default suite checks the traces' GPU side (test_the_trace_has_a_gpu_side_as_on_a_cuda_build)
@pytest.mark.slow
def test_hta_and_tensorboard_read_the_predicted_traces_of_an_fsdp_job(tmp_path: Path) -> None:
    """Four FSDP2 ranks on emulated H100s, one step recorded per rank as torchtitan's profiling
    flags record it (tests/workloads/fsdp_profile.py): HTA, unchanged, runs its temporal
    breakdown, its communication/computation overlap and its kernel breakdown on the traces, and
    its overlap is mirage's own for that step (1 - exposed / collective time, from the clocked
    report's split) to HTA's two decimals (HTA reading the traces at their nanosecond
    resolution, tests/trace_tools.py); TensorBoard's profiler plugin offers its kernel
    view for each worker (it offers none for a trace without a GPU side)."""
    from trace_tools import analyse, tensorboard_views

    result = subprocess.run(
        [sys.executable, "-m", "mirage", "run", "--timing", "--profile", "h100", "--gpus-per-node", "4", "--",
         "torchrun", "--standalone", "--nproc_per_node=4", "tests/workloads/fsdp_profile.py", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = {}
    for path in tmp_path.glob("rank*.step.json"):
        step = json.loads(path.read_text())
        steps[step["rank"]] = step
        path.unlink()  # HTA reads every JSON file of the folder as a trace
    assert sorted(steps) == [0, 1, 2, 3]
    hta = analyse(tmp_path)
    overlap = {row["rank"]: row["comp_comm_overlap_pctg"] for row in hta["overlap"]}
    assert sorted(overlap) == [0, 1, 2, 3]
    for rank, step in steps.items():
        assert 0 < step["exposed_ns"] < step["collective_ns"]  # overlapped in part: the check can fail both ways
        assert overlap[rank] == pytest.approx(100 * (1 - step["exposed_ns"] / step["collective_ns"]), abs=0.01)
    kinds = {row["kernel_type"] for row in hta["kernel_types"]}
    assert {"COMPUTATION", "COMMUNICATION", "MEMORY"} <= kinds
    assert any(name.startswith("ncclDevKernel_AllGather") for name in hta["kernel_names"])
    assert any(name.startswith("ncclDevKernel_ReduceScatter") for name in hta["kernel_names"])
    assert {row["rank"] for row in hta["temporal"]} == {0, 1, 2, 3}
    assert all(row["compute_time(us)"] > 0 for row in hta["temporal"])
    tensorboard = tmp_path / "tensorboard"
    tensorboard.mkdir()
    for rank in range(4):  # the names torch.profiler.tensorboard_trace_handler gives its files
        shutil.copy(tmp_path / f"rank{rank}.json", tensorboard / f"worker{rank}.pt.trace.json")
    (tmp_path / "tensorboard-cache").mkdir()
    views = tensorboard_views(tensorboard, tmp_path / "tensorboard-cache")
    assert sorted(views) == [f"worker{rank}" for rank in range(4)]
    for worker in views.values():
        assert "Kernel" in worker["views"] and worker["has_kernel"]
        assert any(name.startswith("ncclDevKernel_AllGather") for name in worker["kernels"])
