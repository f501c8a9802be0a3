"""FlexAttention on emulated GPUs (issue 38): the single-device checks (masks, score_mods, GQA,
dtypes, memory at sequence 8192, bad input), which run inside a session, and compiled
FlexAttention in distributed training."""

from conftest import mirage


def test_flex_attention_inside_an_emulated_session():
    """tests/emulated/test_flex_attention.py, in a session of its own (test_emulated_suite.py
    leaves it out: it takes minutes on 2 cores)."""
    result = mirage("run", "--gpus-per-node", "1", "--", "python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "tests/emulated/test_flex_attention.py", timeout=900)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_compiled_flex_attention_under_fsdp2_and_tensor_parallel_on_two_gpus():
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--",
                    "python", "tests/workloads/flex_parallel.py", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[0] ok fsdp2 with compiled blocks and compiled flex attention" in result.stdout
    assert "[0] ok tensor parallel over heads with compiled flex attention: output and gradients equal" in result.stdout
    assert "[0] flex_parallel_ok" in result.stdout
