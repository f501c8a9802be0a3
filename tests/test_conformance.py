"""PyTorch's own distributed suite (DistributedTest) against the emulated NCCL: a bounded subset
in every run; the whole suite (tens of minutes) with MIRAGE_CONFORMANCE=1, whose results
docs/conformance.md reports (tests/conformance/report.py writes it from the JSON)."""

import json
import os

import pytest

from conftest import mirage

# One or more tests of each kind of operation and of the NCCL-only surface.
SUBSET = ["test_all_reduce_sum_cuda", "test_broadcast_cuda", "test_reduce_sum_cuda", "test_all_gather_v_cuda",
          "test_all_gather_into_cat_tensor_cuda", "test_reduce_scatter_v_cuda", "test_reduce_scatter_tensor_cuda",
          "test_all_to_all_single_unequal_split_cuda", "test_gather_cuda", "test_scatter_cuda", "test_barrier_cuda",
          "test_send_recv_nccl", "test_batch_isend_irecv_nccl", "test_batch_isend_irecv_self_nccl",
          "test_nccl_backend_bool_allreduce", "test_nccl_high_priority_stream",
          "test_DistributedDataParallel_SyncBatchNorm", "test_ddp_profiling_torch_profiler",
          "test_ddp_grad_div_uneven_inputs"]


def run_suite(tmp_path, names, *options):
    results = tmp_path / "results.json"
    selection = [arg for name in names for arg in ("-k", name)]
    result = mirage("run", *options, "--gpus-per-node", "2", "--", "python", "tests/conformance/distributed_suite.py",
                    "--backend", "nccl", "--world-size", "2", "--json", str(results), *selection, timeout=1800)
    return result, json.loads(results.read_text())["tests"]


# The whole suite's documented allowance (docs/conformance.md): test_ddp_uneven_inputs may end in
# an error at the suite's own 400 s limit, set for GPU kernels; it passes given --timeout-scale 12.
ALLOWED_ERRORS = {"test_ddp_uneven_inputs"}
# docs/conformance.md, MI350X world size 2, default session: 143 passed and that one error.
DOCUMENTED_RAN = 144


def outcomes_other_than(tests: dict, *kinds: str) -> dict:
    return {name: t for name, t in tests.items() if t["outcome"] not in kinds}


# The same subset without the session daemon (--in-process) is the slow run's (3.5 minutes on CI's 2
# cores; MIRAGE_SLOW_TESTS=1), keeping the default suite near 20 minutes.
@pytest.mark.parametrize("mode", [pytest.param([], id="session"),
                                  pytest.param(["--in-process"], id="in-process", marks=pytest.mark.slow)])
def test_a_subset_of_pytorchs_distributed_suite_passes_on_emulated_nccl(tmp_path, mode):
    result, tests = run_suite(tmp_path, SUBSET, *mode)
    # -k selects by substring: a few neighbours (test_all_reduce_sum_cuda_async, ...) run too.
    assert outcomes_other_than(tests, "passed", "skipped") == {}, tests
    assert {name for name in SUBSET if tests.get(name, {}).get("outcome") == "passed"} == set(SUBSET), tests
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.skipif(os.environ.get("MIRAGE_CONFORMANCE") != "1", reason="the whole suite: MIRAGE_CONFORMANCE=1")
def test_the_whole_distributed_suite_has_only_the_documented_error(tmp_path):
    result, tests = run_suite(tmp_path, [])
    broken = outcomes_other_than(tests, "passed", "skipped")
    assert set(broken) <= ALLOWED_ERRORS and all(t["outcome"] == "error" for t in broken.values()), broken
    assert len(outcomes_other_than(tests, "skipped")) == DOCUMENTED_RAN, tests
