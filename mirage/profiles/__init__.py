"""Device profiles: what an emulated GPU reports to torch, as data.

One TOML file per device under `data/` (figures and sources: docs/ and the files' comments).
A user's own file is accepted by path and checked field by field, so a typo names the field
instead of failing later inside the workload. The runtime reads the same files, so this module
must stay free of launcher imports.
"""

from __future__ import annotations

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
    peak_tflops: dict[str, float] = field(default_factory=dict)
    path: Path = Path()

    @property
    def is_amd(self) -> bool:
        return self.vendor == "amd"

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
    "peak_tflops": ((dict,), "a table of dtype = TFLOP/s"),
}


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
    if data["context_bytes"] < 0:
        raise bad("context_bytes")
    if not 1 <= data["gpus_per_node"] <= 64:
        raise bad("gpus_per_node")
    peaks = data["peak_tflops"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in peaks.values()):
        raise bad("peak_tflops")
    return Profile(
        **{**data, "compute_capability": tuple(capability), "peak_tflops": dict(peaks)},
        path=path,
    )


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
