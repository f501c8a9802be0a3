"""Calibration on a real GPU: the same micro-benchmarks and small training step, measured there
and predicted by clocked mode, side by side.

    # here (no GPU), once per profile: the predictions, by running the benchmarks under mirage
    python bench/calibrate.py --predict --profile h200          # writes bench/predictions/h200.json
    # on the real GPU (CUDA or ROCm build of the same torch, no mirage): measure and compare
    python bench/calibrate.py --profile h200 [--write-tuning h200-tuning.toml]

The benchmarks time themselves with CUDA events, so under `mirage run --timing` they report the
prediction and on a GPU the measurement. --write-tuning turns the measurements into a
--timing-tuning file (GEMM efficiency, memory efficiency on and off the vectorized path, a
kernel's fixed cost) marked "measured" with the GPU's
name and the date. Takes about a minute on a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

PREDICTIONS = Path(__file__).with_name("predictions")
GEMMS = [(1024, "bfloat16"), (4096, "bfloat16"), (8192, "bfloat16"), (8192, "float16"), (4096, "float32")]
STREAM_BYTES = 1 << 30


def timed(fn, repeats: int) -> float:
    """Milliseconds per call of fn, by CUDA events around `repeats` calls after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def benchmarks(quick: bool) -> dict:
    """The micro-benchmarks (quick: one repeat each, as the predictions need no averaging)."""
    import torch

    repeats = 1 if quick else 20
    results = {}
    predicting = quick and hasattr(torch.ops, "mirage")  # under mirage: the large kernels from the model alone
    for n, dtype in GEMMS:
        if predicting:  # (an 8192^3 GEMM executed on a CPU takes minutes; its prediction does not need it)
            ms = torch.ops.mirage.clock_predict_gemm_ns(n, n, n, getattr(torch, dtype)) / 1e6
        else:
            a = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
            b = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
            ms = timed(lambda: a @ b, repeats)
            del a, b
        results[f"gemm {n} {dtype}"] = {"ms": ms, "tflops": 2 * n**3 / ms / 1e9}
    if predicting:
        ms = torch.ops.mirage.clock_predict_stream_ns(2 * STREAM_BYTES) / 1e6
    else:
        x = torch.empty(STREAM_BYTES // 4, device="cuda")
        y = torch.empty_like(x)
        ms = timed(lambda: y.copy_(x), repeats)
    results["copy 1 GiB"] = {"ms": ms, "gbs": 2 * STREAM_BYTES / ms / 1e6}
    # the same bytes off PyTorch's vectorized path: a copy from every other column of a wider tensor
    wide = torch.empty(1 << 13, 1 << 16, device="cuda")
    out = torch.empty(1 << 13, 1 << 15, device="cuda")
    ms = timed(lambda: out.copy_(wide[:, ::2]), repeats)
    results["strided copy 1 GiB"] = {"ms": ms, "gbs": 2 * STREAM_BYTES / ms / 1e6}
    del wide, out
    small = torch.empty(1, device="cuda")
    results["tiny kernel"] = {"ms": timed(lambda: small.add_(1), 50 if quick else 1000)}
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(4)]).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        model(batch).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    results["train step (4 x Linear 2048, batch 256, bf16, AdamW)"] = {"ms": timed(step, 2 if quick else 20)}
    return results


def predict_and_save(mirage_flags: list[str], script: list[str], saved: Path) -> int:
    """Run `script` (a bench script and its arguments) under `mirage run --quiet --gpus-per-node 1
    MIRAGE_FLAGS` and save what it prints after "RESULTS " to `saved`: the prediction a real GPU's
    measurement is later set against."""
    run = subprocess.run([sys.executable, "-m", "mirage", "run", "--quiet", "--gpus-per-node", "1", *mirage_flags,
                          "--", sys.executable, *script], capture_output=True, text=True, timeout=1800)
    line = next((l for l in run.stdout.splitlines() if l.startswith("RESULTS ")), None)
    if run.returncode != 0 or line is None:
        print(run.stdout[-2000:] + run.stderr[-3000:], file=sys.stderr)
        return 1
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(json.loads(line[8:]), indent=1) + "\n")
    print(f"prediction for {Path(script[0]).name} on {mirage_flags[mirage_flags.index('--profile') + 1]} "
          f"written to {saved}")
    return 0


def measuring_a_gpu(script: str, profile: str, saved: Path) -> bool:
    """Whether this process can measure what `script` predicted into `saved`: a real GPU (no mirage
    session) and the saved prediction. If not, says what to run instead."""
    import torch

    name = f"bench/{Path(script).name}"
    if not torch.cuda.is_available() or os.environ.get("MIRAGE_SESSION"):
        print(f"{name} measures a real GPU: run it on one (without mirage), or use --predict here", file=sys.stderr)
        return False
    if not saved.exists():
        print(f"no prediction for {profile} ({saved}); make it first: python {name} --predict --profile {profile}",
              file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="the mirage profile of this GPU (h100, h200, mi300x, ...)")
    ap.add_argument("--predict", action="store_true", help="predict with mirage (no GPU needed) and save the figures")
    ap.add_argument("--write-tuning", metavar="PATH", help="write the measurements as a --timing-tuning file")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        print("RESULTS " + json.dumps(benchmarks(quick=True)))
        return 0
    saved = PREDICTIONS / f"{args.profile}.json"
    if args.predict:
        return predict_and_save(["--in-process", "--timing", "--profile", args.profile],
                                [__file__, "--profile", args.profile, "--inner"], saved)
    if not measuring_a_gpu(__file__, args.profile, saved):
        return 2
    import torch

    predicted = json.loads(saved.read_text())
    measured = benchmarks(quick=False)
    name = torch.cuda.get_device_name(0)
    print(f"{name} (torch {torch.__version__}) against mirage's {args.profile} profile")
    print(f"{'benchmark':<56} {'measured ms':>12} {'predicted ms':>13} {'error':>8}")
    for key, m in measured.items():
        p = predicted.get(key)
        error = f"{100 * (p['ms'] - m['ms']) / m['ms']:+.1f}%" if p else "-"
        print(f"{key:<56} {m['ms']:>12.4f} {(p or {}).get('ms', float('nan')):>13.4f} {error:>8}")
    print("JSON " + json.dumps({"device": name, "torch": torch.__version__, "measured": measured, "predicted": predicted}))
    if args.write_tuning:
        from mirage import profiles

        model = {n.key: n.value for n in profiles.timing_numbers(profiles.load(args.profile))}
        stamp = f"bench/calibrate.py on {name}, {datetime.date.today().isoformat()}"
        peak = model["peak_tflops.bf16"]
        gemm = max(measured[f"gemm {n} bfloat16"]["tflops"] for n, d in GEMMS if d == "bfloat16") / peak
        memory = measured["copy 1 GiB"]["gbs"] / model["memory_bandwidth_gbs"]
        general = measured["strided copy 1 GiB"]["gbs"] / model["memory_bandwidth_gbs"]
        tiny = measured["tiny kernel"]["ms"] * 1e3
        Path(args.write_tuning).write_text(
            f'gemm_efficiency = {{ value = {gemm:.4f}, kind = "measured", source = "{stamp}: best bf16 GEMM" }}\n'
            f'memory_efficiency = {{ value = {memory:.4f}, kind = "measured", source = "{stamp}: 1 GiB copy" }}\n'
            f'memory_efficiency_general = {{ value = {general:.4f}, kind = "measured", '
            f'source = "{stamp}: 1 GiB copy from a strided view" }}\n'
            f'kernel_overhead_us = {{ value = {tiny:.3f}, kind = "measured", source = "{stamp}: back-to-back tiny kernels" }}\n')
        print(f"tuning written to {args.write_tuning}: mirage run --timing --timing-tuning {args.write_tuning} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
