"""Runs the points of a plan: each one `mirage run --timing --predict-only` in a process of its
own, several at once, each result cached under its configuration.

* The same launcher as a user's run (a `python -m mirage run` subprocess), so a point predicts
  what that run would, and each point is a mirage session with its own teardown and reaper.
* The cache key is a digest of everything that decides a point's result: its `mirage run` flags
  as parsed (`--profile h100` given as a flag or set by an axis is the same point) and command,
  the working directory, the contents of the scripts and config files that command line names
  (grid.input_files) and of the profile's TOML, mirage's own sources and the native parts'
  build keys. A grid with one more axis value, or a new axis over what was a fixed flag, runs
  only the points it lacks; a changed script runs them all again. The caller's environment is
  not in it: what varies goes through --env.
* A killed plan leaves no session: each run is started with the kernel's parent-death signal set
  to SIGKILL (a run killed that way is reclaimed by its session's reaper, as any SIGKILLed
  `mirage run` is), SIGINT/SIGTERM/SIGHUP stop the runs with SIGTERM (a second signal kills
  them), and only a run that ended on its own is written to the cache, atomically.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import mirage
from mirage.plan.grid import Point, input_files
from mirage.shim import build as shim_build

CACHE_VERSION = 1  # bumped when an entry's layout changes
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)


def default_cache() -> Path:
    return shim_build.cache_root() / "plan"


def default_jobs() -> int:
    """Half the cores this process may use, and at most one run per 4 GiB of available memory
    (each point is a session of Python processes that import torch)."""
    cores = len(os.sched_getaffinity(0))
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = int(re.search(r"MemAvailable:\s+(\d+) kB", meminfo).group(1)) * 1024
    except (OSError, AttributeError):
        available = 0
    return max(1, min(cores // 2, available // (4 * 2**30)))


def _digest_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def mirage_digest() -> str:
    """mirage's sources (the timing model is Python and TOML as well as C++), this package's
    excepted (the plan's own code decides no prediction), with the native build keys."""
    root = Path(mirage.__file__).parent
    digest = hashlib.sha256(json.dumps(shim_build.build_identity(), sort_keys=True).encode())
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".toml", ".cpp", ".h") and "plan" not in path.relative_to(root).parts[:1]:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run_argv(point: Point, summary_path: str) -> list[str]:
    return [sys.executable, "-m", "mirage", "run", "--timing", "--predict-only", "--quiet",
            "--summary-json", summary_path, *point.flags, "--", *point.command]


def cache_key(point: Point, sources: str) -> str:
    named = input_files(point.flags, point.command) + [point.profile.path.resolve()]
    material = {"version": CACHE_VERSION, "options": point.options, "command": point.command,
                "python": sys.executable, "cwd": os.getcwd(),
                "files": {str(p): _digest_file(p) for p in sorted(set(named))}, "mirage": sources}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]


@dataclass
class Outcome:
    """What one point's run gave: its session summary, or why it did not run to the end."""
    exit_code: int
    summary: dict | None
    reason: str | None  # None when the point ran and predicted steps
    wall_s: float
    log: str
    cached: bool = False

    def to_json(self) -> dict:
        return {"exit_code": self.exit_code, "summary": self.summary, "reason": self.reason,
                "wall_s": self.wall_s, "log": self.log}


_RANK_PREFIX = re.compile(r"^(?:\[\w+\]:? ?)+")  # mirage's "[3] " and torch's "[rank3]: "
_ERROR_LINE = re.compile(r"^(?:[\w.]*(?:Error|Exception|Exit|Interrupt)(?:\[[^\]]*\])?(?::|$)|mirage: error:)"
                         r"|out of memory|Killed", re.I)
_BARE = re.compile(r"^[\w.]+$")  # an exception with no message: `assert x` raises AssertionError
_NOISE = re.compile(r"ChildFailedError|^torch\.distributed\.elastic|^mirage: \[\w+\] exited")
_MARKERS = re.compile(r"^[\s^~]*$")  # the ^^^^ under a traceback's code line


def failure_reason(log: str, exit_code: int) -> str:
    """The line that says why a run failed: each rank's last error line (a traceback's last line,
    an OutOfMemoryError, a mirage usage error; an exception with no message, such as a failed
    assert's, with the code line that raised it), and of those the one printed first (the rank
    that failed first; the others usually fail because it did). Else the workload's last line.
    mirage's timing report, which ends the log, is left out."""
    log = log.split("\nmirage: predicted timing on ", 1)[0]
    by_rank: dict[str, list[str]] = {}
    last_by_rank: dict[str, tuple[int, str]] = {}
    for number, raw in enumerate(log.splitlines()):
        prefix = _RANK_PREFIX.match(raw)
        rank = raw[:prefix.end()].split("]")[0] if prefix else ""
        line = raw[prefix.end() if prefix else 0:].strip()
        seen = by_rank.setdefault(rank, [])
        if _ERROR_LINE.search(line) and not _NOISE.search(line):
            if _BARE.match(line):
                code = next((earlier for earlier in reversed(seen) if not _MARKERS.match(earlier)), "")
                line += f" ({code})" if code and not code.startswith("File ") else ""
            last_by_rank[rank] = (number, line)
        seen.append(line)
    if last_by_rank:
        line = min(last_by_rank.values())[1]
    else:
        own = [line for lines in by_rank.values() for line in lines if line and not line.startswith("mirage:")]
        line = own[-1] if own else "no output"
    how = f"killed by signal {exit_code - 128}" if exit_code > 128 else f"exit code {exit_code}"
    return f"{how}: {line}"


def _outcome(exit_code: int, summary_path: Path, log_path: Path, wall_s: float) -> Outcome:
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError):
        summary = None
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    reason = None
    if exit_code != 0:
        reason = failure_reason(log, exit_code)
    elif not (summary or {}).get("timing", {}).get("job"):
        reason = ("no step was predicted: the program ran no optimizer step; mark each step with "
                  "torch.cuda.nvtx.mark('mirage.step')")
    return Outcome(exit_code, summary, reason, wall_s, str(log_path))


def load_cached(cache: Path, key: str) -> Outcome | None:
    try:
        entry = json.loads((cache / f"{key}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return Outcome(entry["exit_code"], entry["summary"], entry["reason"], entry["wall_s"], entry["log"], cached=True)


def _store(cache: Path, key: str, outcome: Outcome, point: Point) -> None:
    """Written to a temporary name and renamed: a plan killed mid-write leaves no half entry."""
    entry = outcome.to_json() | {"point": point.values, "argv": run_argv(point, "SUMMARY")[1:]}
    temporary = cache / f".{key}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(entry, indent=1))
    os.replace(temporary, cache / f"{key}.json")


def _die_with(parent: int) -> None:
    """preexec_fn of each run: SIGKILL when the plan's process ends, however it ends (the run's
    reaper then reclaims its session). The plan starts runs from its only thread, whose end is
    the process's."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the plan died before prctl took effect
        os._exit(1)


class Progress:
    """One line on stderr: a bar, counts and an ETA from the mean time of the runs so far (a line
    per finished point where stderr is no terminal)."""

    def __init__(self, total: int, cached: list[Outcome], jobs: int, stream=sys.stderr) -> None:
        self.total, self.done, self.jobs, self.stream = total, len(cached), jobs, stream
        self.cached, self.failed = len(cached), sum(outcome.reason is not None for outcome in cached)
        self.walls, self.started = [], time.monotonic()
        self.tty = stream.isatty()

    def finished(self, point: Point, outcome: Outcome) -> None:
        self.done += 1
        self.failed += outcome.reason is not None
        self.walls.append(outcome.wall_s)
        if not self.tty:
            state = "failed" if outcome.reason else "ok"
            print(f"mirage plan: [{self.done}/{self.total}] {point.label}: {state} ({outcome.wall_s:.1f} s), "
                  f"{self._eta()}", file=self.stream, flush=True)

    def _eta(self) -> str:
        left = self.total - self.done
        if not left:
            return f"done in {time.monotonic() - self.started:.0f} s"
        if not self.walls:
            return "ETA unknown until a run ends"
        seconds = sum(self.walls) / len(self.walls) * -(-left // self.jobs)
        return f"ETA {int(seconds // 60)}:{int(seconds % 60):02d}"

    def draw(self) -> None:
        if not self.tty:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        self.stream.write(f"\r\033[Kmirage plan: [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"({self.cached} cached, {self.failed} failed) {self._eta()}")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class _Running:
    point: Point
    key: str
    process: subprocess.Popen
    pidfd: int
    summary: Path
    log: Path
    started: float = field(default_factory=time.monotonic)


class Interrupted(Exception):
    """The plan was asked to stop (SIGINT, SIGTERM, SIGHUP); its runs are down, the cache kept."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_points(points: list[Point], cache: Path, jobs: int, retry_failed: bool) -> dict[int, Outcome]:
    """Every point's outcome by index: from the cache where it has one, else from a run."""
    cache.mkdir(parents=True, exist_ok=True)
    sources = mirage_digest()
    outcomes: dict[int, Outcome] = {}
    queue: list[tuple[Point, str]] = []
    for point in points:
        key = cache_key(point, sources)
        cached = load_cached(cache, key)
        if cached is not None and not (retry_failed and cached.reason):
            outcomes[point.index] = cached
        else:
            queue.append((point, key))
    progress = Progress(len(points), list(outcomes.values()), jobs)
    if queue:
        print(f"mirage plan: {len(queue)} of {len(points)} points to run ({len(outcomes)} cached in {cache}), "
              f"{jobs} at a time", file=sys.stderr, flush=True)
    else:
        print(f"mirage plan: all {len(points)} points cached in {cache}", file=sys.stderr, flush=True)
    stopping: list[int] = []
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    handlers = {sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    previous_wakeup = signal.set_wakeup_fd(wake_write)
    selector = selectors.DefaultSelector()
    selector.register(wake_read, selectors.EVENT_READ)
    running: list[_Running] = []
    try:
        queue.reverse()
        while (queue or running) and not stopping:
            while queue and len(running) < jobs:
                point, key = queue.pop()
                running.append(_start(point, key, cache, selector))
            progress.draw()
            for ready, _ in selector.select(timeout=1.0):
                if ready.fileobj == wake_read:
                    _drain(wake_read)
                    continue
                run = ready.data
                exit_code = _reap(run, selector, running)
                outcome = _outcome(exit_code, run.summary, run.log, time.monotonic() - run.started)
                run.summary.unlink(missing_ok=True)
                _store(cache, run.key, outcome, run.point)
                outcomes[run.point.index] = outcome
                progress.finished(run.point, outcome)
        if stopping:
            _stop(running, selector, stopping, wake_read)
            raise Interrupted(stopping[0])
    finally:
        for run in running:  # an exception of our own: no run outlives the plan
            run.process.kill()
            _reap(run, selector, [])
        selector.close()
        signal.set_wakeup_fd(previous_wakeup)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.close(wake_read)
        os.close(wake_write)
        progress.close()
    return outcomes


def _start(point: Point, key: str, cache: Path, selector: selectors.BaseSelector) -> _Running:
    summary, log = cache / f".{key}.{os.getpid()}.summary.json", cache / f"{key}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(run_argv(point, str(summary)), stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=lambda parent=os.getpid(): _die_with(parent))
    pidfd = os.pidfd_open(process.pid)
    run = _Running(point, key, process, pidfd, summary, log)
    selector.register(pidfd, selectors.EVENT_READ, run)
    return run


def _reap(run: _Running, selector: selectors.BaseSelector, running: list[_Running]) -> int:
    """The run's exit status as a shell reports it (128+N for signal N), once it has ended."""
    code = run.process.wait()
    selector.unregister(run.pidfd)
    os.close(run.pidfd)
    if run in running:
        running.remove(run)
    return 128 - code if code < 0 else code


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def _stop(running: list[_Running], selector: selectors.BaseSelector, stopping: list[int], wake_read: int) -> None:
    """SIGTERM to every run (each tears its session down and exits); a further signal to the
    plan kills them instead (their reapers reclaim the sessions). Nothing is cached."""
    print(f"\nmirage plan: {signal.Signals(stopping[0]).name}: stopping {len(running)} run(s) "
          "(again to kill them)", file=sys.stderr, flush=True)
    signals_seen = len(stopping)
    for run in running:
        run.process.send_signal(signal.SIGTERM)
    while running:
        for ready, _ in selector.select(timeout=1.0):
            if ready.fileobj == wake_read:
                _drain(wake_read)
            else:
                _reap(ready.data, selector, running)
                ready.data.summary.unlink(missing_ok=True)
        if len(stopping) > signals_seen:
            signals_seen = len(stopping)
            for run in running:
                run.process.kill()
