"""Where a benchmark's figures are kept: beside the doc that quotes them, in docs/benchmarks/, one
JSON file per run named by script, time and commit, holding the command line, the commit (and
whether the tree had uncommitted changes), the date and the figures, so that a table in
docs/benchmarks.md can name the file it was copied from."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def save(figures: object) -> Path:
    """Writes this run's figures to docs/benchmarks/ and says where on stderr."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    now = datetime.datetime.now(datetime.timezone.utc)
    folder = REPO / "docs" / "benchmarks"
    folder.mkdir(exist_ok=True)
    path = folder / f"{Path(sys.argv[0]).stem}-{now:%Y%m%dT%H%M%SZ}-{commit}.json"
    path.write_text(json.dumps({"command": ["python", *sys.argv], "commit": commit,
                                "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
                                "date": now.isoformat(timespec="seconds"), "figures": figures}, indent=1) + "\n")
    print(f"figures saved to {path.relative_to(REPO)}", file=sys.stderr)
    return path
