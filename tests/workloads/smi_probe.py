"""Runs the vendor's smi tools from inside a workload that holds device memory, as a job script
would, and prints one JSON object of what they said (tests/test_smi_commands.py reads it), with
what torch's green contexts did (which torch gates on the driver nvidia-smi reports).

It takes 1 GiB on cuda:1 first, so that the tools have a process and memory to report."""

import json
import os
import shutil
import subprocess

import torch


def green_context() -> list:
    """What torch's green contexts do here: [switched stream?, restored?, a result, the SM check's
    message], or the refusal's message."""
    from torch.cuda.green_contexts import GreenContext

    try:
        context = GreenContext.create(num_sms=16, device_id=0)
    except RuntimeError as error:
        return [str(error)]
    before = torch.cuda.current_stream()
    context.set_context()
    inside = torch.cuda.current_stream()
    x = torch.ones(4, device="cuda") * 2
    context.pop_context()
    try:
        GreenContext.create(num_sms=1000)
        checked = "no error"
    except RuntimeError as error:
        checked = str(error)
    return [inside != before, torch.cuda.current_stream() == before, x.sum().item(), checked]


def run(*argv: str) -> dict:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return {"rc": done.returncode, "out": done.stdout, "err": done.stderr}


held = torch.empty(2**30, dtype=torch.uint8, device="cuda:1")
report = {"pid": os.getpid(), "which": {tool: shutil.which(tool) for tool in ("nvidia-smi", "rocm-smi", "amd-smi")},
          "uuids": [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]}
if torch.version.cuda:
    from torch.testing._internal.common_cuda import PLATFORM_SUPPORTS_GREEN_CONTEXT
    from torch.utils import collect_env

    report.update({
        "table": run("nvidia-smi"), "list": run("nvidia-smi", "-L"), "topology": run("nvidia-smi", "topo", "-m"),
        "query": run("nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,memory.free,pci.bus_id",
                     "--format=csv,noheader,nounits"),
        "query_units": run("nvidia-smi", "-i", "1", "--query-gpu=memory.used,utilization.gpu,power.draw",
                           "--format=csv"),
        "apps": run("nvidia-smi", "--query-compute-apps=pid,used_memory,gpu_bus_id", "--format=csv,noheader"),
        "unknown_option": run("nvidia-smi", "-q"), "unknown_field": run("nvidia-smi", "--query-gpu=bogus",
                                                                        "--format=csv"),
        "missing_gpu": run("nvidia-smi", "-i", "7", "-L"), "version": run("nvidia-smi", "--version"),
        "loop": run("timeout", "4.5", "nvidia-smi", "--query-gpu=index", "--format=csv", "-i", "0", "-l", "1"),
        "driver": collect_env.get_nvidia_driver_version(collect_env.run),
        "green_context_gate": bool(PLATFORM_SUPPORTS_GREEN_CONTEXT),
    })
else:
    report.update({"concise": run("rocm-smi"), "memory": run("rocm-smi", "--showmeminfo", "vram", "--json"),
                   "product": run("rocm-smi", "--showproductname", "-d", "1"), "unknown_option": run("rocm-smi", "--showtopo"),
                   "pids": run("rocm-smi", "--showpids"), "pids_json": run("rocm-smi", "--showpids", "--json"),
                   "amd_list": run("amd-smi", "list", "--json"), "amd_monitor": run("amd-smi", "monitor"),
                   "amd_unknown": run("amd-smi", "static")})
report["green_context"] = green_context()  # last: it takes memory on cuda:0, which the tools report
print(json.dumps(report))
