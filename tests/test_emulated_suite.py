"""Runs tests/emulated inside `mirage run --gpus-per-node 4`: the torch.cuda API as a GPU
script sees it. Each inner test is listed in this test's output."""

from conftest import mirage


def test_torch_cuda_api_inside_an_emulated_session():
    # FlexAttention's file takes minutes (compiles, and sequence 8192): tests/test_flex_attention.py
    # runs it in a session of its own
    result = mirage("run", "--gpus-per-node", "4", "--", "python", "-m", "pytest", "-q", "-p",
                    "no:cacheprovider", "--ignore", "tests/emulated/test_flex_attention.py", "tests/emulated")
    print(result.stdout[-5000:], result.stderr[-3000:])
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_nvidia_profile_presents_a_cuda_build():
    script = ("import torch; p = torch.cuda.get_device_properties(0); "
              "print(torch.version.cuda, torch.version.hip, p.name, p.major, p.minor, "
              "torch.cuda.device_count(), torch.__version__.split('+')[1])")
    result = mirage("run", "--profile", "h100", "--gpus-per-node", "2", "--", "python", "-c", script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["12.8", "None", "NVIDIA", "H100", "80GB", "HBM3", "9", "0", "2", "cu128"]


def test_out_of_memory_names_cuda_on_nvidia_profiles():
    script = ("import torch\n"
              "try: torch.empty(2**40, dtype=torch.uint8, device='cuda')\n"
              "except torch.cuda.OutOfMemoryError as e: print(str(e).split('.')[0])\n")
    result = mirage("run", "--profile", "a100", "--gpus-per-node", "1", "--", "python", "-c", script)
    assert result.stdout.strip() == "CUDA out of memory"


def test_rng_state_calls_work_as_the_first_cuda_call_of_a_process():
    """A resume script restores RNG states before it touches a tensor."""
    script = ("import torch\nstate = torch.cuda.get_rng_state()\n"
              "torch.cuda.set_rng_state_all([state] * torch.cuda.device_count())\n"
              "with torch.random.fork_rng(devices=[1]):\n    torch.cuda.manual_seed_all(3)\n"
              "print('restored', state.dtype, torch.cuda.is_initialized())\n")
    result = mirage("run", "--gpus-per-node", "2", "--", "python", "-c", script)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "restored torch.uint8 True"
