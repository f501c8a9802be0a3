"""Every public torch.cuda name, called first thing in a fresh process, does what
docs/torch-cuda.md says: the rows marked `works` return, every other row raises the error the
table quotes (a real box's own error, or a documented difference). A `works` row that returns a
value is also held to it (VALUES): equal to what the device profile's TOML says (the device's
name, capability, memory, compute units, clock, architecture), or, where the value is torch's or
the moment's, of the type and within the range a real box returns."""

import json
import re
import tomllib
import warnings

import torch

from conftest import REPO, mirage
from mirage import profiles

ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<outcome>[^|]+?) \| (?:`(?P<error>(?:[^`\\]|\\.)*)`)? ?\|")
GPUS = 2  # --gpus-per-node
# The default profile's data, read from its TOML (not through mirage's loader).
PROFILE = tomllib.loads((REPO / "mirage" / "profiles" / "data" / f"{profiles.DEFAULT_PROFILE}.toml").read_text())
AMD = PROFILE["vendor"] == "amd"


def documented() -> dict[str, tuple[str, str]]:
    table = {}
    for line in (REPO / "docs" / "torch-cuda.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            table[match["name"]] = (match["outcome"].strip(), (match["error"] or "").replace("\\|", "|"))
    return table


def a_tensor(dtype: str, device: str, shape: list[int]) -> dict:
    return {"type": "Tensor", "dtype": dtype, "device": device, "shape": shape}


def legacy_type(name: str) -> dict:
    """What torch.cuda.<name>(2) is: the CPU class of the same name has the dtype (torch.FloatTensor ...)."""
    with warnings.catch_warnings():  # TypedStorage's deprecation
        warnings.simplefilter("ignore", UserWarning)
        dtype = str(getattr(torch, name).dtype)
    if name.endswith("Tensor"):
        return a_tensor(dtype, "cuda:0", [2])
    return {"type": "TypedStorage", "dtype": dtype, "device": "cuda:0", "size": 2}


def count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def memory_info(value) -> bool:
    """(free, total) of GPU 0: the profile's memory, less at least this process's context."""
    free, total = value
    return total == PROFILE["memory_bytes"] and 0 < free <= total - PROFILE["context_bytes"]


def device_properties(value) -> bool:
    """get_device_properties(1): the profile's figures."""
    major, minor = PROFILE["compute_capability"]
    return (value["name"] == PROFILE["torch_name"] and (value["major"], value["minor"]) == (major, minor)
            and value["total_memory"] == PROFILE["memory_bytes"]
            and value["multi_processor_count"] == PROFILE["compute_units"]
            and value["gcnArchName"] == (PROFILE["arch"] + ":sramecc+:xnack-" if AMD else "NVIDIA CUDA")
            and value["warp_size"] == PROFILE["warp_size"] and value["is_integrated"] is False
            and value["shared_memory_per_block"] == PROFILE["shared_memory_per_block"]
            and isinstance(value["uuid"], str) and value["L2_cache_size"] == PROFILE["l2_cache_bytes"])


def gpu_processes(value) -> bool:
    """torch's printout for GPU 0 (torch/cuda/memory.py): no process yet (this call is the process's
    first: it holds no context), or a line per process that holds memory there."""
    lines = value.splitlines()
    return lines[0] == "GPU:0" and (lines[1:] == ["no processes are running"] or all(
        re.fullmatch(r"process +\d+ uses +\d+\.\d{3} MB GPU memory", line) for line in lines[1:]))


def flag(value) -> bool:
    return isinstance(value, bool)


def a_type(name: str):
    return lambda value: value == {"type": name}


LEGACY = [f"{kind}{suffix}" for kind in ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long",
                                         "Short") for suffix in ("Storage", "Tensor")] + [
    "ComplexDoubleStorage", "ComplexFloatStorage"]
MODULES = ["amp", "graphs", "memory", "nvtx", "random", "sparse", "streams", "tunable"]

# What each `works` row's call (tests/workloads/torch_cuda_surface.py) returned must satisfy.
VALUES = {
    **{name: (lambda value, name=name: value == legacy_type(name)) for name in LEGACY},
    **{name: a_type("module") for name in MODULES},
    "CUDAGraph": a_type("CUDAGraph"), "CudaError": a_type("CudaError"),
    "DeferredCudaCallError": a_type("DeferredCudaCallError"), "ExternalStream": a_type("ExternalStream"),
    "StreamContext": a_type("StreamContext"), "MemPool": a_type("MemPool"), "graph": a_type("graph"),
    "current_stream": a_type("Stream"), "default_stream": a_type("Stream"), "get_stream_from_external": a_type("Stream"),
    "cudart": a_type("SimpleNamespace"), "make_graphed_callables": a_type("Linear"),
    "Stream": lambda value: value is True,  # query(): work runs as issued, so a stream is idle
    "caching_allocator_alloc": lambda value: count(value) and value > 0,  # a device pointer
    "can_device_access_peer": lambda value: value is True,
    "cudaStatus": lambda value: value == 0,  # cudaStatus.SUCCESS
    "current_blas_handle": lambda value: count(value) and value > 0,
    "current_solver_handle": lambda value: count(value) and value > 0,
    "current_device": lambda value: value == 0,
    "default_generators": count, "initial_seed": count,
    "device_count": lambda value: value == GPUS,
    "device_memory_used": lambda value: PROFILE["context_bytes"] <= value <= PROFILE["memory_bytes"],
    "mem_get_info": memory_info,
    "get_allocator_backend": lambda value: value == "native",
    "get_arch_list": lambda value: value == ([PROFILE["arch"]] if AMD else value) and value != [],
    "get_device_capability": lambda value: value == PROFILE["compute_capability"],
    "get_device_name": lambda value: value == PROFILE["torch_name"],
    "get_device_properties": device_properties,
    "get_per_process_memory_fraction": lambda value: value == 1.0,
    # the CUDA generator's state: its seed and offset, 8 bytes each (ATen's CUDAGeneratorImpl::get_state)
    "get_rng_state": lambda value: value == a_tensor("torch.uint8", "cpu", [16]),
    "get_rng_state_all": lambda value: value == [a_tensor("torch.uint8", "cpu", [16])] * GPUS,
    "get_sync_debug_mode": lambda value: value == 0,
    "graph_pool_handle": lambda value: len(value) == 2 and all(count(v) for v in value),
    "has_half": lambda value: value is True, "has_magma": flag,
    # first thing in the process: CUDA not yet initialised, so torch's stats are empty and its counters 0
    "host_memory_stats": lambda value: value == {}, "host_memory_stats_as_nested_dict": lambda value: value == {},
    "memory_stats": lambda value: value == {}, "memory_stats_as_nested_dict": lambda value: value == {},
    "memory_snapshot": lambda value: value == [], "is_initialized": lambda value: value is False,
    **{name: (lambda value: value == 0) for name in ("max_memory_allocated", "max_memory_cached",
                                                      "max_memory_reserved", "memory_allocated", "memory_cached",
                                                      "memory_reserved")},
    "memory_summary": lambda value: "PyTorch CUDA memory summary, device ID 0" in value,
    "is_available": lambda value: value is True, "is_bf16_supported": lambda value: value is True,
    "is_current_stream_capturing": lambda value: value is False, "is_tf32_supported": flag,
    "list_gpu_processes": gpu_processes,
    "utilization": lambda value: 0 <= value <= 100, "memory_usage": lambda value: 0 <= value <= 100,
    "temperature": lambda value: count(value) and 0 < value < 100,
    # watts on AMD (amdsmi's socket power), milliwatts on NVIDIA (NVML), at most the board's power
    "power_draw": lambda value: 0 < value <= PROFILE["board_power_watts"] * (1 if AMD else 1000),
    "clock_rate": lambda value: value == round(PROFILE["clock_ghz"] * 1000),  # MHz
    "nccl": lambda value: len(value) == 3 and all(count(v) for v in value),
    "torch.cuda.nvtx.range_push": lambda value: value == 0,  # the depth of the range pushed
    "torch.cuda.nvtx.range_pop": lambda value: value == -1,  # nothing pushed in this process
    "torch.cuda.nvtx.range_start": count,
    "torch.cuda.comm.broadcast": lambda value: value == [a_tensor("torch.float32", f"cuda:{d}", [4]) for d in range(GPUS)],
    "torch.cuda.comm.broadcast_coalesced":
        lambda value: value == [[a_tensor("torch.float32", f"cuda:{d}", [4])] for d in range(GPUS)],
    "torch.cuda.comm.reduce_add": lambda value: value == a_tensor("torch.float32", "cuda:0", [4]),
    "torch.cuda.comm.reduce_add_coalesced": lambda value: value == [a_tensor("torch.float32", "cuda:0", [4])],
    "torch.cuda.comm.scatter": lambda value: value == [a_tensor("torch.float32", f"cuda:{d}", [2]) for d in range(GPUS)],
    "torch.cuda.comm.gather": lambda value: value == a_tensor("torch.float32", "cuda:0", [4 * GPUS]),
    "torch.cuda.tunable.is_enabled": lambda value: value is False,
    "torch.cuda.tunable.tuning_is_enabled": flag, "torch.cuda.tunable.record_untuned_is_enabled": flag,
    "torch.cuda.tunable.get_max_tuning_duration": lambda value: count(value) and value > 0,
    "torch.cuda.tunable.get_max_tuning_iterations": lambda value: count(value) and value > 0,
    "torch.cuda.tunable.get_filename": lambda value: isinstance(value, str) and value.endswith(".csv"),
    "torch.cuda.tunable.get_results": lambda value: value == [],
    "torch.cuda.tunable.get_validators":
        lambda value: ((["GCN_ARCH_NAME", PROFILE["arch"] + ":sramecc+:xnack-"] in value)
                       and ["PT_VERSION", torch.__version__.split("+")[0]] in value) if AMD else isinstance(value, list),
    "torch.cuda.tunable.read_file": lambda value: value is False,  # the file does not exist
    "torch.cuda.tunable.get_rotating_buffer_size": lambda value: isinstance(value, int),
    "torch.cuda.amp.amp_definitely_not_available": lambda value: value is False,
    "torch.cuda.amp.autocast": a_type("autocast"),
    "torch.cuda.amp.custom_bwd": a_type("function"), "torch.cuda.amp.custom_fwd": a_type("function"),
    "torch.cuda.amp.GradScaler": lambda value: value == a_tensor("torch.float32", "cuda:0", [4]),  # scale(t)
}


def test_every_public_name_behaves_as_docs_torch_cuda_md_says(tmp_path):
    # In a scratch directory: some calls write files where they run (TunableOp's gathered results).
    result = mirage("run", "--gpus-per-node", str(GPUS), "--workdir", str(tmp_path), "--", "python",
                    str(REPO / "tests" / "workloads" / "torch_cuda_surface.py"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = {row["name"]: row for row in map(json.loads, result.stdout.splitlines())}
    table = documented()
    assert sorted(seen) == sorted(table), "docs/torch-cuda.md lists other names than torch.cuda exports"
    mismatches = []
    for name, (outcome, error) in table.items():
        row = seen[name]
        if outcome == "works" and row["outcome"] != "ok":
            mismatches.append(f"{name}: documented as working, but {row['outcome']}: {row['error']}")
        elif outcome == "works" and row["value"] is not None and name not in VALUES:
            mismatches.append(f"{name}: returned {row['value']!r}, which VALUES does not check")
        elif outcome == "works" and name in VALUES and not VALUES[name](row["value"]):
            mismatches.append(f"{name}: returned {row['value']!r}, not what the profile and torch say")
        elif outcome != "works" and (row["outcome"] != "raised" or row["error"] != error):
            mismatches.append(f"{name}: documented to raise {error!r}, got {row['outcome']}: {row['error']!r}")
    assert not mismatches, "\n".join(mismatches)
