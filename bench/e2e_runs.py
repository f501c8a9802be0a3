"""Reruns the end-to-end set's predictions and records them in bench/validation_cases.toml.

    python bench/validate.py --run-e2e E02 E13 ...   (or `all`: every row that ran before)

A row of `[[e2e]]` is runnable when it says how: `command` (a `mirage run ...` line of
bench/e2e_gpt.py or bench/megatron_sc21.py, run from the repository root, whose rank 0 prints an
`E2E` line) or `case` (a case of bench/torchtitan_published.py, which runs unmodified torchtitan). The prediction, the
commit it ran at and what the run cost this machine replace the row's `predicted_*` and `status`
lines; the prediction they replace becomes its `previous`. A run that fails leaves the row as it
was and says why. Rows run one after another: each already uses the machine's cores.
"""

from __future__ import annotations

import datetime
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = Path(__file__).with_name("validation_cases.toml")
SCRIPT = re.compile(r"bench/\w+\.py")  # the script a row's command runs


def mirage_commit() -> str:
    """The commit the predictions run at, marked when the tree has changes beyond it."""
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=REPO).stdout.strip()
    return head + (" with uncommitted changes" if dirty else "")


def run_row(row: dict) -> dict:
    """Runs one row; its figures (tokens/s/GPU, peak memory GiB, step ms, wall s, host GiB, how),
    or {"error": why}."""
    began = time.monotonic()
    if "case" in row:
        command = [sys.executable, str(REPO / "bench" / "torchtitan_published.py"), "--cases", row["case"]]
    else:
        words = shlex.split(row["command"])
        if words[0] != "mirage":
            return {"error": f"its command does not start with mirage: {row['command']}"}
        command = [sys.executable, "-m", "mirage", *words[1:]]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    wall = time.monotonic() - began
    output = result.stdout + result.stderr
    if "case" in row:
        lines = [line for line in result.stdout.splitlines() if line.startswith('{"' + row["case"] + '"')]
        if not lines:
            return {"error": f"exit {result.returncode}: {output[-800:]}"}
        figures = json.loads(lines[-1])[row["case"]]
        if figures.get("exit") != 0:
            return {"error": figures.get("error", "")[-800:]}
        stand_ins = "".join(f", {flag} {figures[key]}" for key, flag in
                            (("stand_ins", "--stand-ins"), ("stand_ins_in_node", "--stand-ins-in-node")) if figures[key] > 1)
        return {"tokens": figures["tps_per_gpu"], "memory": figures["memory_gib"], "step_ms": figures["step_ms"],
                "wall_s": figures["wall_s"], "host_gib": figures["host_peak_gib"],
                "how": f"unmodified torchtitan 0.2.2, bench/torchtitan_published.py --cases {row['case']}{stand_ins}"}
    e2e = [line for line in output.splitlines() if "E2E {" in line]
    peak = re.findall(r"peak memory ([0-9.]+) GiB allocated", output)
    if result.returncode != 0 or not e2e:
        return {"error": f"exit {result.returncode}: {output[-800:]}"}
    figures = json.loads(e2e[0][e2e[0].index("{"):])
    return {"tokens": round(figures["tokens_per_s_per_gpu"], 1), "memory": float(peak[-1]) if peak else None,
            "step_ms": round(figures["step_ms"], 1), "wall_s": round(wall), "host_gib": None,
            "how": f"{SCRIPT.search(row['command']).group(0)}, its command"}


def record(text: str, row: dict, figures: dict, commit: str) -> str:
    """`text` (validation_cases.toml) with the row's prediction replaced by `figures`."""
    start = text.index(f'id = "{row["id"]}"\n')
    end = text.find("[[e2e]]", start)
    end = len(text) if end < 0 else end
    block = text[start:end]
    for key in ("status", "previous", "predicted_tokens_per_s_per_gpu", "predicted_peak_memory_gib"):
        block = re.sub(rf"^{key} = .*\n", "", block, flags=re.M)
    old = row.get("predicted_tokens_per_s_per_gpu")
    was = re.search(r"mirage ([0-9a-f]{7})", row.get("status", ""))
    cost = f"{figures['wall_s']} s" + (f" and {figures['host_gib']} GiB" if figures["host_gib"] else "")
    lines = [f'status = "predicted at mirage {commit} on {datetime.date.today()} by {figures["how"]} '
             f'({figures["step_ms"]} ms per step, {cost} on this machine; python bench/validate.py --run-e2e {row["id"]})"']
    if old:
        error = 100 * (old / row["tokens_per_s_per_gpu"] - 1)
        lines.append(f'previous = "{old:,.0f} tokens/s/GPU ({error:+.1f}%)' + (f' at mirage {was.group(1)}"' if was else '"'))
    lines.append(f"predicted_tokens_per_s_per_gpu = {float(figures['tokens'])}")
    if figures["memory"] is not None:
        lines.append(f"predicted_peak_memory_gib = {figures['memory']}")
    return text[:start] + block.rstrip("\n") + "\n" + "\n".join(lines) + "\n" + text[end:]


def rerun(rows: list[dict], wanted: list[str]) -> int:
    """Reruns the rows named in `wanted` (`all`: every row that has a prediction and says how to
    run); returns how many failed."""
    runnable = {r["id"]: r for r in rows if "case" in r or "command" in r}
    if wanted == ["all"]:
        wanted = [i for i, r in runnable.items() if r.get("predicted_tokens_per_s_per_gpu")]
    unknown = [i for i in wanted if i not in runnable]
    if unknown:
        raise SystemExit(f"validate: {', '.join(unknown)} cannot be rerun (not an [[e2e]] row with a command or a case); "
                         f"runnable: {', '.join(runnable)}")
    commit, failed = mirage_commit(), 0
    for done, rid in enumerate(wanted):
        print(f"[{done + 1}/{len(wanted)}] {rid} ...", flush=True)
        figures = run_row(runnable[rid])
        if "error" in figures:
            failed += 1
            print(f"{rid}: failed, left as it was: {figures['error']}", file=sys.stderr, flush=True)
            continue
        updated = CASES.with_suffix(".toml.new")  # replaced whole, so an interrupted run leaves the file intact
        updated.write_text(record(CASES.read_text(), runnable[rid], figures, commit))
        updated.replace(CASES)
        error = 100 * (figures["tokens"] / runnable[rid]["tokens_per_s_per_gpu"] - 1)
        print(f"{rid}: {figures['tokens']:,.0f} tokens/s/GPU ({error:+.1f}%), {figures['step_ms']} ms per step, "
              f"{figures['wall_s']} s", flush=True)
    return failed
