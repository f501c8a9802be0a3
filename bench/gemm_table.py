"""Clocked mode's GEMM model against a published table of measured GEMM throughput.

    python bench/gemm_table.py TABLE_FILE [--gpu KEY=PROFILE ...]

XLA's GPU cost model ships tables of measured matmul throughput per GPU
(xla/service/gpu/model/matmul_interpolator_data.h in openxla/xla; ROCm/xla adds AMD's): for
each GPU key (sm_90: H100 SXM, sm_100_B200: B200, gfx942: MI300X, gfx950: MI355X) a grid of
batch x M x N x K GEMMs (batch 1-4, M, N, K 256-4096) with the FLOP/s XLA's profiler measured
(CUPTI kernel time, the median of five runs; tools/matmul_perf_table_gen.cc). The file is not
kept in this repository: fetch it from one of those repositories (the commit docs/validation.md
names) and pass its path.

For each GPU and its profile, the table's bf16 GEMMs (bf16 inputs and output) are predicted by
the model (the shim's clock_predict_gemm_ns inside `mirage run --timing`, as bench/validate.py
predicts its cases; a batch of b GEMMs as one of b x M rows) and compared: the median |error|
over every shape, its median signed error, and the same over the shapes whose output tiles fill
at least one wave (the sizes a training step's GEMMs have) and over those that do not.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import statistics
import sys
import tomllib
from pathlib import Path

from validate import run_predictions  # bench/validate.py: predictions in one mirage process per profile

PROFILES = Path(__file__).resolve().parent.parent / "mirage" / "profiles" / "data"
DEFAULT_GPUS = {"sm_90": "h100", "sm_100_B200": "b200", "gfx942": "mi300x", "gfx950": "mi355x"}
BF16 = "bf16xbf16->bf16"


def read_table(text: str) -> dict[str, list[dict]]:
    """The table's bf16 entries per GPU key: batch, m, n, k and the measured TFLOP/s. Both of the
    file's textproto layouts (one flops entry per line, or spread over lines) are read."""
    gpus: dict[str, list[dict]] = {}
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'key:\s*"((?:sm|gfx)\w*)"\s*value\s*\{', text)]
    for (start, key), (end, _) in zip(starts, starts[1:] + [(len(text), "")]):
        entries = gpus.setdefault(key, [])
        for entry in re.finditer(r"b:\s*(\d+)\s+m:\s*(\d+)\s+n:\s*(\d+)\s+k:\s*(\d+)(.*?)(?=\bb:\s*\d+\s+m:|\Z)",
                                 text[start:end], re.S):
            rates = dict(re.findall(r'flops\s*\{\s*key:\s*"([^"]+)"\s*value:\s*(\d+)\s*\}', entry.group(5)))
            rate = next((v for k, v in rates.items() if k.lower() == BF16), None)
            if rate is not None:
                b, m, n, k = map(int, entry.groups()[:4])
                entries.append({"batch": b, "m": m, "n": n, "k": k, "tflops": int(rate) / 1e12})
    return {key: entries for key, entries in gpus.items() if entries}


@functools.cache
def tiling(profile: str) -> tuple[int, int, int]:
    """The profile's GEMM tile (rows, columns) and its compute units."""
    data = tomllib.loads((PROFILES / f"{profile}.toml").read_text())
    return data["timing"]["gemm_tile_m"]["value"], data["timing"]["gemm_tile_n"]["value"], data["compute_units"]


def fills_a_wave(profile: str, shape: dict) -> bool:
    """Whether the GEMM's output tiles (the profile's tile) number at least its compute units."""
    tile_m, tile_n, units = tiling(profile)
    return shape["batch"] * math.ceil(shape["m"] / tile_m) * math.ceil(shape["n"] / tile_n) >= units


def summary(errors: list[float]) -> str:
    if not errors:
        return "none"
    return (f"{len(errors)} shapes, median |error| {100 * statistics.median(map(abs, errors)):.1f}%, "
            f"median {100 * statistics.median(errors):+.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", type=Path, help="matmul_interpolator_data.h (openxla/xla or ROCm/xla)")
    parser.add_argument("--gpu", action="append", default=[], metavar="KEY=PROFILE",
                        help="a table key and the profile that stands for it (default: "
                             + ", ".join(f"{k}={v}" for k, v in DEFAULT_GPUS.items()) + ")")
    args = parser.parse_args(argv)
    if not args.table.is_file():
        parser.error(f"{args.table} does not exist; fetch xla/service/gpu/model/matmul_interpolator_data.h "
                     "from openxla/xla or ROCm/xla")
    gpus = dict(DEFAULT_GPUS)
    for item in args.gpu:
        key, sep, profile = item.partition("=")
        if not sep or not (PROFILES / f"{profile}.toml").is_file():
            parser.error(f"--gpu {item}: give KEY=PROFILE with a profile of mirage/profiles/data")
        gpus[key] = profile
    table = read_table(args.table.read_text())
    for key, entries in table.items():
        profile = gpus.get(key)
        if profile is None:
            print(f"{key}: {len(entries)} shapes, no profile (pass --gpu {key}=PROFILE)")
            continue
        cases = [{"kind": "gemm", "profile": profile, "m": e["batch"] * e["m"], "n": e["n"], "k": e["k"],
                  "dtype": "bfloat16"} for e in entries]
        errors = [p / e["tflops"] - 1 for p, e in zip(run_predictions(cases), entries)]
        full = [x for x, e in zip(errors, entries) if fills_a_wave(profile, e)]
        under = [x for x, e in zip(errors, entries) if not fills_a_wave(profile, e)]
        print(f"{key} ({profile}): {summary(errors)}; a wave or more: {summary(full)}; under a wave: {summary(under)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
