"""Unmodified torchtitan 0.2.2 (the release built for torch 2.13) trains its Llama 3 debug model on
emulated GPUs: FSDP, TP, PP, CP, activation checkpointing, torch.compile, checkpoint resume.

torchtitan, triton (which it imports) and the tokenizer and dataset its runs read are made by
tests/torchtitan_setup.py. Every option is a command-line flag of torchtitan's own; the runs
differ from its debug_model.toml in steps, sequence length and batch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torchtitan_setup
from conftest import mirage

STEPS = 8
BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def torchtitan_path() -> Path:
    return torchtitan_setup.install_torchtitan()


@pytest.fixture(scope="module")
def assets(tmp_path_factory, torchtitan_path) -> Path:
    """tokenizer/ (tokenizer.json, tokenizer_config.json) and c4_test/data.json."""
    return torchtitan_setup.make_assets(tmp_path_factory.mktemp("torchtitan_assets"), torchtitan_path)


def train(assets: Path, torchtitan_path: Path, triton_path: Path, gpus: int, *flags: str,
          steps: int = STEPS, workdir: Path | None = None, mirage_flags: tuple[str, ...] = ()) -> dict[int, float]:
    """`torchrun -m torchtitan.train` under mirage (with `mirage_flags`); the loss of each step, from
    torchtitan's own line."""
    command = ["torchrun", "--standalone", f"--nproc_per_node={gpus}", "-m", "torchtitan.train",
               "--model.name", "llama3", "--model.flavor", "debugmodel",
               *torchtitan_setup.data_flags(assets),
               "--training.steps", str(steps), "--training.seq_len", "512", "--training.local_batch_size", "2",
               "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "2e-3", "--metrics.log_freq", "1", "--metrics.disable_color_printing",
               "--job.dump_folder", str(workdir or assets / "outputs"), *flags]
    env = {**os.environ, "PYTHONPATH": f"{torchtitan_path}:{triton_path}"}
    result = mirage("run", "--quiet", "--profile", "h100", "--gpus-per-node", str(gpus), *mirage_flags, "--", *command,
                    env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    losses = {int(step): float(loss) for step, loss in
              re.findall(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", result.stdout + result.stderr)}
    assert losses, result.stderr[-3000:]
    return losses


SLOW = pytest.mark.slow  # about 25 s each on 2 cores; MIRAGE_SLOW_TESTS=1 runs them (README says so)


@pytest.mark.parametrize("flags", [
    pytest.param([], id="fsdp"),  # over both GPUs: the debug model's default
    pytest.param(["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
                 marks=SLOW, id="tp"),
    pytest.param(["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], marks=SLOW, id="pp-interleaved"),
    pytest.param(["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"],
                 marks=SLOW, id="cp"),
    # about 55 s: slow; compiled activation checkpointing's recomputation is in the default suite
    # as tests/emulated/test_compile.py::test_compiled_activation_checkpointing_replays_the_generator_around_attention
    pytest.param(["--compile.enable", "--activation_checkpoint.mode", "selective"], marks=SLOW,
                 id="compile-selective-ac"),
    pytest.param(["--activation_checkpoint.mode", "full"], marks=SLOW, id="full-ac"),
])
def test_the_debug_model_trains(assets, torchtitan_path, triton_path, flags, tmp_path):
    losses = train(assets, torchtitan_path, triton_path, 2, *flags, workdir=tmp_path)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[STEPS] < losses[1] - 0.5, losses  # it learns (with --optimizer.lr 0 it does not)


def test_torchtitans_profiling_flags_write_each_ranks_gpu_side(assets, torchtitan_path, triton_path, tmp_path):
    """torchtitan's --profiling flags (torch.profiler with CPU and CUDA activity, a trace per rank
    every profile_freq steps) write traces with the GPU side a CUDA build's have: FSDP's
    all-gathers and reduce-scatters on NCCL's stream, cuBLAS's GEMMs, each kernel linked to its
    CPU op (issue 39)."""
    train(assets, torchtitan_path, triton_path, 2, "--profiling.enable_profiling", "--profiling.profile_freq", "4",
          "--profiling.profiler_warmup", "1", workdir=tmp_path)
    for rank in (0, 1):
        trace = json.loads((tmp_path / "profile_traces" / "iteration_4" / f"rank{rank}_trace.json").read_text())
        events = trace["traceEvents"]
        kernels = [e for e in events if e.get("cat") == "kernel"]
        names = {e["name"] for e in kernels}
        assert {e["pid"] for e in kernels} == {rank}
        assert any(name.startswith("ncclDevKernel_AllGather") for name in names)
        assert any(name.startswith("ncclDevKernel_ReduceScatter") for name in names)
        assert any(name.startswith("sm90_xmma_gemm") for name in names)  # the runs' profile is an H100
        cpu_ops = {e["args"]["External id"] for e in events if e.get("cat") == "cpu_op"}
        assert all(e["args"]["External id"] in cpu_ops for e in kernels)


def test_a_checkpoint_resumes(assets, torchtitan_path, triton_path, tmp_path):
    """Eight steps saving at 4 and 8, then a second job that loads step 8 and trains 9 and 10."""
    checkpoint = ["--checkpoint.enable", "--checkpoint.interval", "4", "--checkpoint.no_last_save_model_only"]
    first = train(assets, torchtitan_path, triton_path, 2, *checkpoint, workdir=tmp_path)
    assert (tmp_path / "checkpoint" / f"step-{STEPS}").is_dir()
    resumed = train(assets, torchtitan_path, triton_path, 2, *checkpoint, steps=STEPS + 2, workdir=tmp_path)
    assert sorted(resumed) == [STEPS + 1, STEPS + 2] and resumed[STEPS + 1] < first[1] - 0.5


def test_llama3_8b_on_eight_gpus_is_predicted_and_torchtitan_prints_the_prediction(assets, torchtitan_path,
                                                                                    triton_path, tmp_path):
    """torchtitan's own Llama 3.1 8B, as its published 8-GPU FSDP row ran it (8k tokens x 2 a rank,
    selective activation checkpointing), on 8 emulated H100-96GB: clocked, --predict-only, with
    no data, so it runs here (docs/benchmarks.md: ~40 s, ~2 GiB of host memory). torchtitan's
    own metrics line prints mirage's prediction (its tps is tokens over the predicted step time),
    and the memory it reads holds at least the sharded training state (fp32 parameter, gradient
    and two Adam moments: 16 bytes a parameter over 8 ranks) without running out of the GPU's."""
    summary = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": f"{torchtitan_path}:{triton_path}"}
    result = mirage("run", "--quiet", "--timing", "--predict-only", "--virtual-clock", "--lazy-device-memory",
                    "--profile", "h100-96gb", "--gpus-per-node", "8", "--summary-json", str(summary), "--",
                    "torchrun", "--standalone", "--nproc_per_node=8", "-m", "torchtitan.train",
                    "--model.name", "llama3", "--model.flavor", "8B", *torchtitan_setup.data_flags(assets),
                    "--training.local_batch_size", "2", "--training.seq_len", "8192", "--training.steps", "3",
                    "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op",
                    "--metrics.log_freq", "1", "--metrics.disable_color_printing", "--job.dump_folder", str(tmp_path),
                    env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    output = result.stdout + result.stderr
    parameters = int(re.search(r"Model llama3 8B size: ([0-9,]+) total parameters", output)[1].replace(",", ""))
    last = [line for line in output.splitlines() if re.search(r"step:\s+3\s", line)]
    assert len(last) == 8, output[-3000:]  # every rank's line
    tps = {int(re.search(r"tps: ([0-9,]+)", line)[1].replace(",", "")) for line in last}
    memory = {float(re.search(r"memory:\s+([0-9.]+)GiB", line)[1]) for line in last}
    step_s = json.loads(summary.read_text())["timing"]["job"]["step_ms"] / 1e3
    assert all(abs(value - 2 * 8192 / step_s) <= 0.01 * value for value in tps), (tps, step_s)
    assert all(16 * parameters / 8 / 2**30 < gib < 96 for gib in memory), (memory, parameters)


def test_torchtitan_of_2024_repeats_grouped_query_heads_before_attention(monkeypatch):
    """bench/torchtitan2024.py, which runs the published rows as torchtitan of 2024 ran them, gives
    SDPA keys and values repeated to the query heads (torchtitan's repeat_kv of then: a copy on the
    (batch, seq, heads, dim) layout) where grouped-query attention is asked for, with the results
    and gradients grouped-query attention gives; equal heads pass through untouched."""
    import torch
    monkeypatch.syspath_prepend(str(BENCH))
    import torchtitan2024

    seen, sdpa = [], torchtitan2024.SDPA

    def recorded_sdpa(query, key, value, *args, **kwargs):
        seen.append((key.shape, key.untyped_storage().data_ptr()))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torchtitan2024, "SDPA", recorded_sdpa)
    torch.manual_seed(0)
    layouts = [torch.randn(1, 16, heads, 4, dtype=torch.double, requires_grad=True) for heads in (8, 2, 2)]
    q, k, v = (t.transpose(1, 2) for t in layouts)  # (batch, heads, seq, dim) views, as torchtitan passes them
    out = torchtitan2024.sdpa_with_kv_repeated(q, k, v, is_causal=True, enable_gqa=True)
    assert seen[0][0] == (1, 8, 16, 4) and seen[0][1] != k.untyped_storage().data_ptr()
    grads = torch.autograd.grad(out.sum(), layouts)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(out, expected)
    assert all(torch.allclose(a, b) for a, b in zip(grads, torch.autograd.grad(expected.sum(), layouts)))
    torchtitan2024.sdpa_with_kv_repeated(q, q, q, is_causal=True, enable_gqa=False)
    assert seen[1][0] == (1, 8, 16, 4) and seen[1][1] == q.untyped_storage().data_ptr()


def test_torchtitan_of_2024_sets_functions_a_compiled_trainer_can_trace(tmp_path):
    """bench/torchtitan2024.py runs the trainer as __main__; the functions it sets (2024's norm and
    attention) must still be traceable by torch.compile, which reads their globals through their
    module's name (E14 and E17 compile torchtitan's blocks)."""
    trainer = tmp_path / "trainer.py"
    trainer.write_text(
        "import torch, torch.nn.functional as F\n"
        "q, k, v = torch.randn(1, 8, 16, 4), torch.randn(1, 2, 16, 4), torch.randn(1, 2, 16, 4)\n"
        "def attend(q, k, v):\n"
        "    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)\n"
        "def norm(x):\n"
        "    return F.rms_norm(x, [4], torch.ones(4))\n"
        "print(torch.allclose(torch.compile(attend)(q, k, v), attend(q, k, v), atol=1e-5),\n"
        "      torch.allclose(torch.compile(norm)(q), norm(q)))\n")
    result = subprocess.run([sys.executable, str(BENCH / "torchtitan2024.py"), "--norm", "rmsnorm", str(trainer)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.split() == ["True", "True"], result.stdout + result.stderr[-3000:]
