"""Compiled FlexAttention in distributed training on emulated GPUs (issue 38). The single-device
checks (masks, score_mods, GQA, dtypes, memory, bad input) run inside a session, in
tests/emulated/test_flex_attention.py."""

from conftest import mirage


def test_compiled_flex_attention_under_fsdp2_and_tensor_parallel_on_two_gpus():
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--",
                    "python", "tests/workloads/flex_parallel.py", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[0] ok fsdp2 with compiled blocks and compiled flex attention" in result.stdout
    assert "[0] ok tensor parallel over heads with compiled flex attention: output and gradients equal" in result.stdout
    assert "[0] flex_parallel_ok" in result.stdout
