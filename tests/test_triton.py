"""With the triton package installed, as on every GPU box (torchtitan and many libraries need it):
torch.compile works on every profile, and Triton's driver answers for the emulated GPU.

Triton is a 285 MB wheel that the rest of the suite does not need: conftest's `triton_path`
installs it once into a folder of its own that these tests put on the workload's PYTHONPATH.
"""

from __future__ import annotations

import os

import pytest

from conftest import mirage
from mirage import profiles

SCRIPT = """
import torch, triton, triton.language as tl
from triton.runtime.driver import driver

compiled = torch.compile(lambda x: x * 2 + 1)(torch.arange(4.0, device="cuda"))
print("compiled", compiled.tolist())

@triton.jit
def twice_plus_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2 + 1, mask=i < n)

x = torch.arange(10.0, device="cuda")
y = torch.empty_like(x)
twice_plus_one[(1,)](x, y, 10, BLOCK=16)
print("kernel", torch.equal(y, x * 2 + 1))
target = driver.active.get_current_target()
print("target", target.backend, target.arch, target.warp_size)
props = driver.active.utils.get_device_properties(torch.cuda.current_device())
print("sms", props["multiprocessor_count"], torch.cuda.get_device_properties(0).multi_processor_count)
print("dram_gbps", round(triton.testing.get_dram_gbps()))
"""


@pytest.mark.parametrize("profile, target", [("h100", "cuda 90 32"), ("mi350x", "hip gfx950 64")])
def test_compile_and_triton_driver_on_every_vendor(triton_path, tmp_path, profile, target):
    """Before the emulated driver: AssertionError "libcuda.so cannot found" (h100, in inductor's
    cache key and the driver) and RuntimeError "cannot locate libamdhip64.so" (mi350x, driver)."""
    script = tmp_path / "triton_check.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(triton_path)}
    result = mirage("run", "--quiet", "--profile", profile, "--", "python", str(script), env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["compiled"] == "[1.0, 3.0, 5.0, 7.0]"
    assert lines["kernel"] == "True"
    assert lines["target"] == target
    sms, torch_sms = lines["sms"].split()
    assert sms == torch_sms
    # the profile's memory bandwidth, through Triton's own formula (clock x bus width)
    assert lines["dram_gbps"] == f"{profiles.load(profile).memory_bandwidth_gbs:g}"
