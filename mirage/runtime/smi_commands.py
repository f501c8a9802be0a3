"""`nvidia-smi`, `rocm-smi` and `amd-smi` inside a session, answered by the emulated GPUs.

The first thing a job script, a CI step or a bug report runs on a GPU box is the vendor's smi
tool: `nvidia-smi` to see the GPUs, `nvidia-smi --query-gpu=... --format=csv` to size a job,
`rocm-smi` on AMD. torch 2.13 runs it too: inductor's collective cost model reads
`nvidia-smi topo -m` for NVLink (torch/_inductor/comm_analysis.py), torch.utils.collect_env
the driver version and `nvidia-smi -L`, common_cuda's green-context check the driver version.
Without a GPU there is no such command, and each of those took its no-GPU branch. `mirage run`
puts the profile vendor's commands first on the workload's PATH (runtime/smi_bin/<vendor>/; an
NVIDIA box has no rocm-smi and an AMD one no nvidia-smi) and they answer from the session: its
service's status (what `mirage smi` prints: memory in use on each GPU by every process, the
processes, utilization and the modelled power and temperature) and the profile.

What is printed follows the tools' formats (nvidia-smi of driver R570, the CUDA 12.8 driver line;
rocm-smi and amd-smi of ROCm 7.0): the default tables, `nvidia-smi -L`, `-i`, `--query-gpu` and
`--query-compute-apps` with `--format=csv[,noheader][,nounits]`, `-l` (loop), `--version`,
`topo -m`; `rocm-smi` with `--showproductname`, `--showmeminfo vram`, `--showuse`, `--showid`,
`--showpids` and `--json`; `amd-smi list [--json]` and `amd-smi monitor` (its default columns;
memory and hotspot temperature both the one model's). An option a tool has and this one does not is
refused (exit 2) with a line naming what is emulated. The GPUs are the node's, whatever
CUDA_VISIBLE_DEVICES says (the tools read the driver, not the runtime's view). memory.total is
torch's total_memory: a real nvidia-smi shows a few hundred MiB more, the driver's reserve.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mirage import profiles
from mirage.daemon.service import request
from mirage.runtime.visible_devices import gpu_uuid, pci_bus

# The driver an R570 box runs (the branch whose "CUDA Version" is 12.8, which cu128 wheels need).
NVIDIA_DRIVER = "570.172.08"
NVIDIA_DRIVER_CUDA = "12.8"
MIB = 2**20


@dataclass
class Gpu:
    """One GPU of this process's node, as the smi tools report it."""

    index: int
    node: int
    used_bytes: int = 0
    utilization_percent: int = 0
    temperature_c: int = profiles.IDLE_CELSIUS
    power_watts: float = 0.0
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, bytes)

    @property
    def uuid(self) -> str:
        return gpu_uuid(self.index, self.node)

    @property
    def bus_id(self) -> str:
        return f"00000000:{pci_bus(self.index):02X}:00.0"


def node_gpus(profile: profiles.Profile) -> list[Gpu]:
    """The node's GPUs now, from the session's service; figures at rest without one (--in-process)."""
    node = int(os.environ.get("MIRAGE_NODE_RANK", "0"))
    count = int(os.environ.get("MIRAGE_NUM_GPUS", profile.gpus_per_node))
    gpus = [Gpu(i, node, power_watts=profile.power_watts(0.0)) for i in range(count)]
    socket_path = os.environ.get("MIRAGE_SOCKET")
    if not socket_path:
        return gpus
    try:
        status = request(Path(socket_path), {"op": "status"}, timeout=5.0)
    except (OSError, ValueError):
        return gpus
    for reported in status.get("gpus", []):
        if reported["node"] != node or reported["gpu"] >= count:
            continue
        gpu = gpus[reported["gpu"]]
        gpu.used_bytes = reported["used_bytes"]
        gpu.utilization_percent = reported["utilization_percent"]
        gpu.temperature_c = reported["temperature_c"]
        gpu.power_watts = reported["power_watts"] if reported["power_watts"] is not None else gpu.power_watts
        gpu.processes = [(p["pid"], p["bytes"]) for p in reported["processes"]]
    return gpus


def process_name(pid: int) -> str:
    """The process's command as the driver names it (its argv[0])."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace") or "[Not Found]"
    except OSError:
        return "[Not Found]"


class UsageError(Exception):
    """A command line the tool refuses: printed, exit 2."""


# --- nvidia-smi -------------------------------------------------------------------------------

_NVIDIA_TABLE_HEAD = [
    "|-----------------------------------------+------------------------+----------------------+",
    "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
    "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
    "|                                         |                        |               MIG M. |",
    "|=========================================+========================+======================|",
]
_NVIDIA_GPU_RULE = "+-----------------------------------------+------------------------+----------------------+"
_NVIDIA_WIDE_RULE = "+" + "-" * 89 + "+"
_NVIDIA_PROCESS_HEAD = [
    "| Processes:                                                                              |",
    "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
    "|        ID   ID                                                               Usage      |",
    "|=========================================================================================|",
]
_NVIDIA_TOPO_LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def _mib(n: int) -> int:
    return n // MIB


def _nvidia_table(profile: profiles.Profile, gpus: list[Gpu]) -> str:
    name = profile.torch_name if len(profile.torch_name) <= 27 else profile.torch_name[:23] + " ..."
    lines = [time.strftime("%a %b %e %H:%M:%S %Y") + "       ", _NVIDIA_WIDE_RULE,
             f"| NVIDIA-SMI {NVIDIA_DRIVER:<23}Driver Version: {NVIDIA_DRIVER:<15}CUDA Version: "
             f"{NVIDIA_DRIVER_CUDA:<9}|", *_NVIDIA_TABLE_HEAD]
    total = _mib(profile.memory_bytes)
    for gpu in gpus:
        lines += [
            f"| {gpu.index:>3}  {name:<31}{'On':<3} |   {gpu.bus_id} Off |{'0':>21} |",
            f"| N/A   {gpu.temperature_c:>2}C    P0{round(gpu.power_watts):>15}W / {round(profile.board_power_watts):>4}W "
            f"|{_mib(gpu.used_bytes):>8}MiB / {total:>6}MiB |{gpu.utilization_percent:>7}%      Default |",
            f"|{'':41}|{'':24}|{'Disabled':>21} |",
            _NVIDIA_GPU_RULE,
        ]
    lines += [" " * 89, _NVIDIA_WIDE_RULE, *_NVIDIA_PROCESS_HEAD]
    rows = [(gpu.index, pid, used) for gpu in gpus for pid, used in gpu.processes]
    for index, pid, used in rows:
        command = process_name(pid)
        command = command if len(command) <= 32 else "..." + command[-29:]
        lines.append(f"| {index:>4}   N/A  N/A {pid:>15}      C   {command:<32}{f'{_mib(used)}MiB':>14} |")
    if not rows:
        lines.append(f"|  {'No running processes found':<87}|")
    lines.append(_NVIDIA_WIDE_RULE)
    return "\n".join(lines)


def _nvidia_fields(profile: profiles.Profile, gpus: list[Gpu]) -> dict[str, tuple[str, Callable[[Gpu], str]]]:
    """--query-gpu fields: name -> (unit, value of a GPU). Aliases share their entry."""
    total = profile.memory_bytes
    clock = round(profile.clock_ghz * 1000)
    watts = profile.board_power_watts
    fields: dict[str, tuple[str, Callable[[Gpu], str]]] = {
        "timestamp": ("", lambda g: time.strftime("%Y/%m/%d %H:%M:%S.") + f"{int(time.time() * 1000) % 1000:03d}"),
        "driver_version": ("", lambda g: NVIDIA_DRIVER),
        "count": ("", lambda g: str(len(gpus))),
        "name": ("", lambda g: profile.torch_name),
        "uuid": ("", lambda g: f"GPU-{g.uuid}"),
        "pci.bus_id": ("", lambda g: g.bus_id),
        "index": ("", lambda g: str(g.index)),
        "compute_cap": ("", lambda g: "{}.{}".format(*profile.compute_capability)),
        "persistence_mode": ("", lambda g: "Enabled"),
        "pstate": ("", lambda g: "P0"),
        "compute_mode": ("", lambda g: "Default"),
        "mig.mode.current": ("", lambda g: "Disabled"),
        "fan.speed": ("%", lambda g: "[N/A]"),
        "memory.total": ("MiB", lambda g: str(_mib(total))),
        "memory.reserved": ("MiB", lambda g: "0"),
        "memory.used": ("MiB", lambda g: str(_mib(g.used_bytes))),
        "memory.free": ("MiB", lambda g: str(_mib(total - g.used_bytes))),
        "utilization.gpu": ("%", lambda g: str(g.utilization_percent)),
        "utilization.memory": ("%", lambda g: str(g.utilization_percent)),
        "temperature.gpu": ("", lambda g: str(g.temperature_c)),
        "power.draw": ("W", lambda g: f"{g.power_watts:.2f}"),
        "power.limit": ("W", lambda g: f"{watts:.2f}"),
        "enforced.power.limit": ("W", lambda g: f"{watts:.2f}"),
        "power.default_limit": ("W", lambda g: f"{watts:.2f}"),
        "power.max_limit": ("W", lambda g: f"{watts:.2f}"),
        "clocks.sm": ("MHz", lambda g: str(clock)),
        "clocks.gr": ("MHz", lambda g: str(clock)),
        "clocks.max.sm": ("MHz", lambda g: str(clock)),
        "clocks.max.gr": ("MHz", lambda g: str(clock)),
        "ecc.errors.uncorrected.volatile.total": ("", lambda g: "0"),
    }
    aliases = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id", "clocks.current.sm": "clocks.sm",
               "clocks.current.graphics": "clocks.gr", "clocks.graphics": "clocks.gr", "clocks.max.graphics": "clocks.max.gr",
               "power.draw.instant": "power.draw"}
    return {**fields, **{alias: fields[target] for alias, target in aliases.items()}}


def _csv(rows: list[list[tuple[str, str, str]]], header: list[tuple[str, str]], options: set[str]) -> str:
    """nvidia-smi's CSV: `name [unit]` headers, `value unit` cells (nounits / noheader drop them)."""
    units = "nounits" not in options
    lines = [] if "noheader" in options else [", ".join(f"{n} [{u}]" if u and units else n for n, u in header)]
    for row in rows:
        lines.append(", ".join(f"{value} {unit}" if unit and units and not value.startswith("[") else value
                               for _, unit, value in row))
    return "\n".join(lines)


def _format_options(value: str | None) -> set[str]:
    if value is None:
        raise UsageError("--format=csv[,noheader][,nounits] is needed with a --query- option")
    options = {part.strip() for part in value.split(",")}
    if "csv" not in options or options - {"csv", "noheader", "nounits"}:
        raise UsageError(f'"{value}" is not a valid format: use csv, with noheader and nounits as wanted')
    return options


def _pick(gpus: list[Gpu], spec: str | None) -> list[Gpu]:
    """-i: indices, UUIDs or bus ids, comma-separated."""
    if spec is None:
        return gpus
    chosen = []
    for entry in spec.split(","):
        entry = entry.strip()
        found = [g for g in gpus if entry == str(g.index) or entry.upper() in (f"GPU-{g.uuid}".upper(), g.bus_id)]
        if not found:
            raise LookupError(entry)
        chosen += found
    return chosen


def _nvidia_topology(profile: profiles.Profile, gpus: list[Gpu]) -> str:
    link = f"NV{profile.gpu_links}" if profile.gpu_links else "SYS"
    cpus = sorted(os.sched_getaffinity(0))
    affinity = f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))
    header = "\t" + "\t".join(f"GPU{g.index}" for g in gpus) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"
    rows = [f"GPU{g.index}\t" + "\t".join(" X " if h is g else link for h in gpus) + f"\t{affinity}\t0\t\tN/A"
            for g in gpus]
    return "\n".join([header, *rows]) + "\n" + _NVIDIA_TOPO_LEGEND


def nvidia_smi(argv: list[str]) -> int:
    if argv[:1] == ["topo"]:
        if argv[1:] not in (["-m"], ["--matrix"]):
            raise UsageError("this nvidia-smi (mirage's) answers `topo -m` of the topo commands")
        profile = profiles.load(os.environ["MIRAGE_PROFILE"])
        print(_nvidia_topology(profile, node_gpus(profile)))
        return 0
    parser = argparse.ArgumentParser(prog="nvidia-smi", add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("-L", "--list-gpus", action="store_true")
    parser.add_argument("-i", "--id")
    parser.add_argument("--query-gpu")
    parser.add_argument("--query-compute-apps")
    parser.add_argument("--format")
    parser.add_argument("-l", "--loop", type=int, nargs="?", const=5)  # seconds; nvidia-smi's default 5
    parser.add_argument("--version", action="store_true")
    args, unknown = parser.parse_known_args(argv)
    if args.version and not unknown:
        print(f"NVIDIA-SMI version  : {NVIDIA_DRIVER}\nNVML version        : {NVIDIA_DRIVER.rsplit('.', 1)[0]}\n"
              f"DRIVER version      : {NVIDIA_DRIVER}\nCUDA Version        : {NVIDIA_DRIVER_CUDA}")
        return 0
    if unknown or args.help or (args.loop is not None and args.loop < 1):
        raise UsageError("this nvidia-smi (mirage's, answered by the emulated GPUs) takes: no option (the "
                         "table), -L, -i ID, --query-gpu=FIELDS or --query-compute-apps=FIELDS with "
                         "--format=csv[,noheader][,nounits], -l [SECONDS], --version and `topo -m`"
                         + (f"; not {' '.join(unknown)}" if unknown else ""))
    profile = profiles.load(os.environ["MIRAGE_PROFILE"])
    apps = {"pid": ("pid", ""), "process_name": ("process_name", ""), "name": ("process_name", ""),
            "used_memory": ("used_gpu_memory", "MiB"), "used_gpu_memory": ("used_gpu_memory", "MiB"),
            "gpu_uuid": ("gpu_uuid", ""), "gpu_bus_id": ("gpu_bus_id", ""), "gpu_name": ("gpu_name", "")}
    query = args.query_gpu or args.query_compute_apps
    options = _format_options(args.format) if query else set()
    names = [n.strip() for n in query.split(",")] if query else []
    known = _nvidia_fields(profile, []) if args.query_gpu else apps
    for name in names:
        if name not in known:
            print(f'Field "{name}" is not a valid field to query.\n')
            return 2

    def app_value(name: str, gpu: Gpu, pid: int, used: int) -> str:
        return {"pid": str(pid), "process_name": process_name(pid), "used_gpu_memory": str(_mib(used)),
                "gpu_uuid": f"GPU-{gpu.uuid}", "gpu_bus_id": gpu.bus_id, "gpu_name": profile.torch_name}[apps[name][0]]

    def snapshot(gpus: list[Gpu], header: bool) -> str:
        shown = options if header else options | {"noheader"}  # a loop prints the CSV header once
        if args.list_gpus:
            return "\n".join(f"GPU {g.index}: {profile.torch_name} (UUID: GPU-{g.uuid})" for g in gpus)
        if args.query_gpu:
            fields = _nvidia_fields(profile, gpus)
            return _csv([[(n, fields[n][0], fields[n][1](g)) for n in names] for g in gpus],
                        [(n, fields[n][0]) for n in names], shown)
        if args.query_compute_apps:
            rows = [[(n, apps[n][1], app_value(n, g, pid, used)) for n in names] for g in gpus for pid, used in g.processes]
            return _csv(rows, [apps[n] for n in names], shown)
        return _nvidia_table(profile, gpus)

    first = True
    while True:
        try:
            gpus = _pick(node_gpus(profile), args.id)
        except LookupError:
            print("No devices were found")
            return 6
        text = snapshot(gpus, first)
        if text:
            print(text, flush=True)
        if args.loop is None:
            return 0
        first = False
        try:
            time.sleep(args.loop)
        except KeyboardInterrupt:
            return 0


# --- rocm-smi ---------------------------------------------------------------------------------

_ROCM_WIDTH = 122


def _banner(title: str, width: int = _ROCM_WIDTH) -> str:
    return f" {title} ".center(width, "=")


def _rocm_kfd_node(gpu: Gpu) -> int:
    return gpu.index + 2  # KFD numbers the CPU sockets first (nodes 0 and 1 on a two-socket host)


def _rocm_guid(gpu: Gpu) -> int:
    return 1000 + (gpu.index * 7919) % 64000


def _rocm_concise(profile: profiles.Profile, gpus: list[Gpu]) -> str:
    partitions = "N/A, N/A, 0" if profile.name == "mi250x" else "NPS1, SPX, 0"
    head = [("Device", ""), ("Node", ""), ("IDs", "(DID,     GUID)"), ("Temp", "(Junction)"), ("Power", "(Socket)"),
            ("Partitions", "(Mem, Compute, ID)"), ("SCLK", ""), ("MCLK", ""), ("Fan", ""), ("Perf", ""),
            ("PwrCap", ""), ("VRAM%", ""), ("GPU%", "")]
    rows = [[str(g.index), str(_rocm_kfd_node(g)), f"0x{profile.pci_product_id:x},   {_rocm_guid(g)}",
             f"{g.temperature_c:.1f}°C", f"{g.power_watts:.1f}W", partitions, f"{round(profile.clock_ghz * 1000)}Mhz",
             f"{profile.memory_clock_khz // 1000}Mhz", "0%", "auto", f"{profile.board_power_watts:.1f}W",
             f"{round(100 * g.used_bytes / profile.memory_bytes)}%", f"{g.utilization_percent}%"] for g in gpus]
    widths = [max(len(h[0]), len(h[1]), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([_banner("ROCm System Management Interface"), _banner("Concise Info"),
                      line([h[0] for h in head]), line([h[1] for h in head]), "=" * _ROCM_WIDTH,
                      *(line(r) for r in rows), "=" * _ROCM_WIDTH, _banner("End of ROCm SMI Log")])


def _rocm_sections(profile: profiles.Profile, gpus: list[Gpu], args: argparse.Namespace) -> list[tuple[str, list]]:
    """(section title, [(gpu, key, value)]) for each --show option asked, in rocm-smi's order."""
    sections = []
    if args.showid:
        sections.append(("ID", [(g, key, value) for g in gpus for key, value in (
            ("Device Name", profile.torch_name), ("Device ID", f"0x{profile.pci_product_id:x}"),
            ("Device Rev", "0x00"), ("Subsystem ID", "0x1002"), ("GUID", str(_rocm_guid(g))))]))
    if args.showuse:
        sections.append(("% time GPU is busy", [(g, "GPU use (%)", str(g.utilization_percent)) for g in gpus]))
    if args.showmeminfo:
        sections.append(("Memory Usage (Bytes)", [(g, key, str(value)) for g in gpus for key, value in (
            ("VRAM Total Memory (B)", profile.memory_bytes), ("VRAM Total Used Memory (B)", g.used_bytes))]))
    if args.showproductname:
        sections.append(("Product Info", [(g, key, value) for g in gpus for key, value in (
            ("Card Series", profile.torch_name), ("Card Model", f"0x{profile.pci_product_id:x}"),
            ("Card Vendor", "Advanced Micro Devices, Inc. [AMD/ATI]"), ("Card SKU", profile.name.upper()),
            ("Subsystem ID", "0x1002"), ("Device Rev", "0x00"), ("Node ID", str(_rocm_kfd_node(g))),
            ("GUID", str(_rocm_guid(g))), ("GFX Version", profile.arch))]))
    return sections


def _rocm_pids(gpus: list[Gpu], as_json: bool) -> int:
    """--showpids: each process using the GPUs (KFD's view), with how many it uses and its VRAM."""
    users: dict[int, list[int]] = {}  # pid -> [GPUs, bytes]
    for gpu in gpus:
        for pid, used in gpu.processes:
            entry = users.setdefault(pid, [0, 0])
            entry[0] += 1
            entry[1] += used
    if as_json:
        print(json.dumps({"system": {f"PID{pid}": f"{process_name(pid)}, {count}, {used}, 0, 0"
                                     for pid, (count, used) in users.items()}}))
        return 0
    lines = [_banner("ROCm System Management Interface", 90), _banner("KFD Processes", 90)]
    if users:
        lines += ["KFD process information:", "PID\tPROCESS NAME\tGPU(s)\tVRAM USED\tSDMA USED\tCU OCCUPANCY"]
        lines += [f"{pid}\t{process_name(pid)}\t{count}\t{used}\t0\t0" for pid, (count, used) in users.items()]
    else:
        lines.append("No KFD PIDs currently running")
    lines += ["=" * 90, _banner("End of ROCm SMI Log", 90)]
    print("\n".join(lines))
    return 0


def rocm_smi(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rocm-smi", add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("-d", "--device", nargs="+")
    parser.add_argument("-i", "--showid", action="store_true")
    parser.add_argument("-u", "--showuse", action="store_true")
    parser.add_argument("--showmeminfo", nargs="+", choices=["vram"])
    parser.add_argument("--showproductname", action="store_true")
    parser.add_argument("--showpids", action="store_true")
    parser.add_argument("--json", action="store_true")
    args, unknown = parser.parse_known_args(argv)
    if unknown or args.help:
        raise UsageError("this rocm-smi (mirage's, answered by the emulated GPUs) takes: no option (Concise "
                         "Info), -d ID..., --showid, --showuse, --showmeminfo vram, --showproductname, "
                         "--showpids and --json"
                         + (f"; not {' '.join(unknown)}" if unknown else ""))
    profile = profiles.load(os.environ["MIRAGE_PROFILE"])
    gpus = node_gpus(profile)
    if args.device:
        try:
            gpus = [gpus[int(d)] for d in args.device]
        except (ValueError, IndexError):
            print(f"ERROR: GPU[{args.device[0]}] : Invalid device")
            return 1
    if args.showpids:
        return _rocm_pids(gpus, args.json)
    sections = _rocm_sections(profile, gpus, args)
    if args.json:
        cards = {f"card{g.index}": {} for g in gpus}
        if not sections:
            sections = [("", [(g, key, value) for g in gpus for key, value in (
                ("Temperature (Sensor junction) (C)", f"{g.temperature_c:.1f}"),
                ("Current Socket Graphics Package Power (W)", f"{g.power_watts:.1f}"),
                ("GPU use (%)", str(g.utilization_percent)),
                ("GPU Memory Allocated (VRAM%)", str(round(100 * g.used_bytes / profile.memory_bytes))))])]
        for _, entries in sections:
            for gpu, key, value in entries:
                cards[f"card{gpu.index}"][key] = value
        print(json.dumps(cards))
        return 0
    if not sections:
        print(_rocm_concise(profile, gpus))
        return 0
    lines = [_banner("ROCm System Management Interface", 90)]
    for title, entries in sections:
        lines.append(_banner(title, 90))
        lines += [f"GPU[{gpu.index}]\t\t: {key}: {value}" for gpu, key, value in entries]
        lines.append("=" * 90)
    lines.append(_banner("End of ROCm SMI Log", 90))
    print("\n".join(lines))
    return 0


# --- amd-smi ----------------------------------------------------------------------------------

# `amd-smi monitor`'s default columns: (header, least width); each is right-aligned, two spaces apart.
_AMD_MONITOR_COLUMNS = [("GPU", 3), ("XCP", 3), ("POWER", 5), ("GPU_T", 6), ("MEM_T", 6), ("GFX_CLK", 8),
                        ("GFX%", 5), ("MEM%", 5), ("ENC%", 5), ("DEC%", 5), ("VRAM_USAGE", 14)]


def _amd_bdf(gpu: Gpu) -> str:
    return f"0000:{pci_bus(gpu.index):02x}:00.0"


def amd_smi(argv: list[str]) -> int:
    command = argv[0] if argv else None
    rest = argv[1:]
    if command not in ("list", "monitor") or rest not in ([], ["--json"]) or (command == "monitor" and rest):
        raise UsageError("this amd-smi (mirage's, answered by the emulated GPUs) takes `list [--json]` and "
                         "`monitor` (its default columns); rocm-smi answers the rest it emulates")
    profile = profiles.load(os.environ["MIRAGE_PROFILE"])
    gpus = node_gpus(profile)
    if command == "list":
        entries = [{"gpu": g.index, "bdf": _amd_bdf(g), "uuid": g.uuid, "kfd_id": _rocm_guid(g),
                    "node_id": _rocm_kfd_node(g), "partition_id": 0} for g in gpus]
        if rest:
            print(json.dumps(entries, indent=4))
        else:
            print("\n\n".join(f"GPU: {e['gpu']}\n" + "\n".join(f"    {key.upper()}: {e[key]}" for key in
                                                                  ("bdf", "uuid", "kfd_id", "node_id", "partition_id"))
                              for e in entries))
        return 0
    total_gb = profile.memory_bytes / 2**30  # amd-smi's "GB" are GiB (a 24 GiB board reads 24.0 GB)
    rows = [[str(g.index), "0", f"{round(g.power_watts)} W", f"{g.temperature_c} °C", f"{g.temperature_c} °C",
             f"{round(profile.clock_ghz * 1000)} MHz", f"{g.utilization_percent} %", f"{g.utilization_percent} %",
             "N/A", "N/A", f"{g.used_bytes / 2**30:.1f}/{total_gb:5.1f} GB"] for g in gpus]
    widths = [max(least, *(len(r[i]) for r in rows)) for i, (_, least) in enumerate(_AMD_MONITOR_COLUMNS)]
    print("  ".join(h.rjust(w) for (h, _), w in zip(_AMD_MONITOR_COLUMNS, widths)))
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    return 0


COMMANDS = {"nvidia-smi": nvidia_smi, "rocm-smi": rocm_smi, "amd-smi": amd_smi}


def main(command: str, argv: list[str]) -> int:
    """Runs one tool; a refused command line prints its reason to stderr and exits 2."""
    if command not in COMMANDS:
        print(f"{command}: run this as one of {', '.join(COMMANDS)} (the links in mirage/runtime/smi_bin)",
              file=sys.stderr)
        return 2
    if "MIRAGE_PROFILE" not in os.environ:
        print(f"{command}: mirage's {command} answers only inside a mirage session (`mirage run ...`)",
              file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](argv)
    except UsageError as error:
        print(f"{command}: {error}", file=sys.stderr)
        return 2
