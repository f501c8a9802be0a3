"""Every public torch.cuda name, called first thing in a fresh process, does what
docs/torch-cuda.md says: the rows marked `works` return, every other row raises the error the
table quotes (a real box's own error, or a documented difference)."""

import json
import re

from conftest import REPO, mirage

ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<outcome>[^|]+?) \| (?:`(?P<error>(?:[^`\\]|\\.)*)`)? ?\|")


def documented() -> dict[str, tuple[str, str]]:
    table = {}
    for line in (REPO / "docs" / "torch-cuda.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            table[match["name"]] = (match["outcome"].strip(), (match["error"] or "").replace("\\|", "|"))
    return table


def test_every_public_name_behaves_as_docs_torch_cuda_md_says(tmp_path):
    # In a scratch directory: some calls write files where they run (TunableOp's gathered results).
    result = mirage("run", "--gpus-per-node", "2", "--workdir", str(tmp_path), "--", "python",
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
        elif outcome != "works" and (row["outcome"] != "raised" or row["error"] != error):
            mismatches.append(f"{name}: documented to raise {error!r}, got {row['outcome']}: {row['error']!r}")
    assert not mismatches, "\n".join(mismatches)
