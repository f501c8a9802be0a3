"""The vendor's smi tools (nvidia-smi; rocm-smi and amd-smi) inside a session (mirage/runtime/smi_commands.py): a workload that holds
1 GiB on cuda:1 runs them (tests/workloads/smi_probe.py), and what they print must be the session's
GPUs, memory and processes, in the tools' formats; torch's own readers of nvidia-smi (collect_env,
common_cuda's green-context gate) must read it, and green contexts must then work."""

import functools
import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO, mirage

from mirage import profiles

MIB = 2**20
HELD = 2**30  # what smi_probe.py holds on cuda:1


@functools.cache  # one session per profile for the tests that read its report
def probe(profile: str) -> dict:
    result = mirage("run", "--quiet", "--profile", profile, "--gpus-per-node", "2", "--", "python",
                    "tests/workloads/smi_probe.py", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_nvidia_smi_reports_the_sessions_gpus_memory_and_processes():
    h100 = profiles.load("h100")
    report = probe("h100")
    assert report["which"]["rocm-smi"] is None and report["which"]["amd-smi"] is None
    assert report["which"]["nvidia-smi"].endswith("smi_bin/nvidia/nvidia-smi")
    used = (HELD + h100.context_bytes) // MIB  # the allocation and the process's GPU context
    table = report["table"]["out"]
    assert report["table"]["rc"] == 0 and "Driver Version: 570.172.08     CUDA Version: 12.8" in table
    assert f"|       0MiB / {h100.memory_bytes // MIB:>6}MiB |" in table
    assert f"|{used:>8}MiB / {h100.memory_bytes // MIB:>6}MiB |" in table
    assert f"|    1   N/A  N/A {report['pid']:>15}      C   python" in table and f"{used}MiB |" in table
    assert {len(line) for line in table.splitlines()[1:] if line.strip()} == {91}, "a row out of the table's width"
    assert report["list"]["out"].splitlines() == [f"GPU {i}: {h100.torch_name} (UUID: GPU-{uuid})"
                                                  for i, uuid in enumerate(report["uuids"])]
    rows = [line.split(", ") for line in report["query"]["out"].splitlines()]
    total = h100.memory_bytes // MIB
    assert rows == [["0", h100.torch_name, str(total), "0", str(total), "00000000:01:00.0"],
                    ["1", h100.torch_name, str(total), str(used), str(total - used), "00000000:02:00.0"]]
    header, values = report["query_units"]["out"].splitlines()
    assert header == "memory.used [MiB], utilization.gpu [%], power.draw [W]"
    assert values.startswith(f"{used} MiB, ") and values.endswith(" W")
    assert report["apps"]["out"].strip() == f"{report['pid']}, {used} MiB, 00000000:02:00.0"
    assert "GPU0\t X \tNV18" in report["topology"]["out"] and "NV#  = Connection traversing" in report["topology"]["out"]
    assert report["driver"] == "570.172.08" and report["green_context_gate"] is True
    assert report["version"]["out"].splitlines() == ["NVIDIA-SMI version  : 570.172.08", "NVML version        : 570.172",
                                                     "DRIVER version      : 570.172.08", "CUDA Version        : 12.8"]


def test_nvidia_smi_refuses_what_it_does_not_emulate_as_the_tool_does():
    report = probe("h100")
    assert report["unknown_option"]["rc"] == 2 and "not -q" in report["unknown_option"]["err"]
    assert "--query-gpu=FIELDS" in report["unknown_option"]["err"]
    assert (report["unknown_field"]["rc"], report["unknown_field"]["out"].strip()) == \
        (2, 'Field "bogus" is not a valid field to query.')
    assert (report["missing_gpu"]["rc"], report["missing_gpu"]["out"].strip()) == (6, "No devices were found")
    # -l 1 until `timeout` stops it after 4.5 s (rows to spare on a slow machine): the header once
    looped = report["loop"]["out"].splitlines()
    assert report["loop"]["rc"] == 124 and looped[0] == "index" and len(looped) >= 3 and set(looped[1:]) == {"0"}


def test_rocm_smi_on_an_amd_profile():
    mi350x = profiles.load("mi350x")
    report = probe("mi350x")
    assert report["which"]["nvidia-smi"] is None and report["which"]["rocm-smi"].endswith("smi_bin/amd/rocm-smi")
    assert report["which"]["amd-smi"].endswith("smi_bin/amd/amd-smi")
    concise = report["concise"]["out"].splitlines()
    assert concise[0] == " ROCm System Management Interface ".center(122, "=") and concise[1].count("Concise Info")
    gpu_rows = [line.split() for line in concise if line[:1].isdigit()]
    assert [row[0] for row in gpu_rows] == ["0", "1"]
    assert all(row[2] == f"0x{mi350x.pci_product_id:x}," for row in gpu_rows)
    memory = json.loads(report["memory"]["out"])
    assert memory["card0"]["VRAM Total Used Memory (B)"] == "0"
    assert int(memory["card1"]["VRAM Total Used Memory (B)"]) == HELD + mi350x.context_bytes
    assert int(memory["card1"]["VRAM Total Memory (B)"]) == mi350x.memory_bytes
    assert f"GPU[1]\t\t: Card Series: {mi350x.torch_name}" in report["product"]["out"]
    assert "GPU[0]" not in report["product"]["out"]
    assert report["unknown_option"]["rc"] == 2 and "not --showtopo" in report["unknown_option"]["err"]
    used = HELD + mi350x.context_bytes
    assert f"{report['pid']}\tpython\t1\t{used}\t0\t0" in report["pids"]["out"].splitlines()
    assert json.loads(report["pids_json"]["out"]) == {"system": {f"PID{report['pid']}": f"python, 1, {used}, 0, 0"}}


def test_amd_smi_on_an_amd_profile():
    mi350x = profiles.load("mi350x")
    report = probe("mi350x")
    listed = json.loads(report["amd_list"]["out"])
    assert [(g["gpu"], g["bdf"], g["uuid"]) for g in listed] == [
        (i, f"0000:{i + 1:02x}:00.0", uuid) for i, uuid in enumerate(report["uuids"])]
    header, *rows = report["amd_monitor"]["out"].splitlines()
    assert header.split() == ["GPU", "XCP", "POWER", "GPU_T", "MEM_T", "GFX_CLK", "GFX%", "MEM%", "ENC%", "DEC%",
                              "VRAM_USAGE"]
    total = f"{mi350x.memory_bytes / 2**30:.1f} GB"
    assert rows[0].endswith(f" 0.0/{total}") and rows[1].endswith(f" {(HELD + mi350x.context_bytes) / 2**30:.1f}/{total}")
    assert all(len(row) == len(header) for row in rows)  # right-aligned under the header
    assert report["amd_unknown"]["rc"] == 2 and "`list [--json]` and `monitor`" in report["amd_unknown"]["err"]


def test_the_tools_outside_a_session_say_so():
    tool = REPO / "mirage" / "runtime" / "smi_bin" / "nvidia" / "nvidia-smi"
    done = subprocess.run([str(tool)], capture_output=True, text=True,
                          env={"PATH": str(Path(sys.executable).parent)})
    assert done.returncode == 2 and "only inside a mirage session" in done.stderr


def test_green_contexts_on_an_nvidia_profile_and_not_on_rocm():
    assert probe("h100")["green_context"] == [
        True, True, 8.0, "Invalid number of SMs requested for green context: 1000 (device has 132 SMs)"]
    assert probe("mi350x")["green_context"] == ["PyTorch was not built with Green Context support!"]
