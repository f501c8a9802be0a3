"""Writes the tables of docs/conformance.md from the JSON results of distributed_suite.py runs.

    python tests/conformance/report.py docs/conformance/*.json

First one summary row per JSON (its file, the commit it tested, the counts, the wall time); then per
run: how many tests passed, failed, errored and were skipped, the wall time, every failure
and error with its reason, and the skips grouped by reason (the suite's own reasons: a test
for another backend, a ROCm build, more GPUs than the run has...).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def describe(path: Path) -> list[str]:
    run = json.loads(path.read_text())
    tests = run["tests"]
    counts = collections.Counter(t["outcome"] for t in tests.values())
    ran = len(tests) - counts["skipped"]
    lines = [f"### {run.get('label', path.stem)}", "",
             f"{len(tests)} tests: **{counts['passed']} passed**, {counts['failed']} failed, {counts['error']} errors, "
             f"{counts['skipped']} skipped ({counts['passed']}/{ran} of those that ran passed); wall time "
             f"{run['wall_s']:.0f} s.", ""]
    broken = sorted((name, t) for name, t in tests.items() if t["outcome"] in ("failed", "error"))
    if broken:
        lines += ["Failures and errors:", ""]
        lines += [f"- `{name}` ({t['outcome']}): {t.get('reason', '')}" for name, t in broken]
        lines.append("")
    reasons = collections.Counter(t.get("reason", "") for t in tests.values() if t["outcome"] == "skipped")
    if reasons:
        lines += ["Skips, by the suite's reason:", "", "| tests | reason |", "| ---: | --- |"]
        lines += [f"| {n} | {reason.replace('|', '/')} |" for reason, n in reasons.most_common()]
        lines.append("")
    return lines


def summary_row(path: Path) -> str:
    """One row of the summary table. A run records its commit (distributed_suite.py), and its JSON
    must carry that commit in its file name, so a rerun adds a row instead of overwriting one; runs
    from before 2026-12-04 recorded none and show "-"."""
    run = json.loads(path.read_text())
    commit = run.get("commit")
    if commit is not None and commit not in path.name:
        sys.exit(f"{path}: the run tested commit {commit}; name the file after it (e.g. {path.stem}-{commit}.json)")
    counts = collections.Counter(t["outcome"] for t in run["tests"].values())
    return (f"| {path.name} | {commit or '-'} | {counts['passed']} | {counts['failed']} | {counts['error']} | "
            f"{counts['skipped']} | {counts['expected_failure']} / {counts['unexpected_success']} / {counts['not_run']} | "
            f"{run['wall_s']:.0f} s |")


def main() -> None:
    paths = [Path(name) for name in sys.argv[1:]]
    out = ["| JSON | commit | passed | failed | errors | skipped | expected failures / unexpected successes / not run "
           "| wall time |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    out += [summary_row(path) for path in paths] + [""]
    for path in paths:
        out += describe(path)
    print("\n".join(out))


if __name__ == "__main__":
    main()
