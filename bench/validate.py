"""Validation: clocked mode's predictions against published measurements (bench/validation_cases.toml).

    python bench/validate.py [--write docs/validation.md] [--run-e2e all | ID ...]

For each case it asks the model of the case's profile (in a `mirage run --timing --profile P`
process, with the case's tuning where its system differs from the profile, e.g. its NIC) for the
predicted time of the same GEMM, fused attention, streaming kernel or collective (or how much
slower a GEMM runs beside a collective), turns it into the unit the source
reports (TFLOP/s, GB/s, nccl-tests busbw) and prints the error. `module` cases run an eager
PyTorch module (bench/eager_modules.py) under `--predict-only` and time it with CUDA events as
its source did (ms: a negative error is a prediction too fast), and `module_memory` cases its
peak memory allocated over a forward and backward (the allocator model against the published
peak). Cases in the calibration set are
those the profiles' [timing] numbers were taken from; the held-out set's median error is the
figure of merit. Runs in about a minute: nothing is computed on this machine but the model.

`--run-e2e` first reruns end-to-end rows (bench/e2e_runs.py: `all` is every row predicted
before, about an hour on 2 cores) and records their predictions in validation_cases.toml, so
`python bench/validate.py --run-e2e all --write docs/validation.md` regenerates both sets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = Path(__file__).with_name("validation_cases.toml")
KIND = {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 2, "broadcast": 3, "all_to_all": 7}
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n}


def predict(cases: list[dict]) -> list[float]:
    """Inside mirage: each case's prediction in its source's unit."""
    import torch

    out = []
    for case in cases:
        if case["kind"] in ("module", "module_memory"):
            from eager_modules import peak_mib, time_ms  # bench/eager_modules.py, beside this script

            if case["kind"] == "module":
                out.append(time_ms(case["module"], case["size"], case["mode"]))  # ms
            else:
                out.append(peak_mib(case["module"], case["size"]))  # MiB
        elif case["kind"] == "gemm":
            # "tf32": a float32 GEMM with TF32 allowed (torch.backends.cuda.matmul.allow_tf32), as the source ran it
            torch.backends.cuda.matmul.allow_tf32 = case["dtype"] == "tf32"
            dtype = torch.float32 if case["dtype"] == "tf32" else getattr(torch, case["dtype"])
            ns = torch.ops.mirage.clock_predict_gemm_ns(case["m"], case["n"], case["k"], dtype)
            torch.backends.cuda.matmul.allow_tf32 = False
            out.append(2 * case["m"] * case["n"] * case["k"] / ns / 1e3)  # TFLOP/s
        elif case["kind"] == "overlap":
            shape = (case["m"], case["n"], case["k"], getattr(torch, case["dtype"]))
            beside = torch.ops.mirage.clock_predict_gemm_beside_collective_ns(*shape)
            out.append(beside / torch.ops.mirage.clock_predict_gemm_ns(*shape))  # x slower beside a collective
        elif case["kind"] == "stream":
            out.append(case["bytes"] / torch.ops.mirage.clock_predict_stream_ns(case["bytes"]))  # GB/s
        elif case["kind"] == "attention":
            b, h, s, d, causal = case["batch"], case["heads"], case["seq"], case["head_dim"], case["causal"]
            passes = {"forward": (False,), "backward": (True,), "forward+backward": (False, True)}[case.get("pass", "forward")]
            implementation = case.get("implementation", "flash-attn")  # flash-attn's FlashAttention-2 unless named
            ns = sum(torch.ops.mirage.clock_predict_attention_ns(b, h, s, d, causal, getattr(torch, case["dtype"]), backward,
                                                                 implementation)
                     for backward in passes)
            forward_flops = 4 * b * h * s * s * d / (2 if causal else 1)  # FlashAttention's count
            out.append(sum(2.5 if backward else 1.0 for backward in passes) * forward_flops / ns / 1e3)  # TFLOP/s
        else:
            ns = torch.ops.mirage.clock_predict_collective_ns(KIND[case["op"]], case["bytes"], case["ranks"], case["nodes"])
            out.append(case["bytes"] * BUS_FACTOR[case["op"]](case["ranks"]) / ns)  # busbw GB/s
    return out


def run_predictions(cases: list[dict]) -> list[float]:
    """Groups the cases by profile and tuning, one mirage process each."""
    groups: dict[tuple, list[int]] = {}
    for i, case in enumerate(cases):
        groups.setdefault((case["profile"], json.dumps(case.get("tuning", {}), sort_keys=True),
                           case["kind"].startswith("module")), []).append(i)
    predicted = [0.0] * len(cases)
    with tempfile.TemporaryDirectory(prefix="mirage-validate-") as scratch:
        for (profile, tuning, modules), indices in groups.items():
            listing = Path(scratch) / "cases.json"
            listing.write_text(json.dumps([cases[i] for i in indices]))
            extra = []
            if json.loads(tuning):
                tuning_file = Path(scratch) / "tuning.toml"
                tuning_file.write_text("".join(f"{k} = {v}\n" for k, v in json.loads(tuning).items()))
                extra = ["--timing-tuning", str(tuning_file)]
            if modules:  # real modules: their kernels placed on the timeline, not run
                extra.append("--predict-only")
            result = subprocess.run(
                [sys.executable, "-m", "mirage", "run", "--quiet", "--in-process", "--timing", *extra, "--profile",
                 profile, "--gpus-per-node", "1", "--", sys.executable, __file__, "--predict", str(listing)],
                capture_output=True, text=True, cwd=REPO, timeout=300)
            if result.returncode != 0:
                raise SystemExit(f"validate: predicting {profile} failed:\n{result.stderr[-3000:]}")
            values = json.loads(result.stdout.strip().splitlines()[-1])
            for i, value in zip(indices, values):
                predicted[i] = value
    return predicted


def describe(case: dict) -> str:
    if case["kind"] == "module":
        return f"eager {case['module'].replace('_', ' ')} {case['mode']}, size {case['size']}"
    if case["kind"] == "module_memory":
        return f"eager {case['module'].replace('_', ' ')} forward + backward, size {case['size']}: peak allocated"
    if case["kind"] == "gemm":
        return f"GEMM {case['m']}x{case['n']}x{case['k']} {case['dtype']}"
    if case["kind"] == "overlap":
        return f"GEMM {case['m']}x{case['n']}x{case['k']} {case['dtype']} beside a collective"
    if case["kind"] == "stream":
        return f"streaming kernel, {case['bytes'] / 2**20:.0f} MiB moved"
    if case["kind"] == "attention":
        return (f"attention {case.get('pass', 'forward')} {case['batch']}x{case['heads']}x{case['seq']}x{case['head_dim']} "
                f"{'causal' if case['causal'] else 'non-causal'} {case['dtype']}"
                f"{', PyTorch SDPA flash' if case.get('implementation') == 'pytorch' else ''}")
    where = f"{case['ranks']} GPUs" + (f", {case['nodes']} nodes" if case["nodes"] > 1 else "")
    return f"{case['op']} {case['bytes'] / 2**20:.0f} MiB, {where}"


UNIT = {"module": "ms", "module_memory": "MiB", "overlap": "x slower", "gemm": "TFLOP/s", "attention": "TFLOP/s", "stream": "GB/s", "collective": "busbw GB/s"}
DIGITS = {"overlap": 2, "module": 4, "module_memory": 1}  # the predicted figure's decimals
GROUP = {"module": "eager module", "module_memory": "eager module memory", "overlap": "overlap", "gemm": "gemm", "attention": "attention", "stream": "memory", "collective": "collective"}


def table(cases: list[dict], predicted: list[float]) -> tuple[str, dict]:
    rows = ["| id | set | profile | case | published | predicted | error | source |", "|---|---|---|---|---:|---:|---:|---|"]
    errors: dict[tuple[str, str], list[float]] = {}
    for case, value in zip(cases, predicted):
        error = (value - case["value"]) / case["value"]
        group = GROUP[case["kind"]]
        errors.setdefault((case["set"], group), []).append(abs(error))
        rows.append(f"| {case['id']} | {case['set']} | {case['profile']} | {describe(case)} | {case['value']:g} "
                    f"{UNIT[case['kind']]} | {value:.{DIGITS.get(case['kind'], 1)}f} | {100 * error:+.1f}% | {case['source']} |")
    summary = {f"{s} {g}": {"cases": len(e), "median_abs_error": statistics.median(e)} for (s, g), e in sorted(errors.items())}
    held = [abs((v - c["value"]) / c["value"]) for c, v in zip(cases, predicted) if c["set"] == "held-out"]
    summary["held-out all"] = {"cases": len(held), "median_abs_error": statistics.median(held)}
    return "\n".join(rows), summary


def e2e_table(rows: list[dict]) -> str:
    """The fixed end-to-end set as a table: configuration, published figures, where each row stands."""
    out = ["| id | trainer | GPUs | model | parallelism | seq x micro-batch x accum. | AC | precision | published tok/s/GPU "
           "| peak GiB | predicted tok/s/GPU | error | like for like | status |",
           "|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---|---|"]
    errors = []
    for r in rows:
        par = ", ".join(f"{k.upper()} {r[k]}" for k in ("fsdp", "dp", "tp", "pp", "cp") if r.get(k, 1) > 1) or "1 GPU"
        batch = f"{r['seq'] or 'varies'} x {r['micro_batch'] or '?'} x {r['accumulate'] or '?'}"
        precision = r["precision"] + (", compiled" if r["compile"] else "")
        like = ("yes" if r["like_for_like"] else "no") + (f": {r['note']}" if r.get("note") else "")
        status = r["status"] + (f"; previous: {r['previous']}" if r.get("previous") else "")
        predicted, error = r.get("predicted_tokens_per_s_per_gpu"), ""
        peak = f"{r.get('peak_memory_gib', '')}"
        if r.get("predicted_peak_memory_gib") and r.get("peak_memory_gib"):  # the prediction beside the published peak
            peak += (f" (predicted {r['predicted_peak_memory_gib']}, "
                     f"{100 * (r['predicted_peak_memory_gib'] / r['peak_memory_gib'] - 1):+.1f}%)")
        if predicted:
            error = f"{100 * (predicted / r['tokens_per_s_per_gpu'] - 1):+.1f}%"
            if r["like_for_like"]:
                errors.append(predicted / r["tokens_per_s_per_gpu"] - 1)
        out.append(f"| {r['id']} | {r['group']} | {r['gpus']}x {r['profile']} ({r['nodes']} node{'s' if r['nodes'] > 1 else ''}) "
                   f"| {r['model']} | {par} | {batch} | {r['ac']} | {precision} | {r['tokens_per_s_per_gpu']:,} "
                   f"| {peak} | {f'{predicted:,.0f}' if predicted else ''} | {error} | {like} | {status} |")
    like = [r for r in rows if r["like_for_like"]]
    summary = [f"\n\n{len(rows)} rows, {len(like)} like for like ({sum(r['nodes'] > 1 for r in like)} multi-node, "
               f"{sum(r['ac'] == 'none' for r in like)} without activation checkpointing); predicted so far: "
               + (f"{len(errors)} like-for-like rows, median |error| {100 * statistics.median(abs(e) for e in errors):.1f}%, "
                  f"{sum(e > 0 for e in errors)} of them optimistic" if errors else "none") + ". Sources:\n"]
    for publication in dict.fromkeys(r["source"][:40] for r in rows):
        members = [r for r in rows if r["source"][:40] == publication]
        common = os.path.commonprefix([r["source"] for r in members])
        common = common[:common.rfind(", ") if len(members) > 1 and ", " in common else len(common)]
        ids = members[0]["id"] + (f"-{members[-1]['id']}" if len(members) > 1 else "")
        summary.append(f"- {ids}: {common}")
    return "\n".join(out) + "\n".join(summary)


def write_block(path: Path, name: str, block: str) -> None:
    """Replaces the text between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in `path`."""
    text = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{block}\n{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", metavar="PATH", help="also write the table into this markdown file (between markers)")
    ap.add_argument("--run-e2e", nargs="+", metavar="ID",
                    help="rerun these end-to-end rows first (`all`: every row predicted before) and record them")
    ap.add_argument("--predict", metavar="CASES_JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.predict:
        print(json.dumps(predict(json.loads(Path(args.predict).read_text()))))
        return 0
    if os.environ.get("MIRAGE_SESSION"):
        print("bench/validate.py starts mirage itself: run it with plain python", file=sys.stderr)
        return 2
    if args.run_e2e:
        from e2e_runs import rerun  # bench/e2e_runs.py, beside this script

        if rerun(tomllib.loads(CASES.read_text())["e2e"], args.run_e2e):
            print("validate: some end-to-end rows failed (above); the others are recorded", file=sys.stderr)
    listed = tomllib.loads(CASES.read_text())
    cases = listed["case"]
    predicted = run_predictions(cases)
    rows, summary = table(cases, predicted)
    print(rows)
    for name, s in summary.items():
        print(f"{name:<24} {s['cases']:>3} cases, median |error| {100 * s['median_abs_error']:.1f}%")
    e2e = e2e_table(listed["e2e"])
    print(e2e)
    if args.write:
        lines = [f"- {name}: {s['cases']} cases, median |error| **{100 * s['median_abs_error']:.1f}%**"
                 for name, s in summary.items()]
        write_block(Path(args.write), "validate.py", f"{rows}\n\n" + "\n".join(lines))
        write_block(Path(args.write), "validate.py e2e", e2e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
