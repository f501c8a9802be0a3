"""DTensor's offset-based RNG over emulated GPUs (the path every TP or FSDP model that
initialises its weights after sharding takes, torchtitan's included): see
tests/workloads/dtensor_random.py."""

from conftest import mirage


def test_sharded_initialisation_equals_one_gpu():
    result = mirage("run", "--nproc-per-node", "4", "--gpus-per-node", "4", "--",
                    "python", "tests/workloads/dtensor_random.py", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in ("normal_", "uniform_", "trunc_normal_"):
        assert f"[0] ok {name} sharded over 4 equals one GPU" in result.stdout
