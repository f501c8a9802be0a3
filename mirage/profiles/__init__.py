"""Device profiles: what an emulated GPU reports to torch, as data.

One TOML file per device under `data/` (figures and sources: docs/ and the files' comments).
A user's own file is accepted by path and checked field by field, so a typo names the field
instead of failing later inside the workload. The runtime reads the same files, so this module
must stay free of launcher imports.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

DATA_DIR = Path(__file__).with_name("data")
DEFAULT_PROFILE = "mi350x"
VENDORS = ("amd", "nvidia")


class ProfileError(ValueError):
    """A profile that cannot be found or does not validate; the message names the fix."""


@dataclass(frozen=True)
class Profile:
    """One emulated device model, as loaded from its TOML file."""

    name: str
    torch_name: str
    vendor: str
    architecture: str
    arch: str
    compute_capability: tuple[int, int]
    memory_bytes: int
    compute_units: int
    clock_ghz: float
    memory_bandwidth_gbs: float
    link_bandwidth_gbs: float
    gpus_per_node: int
    board_power_watts: float  # total board power (TDP): the power draw under full load
    # Device memory a process's GPU context takes besides PyTorch's allocator (driver, kernels,
    # library workspaces): counted as the process's non-PyTorch memory from its first allocation.
    context_bytes: int
    # The memory interface's width (bits): with memory_bandwidth_gbs it gives the memory clock
    # Triton's driver reports (runtime/triton_driver.py); 0 where a user's profile leaves it out.
    memory_bus_width_bits: int = 0
    # What the runtime reports as sharedMemPerBlock and warpSize (CUDA: 48 KiB and 32 on every
    # NVIDIA GPU since Kepler; HIP: 64 KiB of LDS and wavefronts of 64 on CDNA): torch's
    # device properties, and which of SoftMax.cu's kernels a row fits (clocked mode's model).
    # 0 where a user's profile leaves them out: the vendor's value (_check).
    shared_memory_per_block: int = 0
    warp_size: int = 0
    # What the runtime reports as l2CacheSize (torch's L2_cache_size): HIP reports one XCD's or
    # GCD's L2. 0 where a user's profile leaves it out: 50 MiB (NVIDIA), 4 MiB (AMD) (_check).
    l2_cache_bytes: int = 0
    # What the vendor's smi tools print of the board (runtime/smi_commands.py): the links each GPU
    # has to every other GPU of its node (NVIDIA: NVLinks, `nvidia-smi topo -m`'s NV<n>) and the
    # PCI device ID (rocm-smi's DID). 0 where a user's profile leaves them out: PCIe, unknown.
    gpu_links: int = 0
    pci_product_id: int = 0
    peak_tflops: dict[str, float] = field(default_factory=dict)
    # Clocked mode's model: [timing] key -> {value, kind, source}, and [timing.inputs]: where the
    # profile's own figures the model reads come from (see TIMING_KEYS, timing_model).
    timing: dict = field(default_factory=dict)
    path: Path = Path()

    @property
    def is_amd(self) -> bool:
        return self.vendor == "amd"

    @property
    def gcn_arch_name(self) -> str:
        """What HIP reports as an AMD GPU's gcnArchName: the target with the driver's default
        features (ECC on, XNACK off), "gfx942:sramecc+:xnack-" on MI300X, as collect_env and
        TunableOp's files show it; "NVIDIA CUDA" on NVIDIA (torch's value there)."""
        return self.arch + ":sramecc+:xnack-" if self.is_amd else "NVIDIA CUDA"

    @property
    def memory_clock_khz(self) -> int:
        """The memory clock a DDR interface of this width needs for the bandwidth (bandwidth = 2 x
        clock x width / 8, which triton.testing.get_dram_gbps inverts); 0 where the width is unknown."""
        width = self.memory_bus_width_bits
        return int(self.memory_bandwidth_gbs * 1e6 * 8 / (2 * width)) if width else 0

    def power_watts(self, busy_fraction: float) -> float:
        """Modelled board power at a utilization (0..1): 15% of the board power idle, rising
        linearly to all of it at full load (for torch.cuda.power_draw and `mirage smi`)."""
        return self.board_power_watts * (IDLE_POWER_FRACTION + (1 - IDLE_POWER_FRACTION) * busy_fraction)


IDLE_POWER_FRACTION = 0.15
IDLE_CELSIUS, FULL_LOAD_CELSIUS = 35, 80


def temperature_celsius(busy_fraction: float) -> int:
    """Modelled GPU temperature at a utilization (0..1): 35 C idle, 80 C at full load."""
    return round(IDLE_CELSIUS + (FULL_LOAD_CELSIUS - IDLE_CELSIUS) * busy_fraction)


# field name -> (accepted types, human description)
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "name": ((str,), "a string"),
    "torch_name": ((str,), "a string"),
    "vendor": ((str,), f"one of {', '.join(VENDORS)}"),
    "architecture": ((str,), "a string"),
    "arch": ((str,), "a string such as gfx950 or sm_90"),
    "compute_capability": ((list,), "a [major, minor] pair of integers"),
    "memory_bytes": ((int,), "a positive integer"),
    "compute_units": ((int,), "a positive integer"),
    "clock_ghz": ((int, float), "a number >= 0"),
    "memory_bandwidth_gbs": ((int, float), "a positive number"),
    "link_bandwidth_gbs": ((int, float), "a positive number"),
    "gpus_per_node": ((int,), "an integer from 1 to 64"),
    "board_power_watts": ((int, float), "a positive number"),
    "context_bytes": ((int,), "an integer >= 0"),
    "memory_bus_width_bits": ((int,), "a positive integer (the memory interface's width in bits)"),
    "shared_memory_per_block": ((int,), "a positive integer (bytes of shared memory a kernel's block may use)"),
    "warp_size": ((int,), "a positive integer (threads a warp or wavefront runs together)"),
    "l2_cache_bytes": ((int,), "a positive integer (the L2 cache the runtime reports, bytes)"),
    "gpu_links": ((int,), "an integer >= 0 (links from each GPU to each other GPU of the node, e.g. 18 NVLinks)"),
    "pci_product_id": ((int,), "an integer >= 0 (the PCI device ID, e.g. 0x74a1)"),
    "peak_tflops": ((dict,), "a table of dtype = TFLOP/s"),
    "timing": ((dict,), "a table of clocked mode's numbers (see mirage/profiles/data/h100.toml)"),
}
_OPTIONAL = {"timing", "memory_bus_width_bits", "shared_memory_per_block", "warp_size", "l2_cache_bytes",
             "gpu_links", "pci_product_id"}

# Clocked mode's own numbers, each a [timing] entry {value, kind, source}.
TIMING_KEYS: dict[str, str] = {
    "launch_us": "host time per kernel launch (the host's clock advances by it per op)",
    "kernel_overhead_us": "a kernel's fixed cost on the device",
    "memory_efficiency": "the fraction of memory_bandwidth_gbs streaming kernels reach",
    "memory_efficiency_general": "the same for a memory-bound kernel whose tensors are not all dense and of one size "
                                 "(broadcasts, strided views, reductions, gathers: PyTorch's non-vectorized path)",
    "host_link_gbs": "achievable host <-> device copy bandwidth, GB/s",
    "gemm_efficiency": "the fraction of peak_tflops large GEMMs reach",
    "gemm_efficiency_fp8": "the fraction of the FP8 peak large FP8 GEMMs reach",
    "attention_efficiency": "the fraction of the dtype's peak fused (flash) attention kernels reach",
    "attention_backward_efficiency": "the same for fused attention's backward kernel (2.5x its forward's FLOPs)",
    "attention_causal_factor": "a causal fused attention kernel's rate per block of scores it computes, over a "
                               "non-causal kernel's (the diagonal blocks' masking, query blocks of unequal work)",
    "attention_backward_causal_factor": "the same for fused attention's backward kernel",
    "attention_block_rows": "query rows a fused attention kernel computes together (a causal kernel computes "
                            "whole the blocks its diagonal crosses)",
    "attention_block_overhead": "a fused attention kernel's fixed work per block of query rows (loading it, "
                                "rescaling and writing its output), in steps of attention_block_rows keys: a block "
                                "that sweeps n steps takes the time of n + this",
    "attention_backward_block_overhead": "the same for fused attention's backward kernel",
    "attention_softmax_head_dims": "a fused attention kernel's work per score besides its two matmuls (exponential, "
                                   "row maximum, rescaling), in head dims of matmul work: at head dim d it takes "
                                   "(1 + this / d) / (1 + this / 128) of the time at head dim 128, where the "
                                   "efficiencies are measured",
    "torch_flash_attention_rate": "the speed of PyTorch's own FlashAttention-2 build (the kernels SDPA's flash "
                                  "backend runs) over flash-attn's, whose figures the attention efficiencies are, "
                                  "for a non-causal kernel, forward and backward",
    "torch_flash_attention_causal_rate": "the same for a causal kernel",
    "gemm_tile_m": "GEMM output tile rows (wave quantisation)",
    "gemm_tile_n": "GEMM output tile columns (wave quantisation)",
    "gemm_epilogue_share": "the share of a GEMM wave's output store (its tiles at the HBM bandwidth) not hidden "
                           "behind the wave's main loop",
    "gemm_split_k_min": "the least K one split of a split-K GEMM takes (a grid of fewer tiles than compute units "
                        "is split along K)",
    "nccl_compute_units": "compute units a running NCCL kernel holds (a GEMM beside it runs its waves on the rest)",
    "nccl_bus_efficiency": "the fraction of one direction of link_bandwidth_gbs NCCL's busbw reaches",
    "nvls_bus_efficiency": "all_reduce's busbw with NVLink SHARP, as a fraction of one link direction (0: none)",
    "nccl_latency_us": "a collective's fixed cost within a node (NCCL's Simple protocol)",
    "nccl_ll_latency_us": "a collective's fixed cost with NCCL's LL protocol (small messages)",
    "nccl_ll_efficiency": "the fraction of the bus bandwidth NCCL's LL protocol reaches",
    "nic_bandwidth_gbs": "network bandwidth per GPU across nodes, GB/s",
    "nic_efficiency": "the fraction of nic_bandwidth_gbs NCCL reaches",
    "nic_latency_us": "added per doubling of nodes",
}
# The profile's own figures the model reads, as model keys.
TIMING_INPUTS = ("memory_bandwidth_gbs", "link_bandwidth_gbs", "compute_units", "shared_memory_per_block", "warp_size",
                 "peak_tflops.bf16", "peak_tflops.fp16", "peak_tflops.fp8", "peak_tflops.fp32", "peak_tflops.tf32")
PROVENANCE_KINDS = ("published", "derived", "measured", "assumed")


def _check(path: Path, data: dict) -> Profile:
    def bad(name: str) -> ProfileError:
        shown = repr(data[name]) if name in data else "missing"
        return ProfileError(
            f"profile {path}: field '{name}' is {shown}; it must be {_FIELDS[name][1]}"
        )

    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ProfileError(
            f"profile {path}: unknown field '{unknown[0]}'; the fields are {', '.join(_FIELDS)}"
        )
    for name, (types, _) in _FIELDS.items():
        value = data.get(name)
        if value is None and name in _OPTIONAL:
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, types):
            raise bad(name)
    if data["vendor"] not in VENDORS:
        raise bad("vendor")
    capability = data["compute_capability"]
    if len(capability) != 2 or not all(isinstance(x, int) and x >= 0 for x in capability):
        raise bad("compute_capability")
    for name in ("memory_bytes", "compute_units", "memory_bandwidth_gbs", "link_bandwidth_gbs", "board_power_watts"):
        if data[name] <= 0:
            raise bad(name)
    if data["clock_ghz"] < 0:
        raise bad("clock_ghz")
    for name in ("context_bytes", "gpu_links", "pci_product_id"):
        if data.get(name, 0) < 0:
            raise bad(name)
    for name in ("memory_bus_width_bits", "shared_memory_per_block", "warp_size", "l2_cache_bytes"):
        if data.get(name, 1) <= 0:
            raise bad(name)
    amd = data["vendor"] == "amd"
    data = {"shared_memory_per_block": 65536 if amd else 49152, "warp_size": 64 if amd else 32,
            "l2_cache_bytes": (4 if amd else 50) * 2**20, **data}
    if not 1 <= data["gpus_per_node"] <= 64:
        raise bad("gpus_per_node")
    peaks = data["peak_tflops"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in peaks.values()):
        raise bad("peak_tflops")
    if "timing" in data:
        _check_timing(path, data["timing"])
    return Profile(
        **{**data, "compute_capability": tuple(capability), "peak_tflops": dict(peaks)},
        path=path,
    )


def _nearest(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.4)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_timing(path: Path, table: dict) -> None:
    """Every [timing] entry is a known key with a number, a provenance kind and a source."""
    for key, entry in table.items():
        if key == "inputs":
            continue
        if key not in TIMING_KEYS:
            raise ProfileError(f"profile {path}: unknown [timing] key '{key}'{_nearest(key, TIMING_KEYS)}; "
                               f"the keys are {', '.join(TIMING_KEYS)}")
        if not isinstance(entry, dict) or not _is_number(entry.get("value")) \
                or entry.get("kind") not in PROVENANCE_KINDS or not isinstance(entry.get("source"), str):
            raise ProfileError(f"profile {path}: [timing] {key} must be {{ value = <number>, kind = one of "
                               f"{', '.join(PROVENANCE_KINDS)}, source = \"...\" }}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class TimingNumber:
    """One number of clocked mode's model, with where it comes from."""

    key: str
    value: float
    kind: str  # published, derived, measured, assumed
    source: str


def timing_numbers(profile: Profile, tuning: dict[str, TimingNumber] | None = None) -> list[TimingNumber]:
    """Every number clocked mode's model uses for `profile`, the tuning file's overrides applied;
    a profile without a [timing] table raises ProfileError naming the fix."""
    missing = [key for key in TIMING_KEYS if key not in profile.timing]
    if missing:
        raise ProfileError(f"profile {profile.path} has no clocked-mode numbers ({', '.join(missing)} missing "
                           "from its [timing] table); copy the table from a shipped profile "
                           f"({DATA_DIR / 'h100.toml'}) and adjust it")
    inputs = profile.timing.get("inputs", {})
    numbers = [TimingNumber(key, float(profile.timing[key]["value"]), profile.timing[key]["kind"],
                            profile.timing[key]["source"]) for key in TIMING_KEYS]
    peaks = profile.peak_tflops
    for key in TIMING_INPUTS:
        field_name, _, dtype = key.partition(".")
        origin = inputs.get(field_name, {"kind": "published", "source": f"{profile.path.name}: {field_name}"})
        if not dtype:
            numbers.append(TimingNumber(key, float(getattr(profile, field_name)), origin["kind"], origin["source"]))
        elif dtype in peaks:
            numbers.append(TimingNumber(key, float(peaks[dtype]), origin["kind"], origin["source"]))
        else:  # no such units: what the GPU runs that dtype's matmuls on instead
            stand_in = "fp32" if dtype == "tf32" else "fp16"
            numbers.append(TimingNumber(key, float(peaks.get(stand_in, peaks.get("fp32", 1.0))), "derived",
                                        f"the GPU has no {dtype} units: its {stand_in} rate"))
    if tuning:
        numbers = [tuning.get(n.key, n) for n in numbers]
    return numbers


def timing_model(profile: Profile, tuning: dict[str, TimingNumber] | None = None) -> str:
    """The model as the shim reads it (MIRAGE_TIMING_MODEL): "key=value,..."."""
    return ",".join(f"{n.key}={n.value!r}" for n in timing_numbers(profile, tuning))


def load_tuning(path: str | Path) -> dict[str, TimingNumber]:
    """A --timing-tuning file: a TOML table of existing model keys, each a number or
    {value, kind, source} (bench/calibrate.py writes the latter). An unknown key is an error
    naming the nearest one."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ProfileError(f"timing tuning file {path} does not exist; pass a TOML file of model keys "
                           "(`mirage profiles show NAME --timing` lists them)")
    try:
        data = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"timing tuning file {path} is not valid TOML: {err}") from None

    def flatten(table: dict, prefix: str = "") -> dict:
        flat = {}
        for key, value in table.items():
            if isinstance(value, dict) and "value" not in value:
                flat.update(flatten(value, f"{prefix}{key}."))
            else:
                flat[f"{prefix}{key}"] = value
        return flat

    known = list(TIMING_KEYS) + list(TIMING_INPUTS)
    tuned = {}
    for key, value in flatten(data).items():
        if key not in known:
            raise ProfileError(f"timing tuning file {path}: unknown key '{key}'{_nearest(key, known)}; "
                               f"the keys are {', '.join(known)}")
        entry = value if isinstance(value, dict) else {"value": value}
        if not _is_number(entry.get("value")):
            raise ProfileError(f"timing tuning file {path}: '{key}' must be a number or {{ value = <number>, ... }}")
        kind = entry.get("kind", "measured")
        if kind not in PROVENANCE_KINDS:
            raise ProfileError(f"timing tuning file {path}: '{key}' has kind '{kind}'; "
                               f"it must be one of {', '.join(PROVENANCE_KINDS)}")
        tuned[key] = TimingNumber(key, float(entry["value"]), kind, entry.get("source", f"tuning file {file}"))
    return tuned


def builtin_names() -> list[str]:
    """Names of the profiles shipped with mirage, sorted."""
    return sorted(p.stem for p in DATA_DIR.glob("*.toml"))


def load(name_or_path: str | Path) -> Profile:
    """Loads a shipped profile by name, or a user's TOML file by path."""
    text = str(name_or_path)
    if text.endswith(".toml") or "/" in text:
        path = Path(text).expanduser().resolve()
        if not path.is_file():
            raise ProfileError(f"profile file {text} does not exist; pass the path of a TOML profile")
    else:
        path = DATA_DIR / f"{text.lower()}.toml"
        if not path.is_file():
            raise ProfileError(
                f"unknown profile '{text}'; choose one of: {', '.join(builtin_names())} "
                "(or pass a path to your own .toml; `mirage profiles` lists them)"
            )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"profile {path} is not valid TOML: {err}") from None
    return _check(path, data)


def load_all() -> list[Profile]:
    """Every shipped profile."""
    return [load(name) for name in builtin_names()]
