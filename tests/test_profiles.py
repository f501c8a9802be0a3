"""Device profiles: the shipped data, user files, validation, and the `mirage profiles` CLI."""

import json
import tomllib

import pytest

from conftest import mirage
from mirage import profiles

EXPECTED = {"mi300x", "mi325x", "mi350x", "mi355x", "mi250x", "h100", "h200", "a100", "b200", "h100-96gb"}


def test_every_shipped_profile_loads_with_design_figures():
    loaded = {p.name: p for p in profiles.load_all()}
    assert set(loaded) == EXPECTED
    assert loaded["mi350x"].torch_name == "AMD Instinct MI350X"
    assert loaded["mi350x"].arch == "gfx950" and loaded["mi350x"].compute_units == 256
    assert loaded["mi300x"].peak_tflops["bf16"] == 1307.4
    assert loaded["h100"].compute_capability == (9, 0) and loaded["h100"].vendor == "nvidia"
    assert loaded["b200"].link_bandwidth_gbs == 1800
    # torchtitan's Grand Teton H100: the h100's chip with 96 GB HBM2e at 2.4 TB/s and 500 W, its
    # bf16 peak between the SXM's and the NVL's datasheet figures
    grand_teton = loaded["h100-96gb"]
    assert (grand_teton.memory_bandwidth_gbs, grand_teton.board_power_watts) == (2400, 500)
    assert grand_teton.compute_units == loaded["h100"].compute_units
    assert 835.5 < grand_teton.peak_tflops["bf16"] < loaded["h100"].peak_tflops["bf16"]
    assert 95 < grand_teton.memory_bytes / 2**30 < 96
    assert all(p.gpus_per_node == 8 for p in loaded.values())
    # the L2 the runtime reports: torch's printouts on A100, H100 and H200, pytorch/ao#4002's B200
    # device query; HIP reports one XCD's (ROCm/legacy-rocm-build#4203)
    assert {name: loaded[name].l2_cache_bytes / 2**20 for name in ("a100", "h100", "h200", "b200", "mi300x")} \
        == {"a100": 40, "h100": 50, "h200": 60, "b200": 126.5, "mi300x": 4}
    assert all((p.shared_memory_per_block, p.warp_size) == ((65536, 64) if p.vendor == "amd" else (49152, 32))
               for p in loaded.values())


def test_user_profile_file_is_validated_naming_the_field(tmp_path):
    good = (profiles.DATA_DIR / "h100.toml").read_text()
    path = tmp_path / "mine.toml"
    path.write_text(good.replace('name = "h100"', 'name = "mine"'))
    assert profiles.load(str(path)).name == "mine"
    path.write_text(good.replace("compute_units = 132", 'compute_units = "lots"'))
    with pytest.raises(profiles.ProfileError, match="field 'compute_units'"):
        profiles.load(str(path))
    path.write_text(good.replace('vendor = "nvidia"', 'vendor = "intel"'))
    with pytest.raises(profiles.ProfileError, match="field 'vendor'"):
        profiles.load(str(path))
    path.write_text(good.replace("gpu_links = 18", "gpu_links = -1"))
    with pytest.raises(profiles.ProfileError, match="field 'gpu_links' is -1"):
        profiles.load(str(path))
    path.write_text("surprise = 1\n" + good)
    with pytest.raises(profiles.ProfileError, match="unknown field 'surprise'"):
        profiles.load(str(path))


def test_unknown_profile_lists_the_choices():
    with pytest.raises(profiles.ProfileError, match="unknown profile 'mi999'.*mi350x"):
        profiles.load("mi999")


def test_profiles_command_table_and_json():
    table = mirage("profiles")
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["PROFILE", "DEVICE", "ARCH"]
    assert any(line.startswith("mi350x (default)") for line in lines)
    assert len(lines) == 1 + len(EXPECTED)
    as_json = json.loads(mirage("profiles", "--json").stdout)
    assert {p["name"] for p in as_json} == EXPECTED
    one = json.loads(mirage("profiles", "show", "mi300x", "--json").stdout)
    assert one["memory_bytes"] == 205822885888
    shown = mirage("profiles", "show", "h200")
    assert "NVIDIA H200" in shown.stdout
    missing = mirage("profiles", "show", "nope")
    assert missing.returncode == 1 and "unknown profile 'nope'" in missing.stderr


def test_torch_reports_the_profiles_device_figures():
    """get_device_properties shows the profile's L2, shared memory per block and warp size (the
    L2 was 50 MiB on every NVIDIA profile until 2026-12-06; an A100 reports 40)."""
    script = ("import torch\np = torch.cuda.get_device_properties(0)\n"
              "print(p.L2_cache_size, p.shared_memory_per_block, p.warp_size)\nprint(p)\n")
    result = mirage("run", "--profile", "a100", "--gpus-per-node", "1", "--", "python", "-c", script)
    assert result.returncode == 0, result.stderr
    figures, shown = result.stdout.splitlines()[:2]
    assert figures == f"{40 * 2**20} 49152 32" and shown.endswith("L2_cache_size=40MB)")
    user = profiles.DATA_DIR / "a100.toml"  # a user's profile without the fields: the vendor's values
    assert profiles._check(user, {k: v for k, v in tomllib.loads(user.read_text()).items()
                                  if k not in ("l2_cache_bytes", "shared_memory_per_block", "warp_size")}) \
        .l2_cache_bytes == 50 * 2**20


def test_run_with_a_user_profile_file(tmp_path):
    path = tmp_path / "tiny.toml"
    text = (profiles.DATA_DIR / "mi300x.toml").read_text()
    path.write_text(text.replace('torch_name = "AMD Instinct MI300X"', 'torch_name = "Tiny GPU"')
                    .replace("memory_bytes = 205822885888", "memory_bytes = 1048576"))
    script = ("import torch\nprint(torch.cuda.get_device_name(0))\n"
              "try: torch.empty(2**21, dtype=torch.uint8, device='cuda')\n"
              "except torch.cuda.OutOfMemoryError: print('oom')\n")
    result = mirage("run", "--profile", str(path), "--gpus-per-node", "1", "--", "python", "-c", script)
    assert result.stdout.split("\n")[:2] == ["Tiny GPU", "oom"], result.stderr
