"""Shared helpers for the host-side tests (those that start `mirage run` themselves).

Tests under tests/emulated/ are different: they run *inside* an emulated session (see
test_emulated_suite.py), so the host-side collection skips them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

if not os.environ.get("MIRAGE_SESSION"):
    collect_ignore = ["emulated"]


def mirage(*args: str, timeout: float = 600, input: str | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs `python -m mirage ARGS...` from the repository root and captures its output."""
    return subprocess.run(
        [sys.executable, "-m", "mirage", *args], cwd=REPO, capture_output=True, text=True,
        timeout=timeout, input=input, env=env,
    )


@pytest.fixture(scope="session")
def triton_path() -> Path:
    """triton for a workload's PYTHONPATH (tests/torchtitan_setup.py installs it once)."""
    import torchtitan_setup

    return torchtitan_setup.install_triton()


SWEEP_RESULTS = REPO / "docs" / "conformance" / "sweeps"


def record_sweep(name: str, summary: dict) -> None:
    """Writes a sweep's summary to docs/conformance/sweeps/NAME.json, the file docs/conformance.md
    quotes its counts from. Wall times are left out, so the file changes only when an outcome does."""
    SWEEP_RESULTS.mkdir(parents=True, exist_ok=True)
    kept = {key: value for key, value in summary.items() if key not in ("seconds", "elapsed_s")}
    (SWEEP_RESULTS / f"{name}.json").write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


def pytest_collection_modifyitems(config, items):
    """Slow scale tests run only with MIRAGE_SLOW_TESTS=1, so CI can keep a bounded set."""
    if os.environ.get("MIRAGE_SLOW_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: set MIRAGE_SLOW_TESTS=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
