"""PyTorch's own distributed conformance suite (DistributedTest, shipped in the wheel), driven as
PyTorch's test/distributed/test_distributed_spawn.py drives it: one TestCase that combines
TestDistBackend (which spawns WORLD_SIZE fresh ranks per test) with DistributedTest._DistTestBase.

Run it inside a session, e.g.

    mirage run --gpus-per-node 2 -- python tests/conformance/distributed_suite.py \\
        --backend nccl --world-size 2 --json results.json [-k PATTERN ...]

It prints unittest's report and, with --json, writes every test's outcome (passed, failed, error,
skipped, expected_failure, unexpected_success, with the reason; not_run for a test that never
reported) for docs/conformance.md. The spawned ranks import this file again
(as __mp_main__); the environment the suite reads at import is set by then.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import unittest


def _reserve_port() -> socket.socket:
    """A port for the suite's TCPStore, held for the whole run: bound here with SO_REUSEADDR and
    never listened on, it is not handed to anyone else who binds port 0, while the suite's rank 0
    (its TCPStore sets SO_REUSEADDR too) can still bind and listen on it, test after test."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    return held


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", help="write every test's outcome here")
    parser.add_argument("-k", action="append", default=[], help="run only tests whose name contains this")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiply the suite's per-test time limits (its default and its overrides)"
                             " by this: they are set for GPU kernels, and the emulated device computes"
                             " at the host CPU's speed, as PyTorch itself raises them for its slow"
                             " TSAN builds")
    return parser.parse_args()


if __name__ == "__main__":
    ARGS = _arguments()
    _scratch = tempfile.mkdtemp(prefix="dist-suite-")
    open(os.path.join(_scratch, "barrier"), "w").close()
    os.environ.update(BACKEND=ARGS.backend, WORLD_SIZE=str(ARGS.world_size), TEMP_DIR=_scratch,
                      MASTER_ADDR="127.0.0.1")
    _PORT = _reserve_port()
    os.environ["MASTER_PORT"] = str(_PORT.getsockname()[1])
    if ARGS.timeout_scale != 1.0:
        _default = int(os.environ.get("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "300"))
        os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(int(_default * ARGS.timeout_scale))

import torch  # noqa: E402  (the suite reads BACKEND and WORLD_SIZE when imported)
from torch.testing._internal import common_distributed  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def _reason(trace: str) -> str:
    """The line of a failure's report that says what went wrong: the last exception line (the
    suite re-raises a rank's failure with its traceback, then advice on reproducing it)."""
    lines = [line.split("] ", 1)[-1].strip() for line in trace.splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Failure)\b", line)]
    return errors[-1] if errors else lines[-1]


class _Outcomes(unittest.TextTestResult):
    """unittest's text result that also keeps every test's outcome by name: passed, failed, error,
    skipped, expected_failure, unexpected_success (a test that never reports stays "not_run")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict] = {}

    def _record(self, test, outcome: str, reason: str | None = None) -> None:
        self.outcomes[test._testMethodName] = {"outcome": outcome, **({"reason": reason} if reason else {})}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failed", _reason(self.failures[-1][1]))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", _reason(self.errors[-1][1]))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "expected_failure", _reason(self.expectedFailures[-1][1]))

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "unexpected_success")


def _commit() -> str:
    """The mirage commit the run tested (report.py requires it in the JSON's file name)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                          capture_output=True, text=True, check=True).stdout.strip()


def _run(args: argparse.Namespace) -> int:
    for name, seconds in common_distributed.TIMEOUT_OVERRIDE.items():
        common_distributed.TIMEOUT_OVERRIDE[name] = int(seconds * args.timeout_scale)
    names = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names)
    commit = _commit()  # before the run: a checkout without git fails now, not after an hour
    started = time.monotonic()
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout, resultclass=_Outcomes).run(suite)
    wall = time.monotonic() - started
    if args.json:
        outcomes = {n: result.outcomes.get(n, {"outcome": "not_run"}) for n in names}
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "world_size": args.world_size, "wall_s": round(wall, 1),
                       "commit": commit,
                       "timeout_scale": args.timeout_scale,
                       "tests": outcomes}, f, indent=1, sort_keys=True)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(_run(ARGS))
