"""The flight recorder: every rank's collectives, per process group, in order.

Workload processes send an entry when a collective starts ("enter") and when it returns
("exit"): group, sequence number in that group, op, dtype, shapes, reduce op, call site.
Collectives issued from C++ (DDP's reducer) are entered only once they have slept a second in
the shim ("native" entries, group "<name> (C++ calls)"; see mirage/runtime/distributed.py). The
recorder compares the ranks' entries at each sequence number (a different op, dtype or size is
a desync, reported at once, naming both ranks and their call sites) and watches for stalls
(ranks inside a collective longer than the hang timeout: who waits where, and who never
arrived and where they last were). Either report ends the session (see the launcher).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

DESYNC_EXIT_CODE = 123
# Collectives whose tensors must be the same size on every rank (the others may differ:
# uneven all_to_all splits, a gather's root passing the only output list).
SAME_SIZE = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor"}
HANG_EXIT_CODE = 124


def describe(entry: dict) -> str:
    return (f"{entry['name']}(dtype={entry.get('dtype')}, shapes={entry.get('shapes')}"
            + (f", op={entry['reduce_op']}" if entry.get("reduce_op") else "")
            + f") at {entry.get('callsite', '?')}")


@dataclass
class FlightRecorder:
    """Per rank and group sequences; calls `on_failure(report, exit_code)` once."""

    hang_timeout: float
    on_failure: Callable[[str, int], None]
    locate: Callable[[int], str | None] = lambda rank: None  # a rank's current Python stack
    first_at: dict[tuple[str, int], dict] = field(default_factory=dict)  # (group, seq) -> entry
    inside: dict[int, dict] = field(default_factory=dict)  # rank -> entry it is waiting in
    last: dict[int, dict] = field(default_factory=dict)  # rank -> its last entry
    counts: dict[int, list[int]] = field(default_factory=dict)  # rank -> [collectives, bytes]
    failed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        threading.Thread(target=self._watch, name="mirage-flight-recorder", daemon=True).start()

    def record(self, entry: dict) -> None:
        rank = entry.get("rank")
        if rank is None:
            return
        with self._lock:
            if entry.get("phase") == "exit":
                waiting_in = self.inside.get(rank)
                # An exit that names its collective ends only that one (the runtime's watch of
                # C++-issued collectives, whose exit may trail a newer Python-level entry).
                if waiting_in and entry.get("group", waiting_in["group"]) == waiting_in["group"] \
                        and entry.get("seq", waiting_in["seq"]) == waiting_in["seq"]:
                    del self.inside[rank]
                return
            entry["t"] = time.monotonic()
            self.inside[rank] = entry
            self.last[rank] = entry
            if not entry.get("native"):  # seen only when it sleeps long: not counted in the summary
                count = self.counts.setdefault(rank, [0, 0])
                count[0] += 1
                count[1] += int(entry.get("bytes", 0))
            key = (entry["group"], entry["seq"])
            first = self.first_at.setdefault(key, entry)
            if first is not entry and not self.failed:
                compared = ("name", "dtype", "numel") if entry.get("name") in SAME_SIZE else ("name", "dtype")
                mismatch = [k for k in compared if first.get(k) != entry.get(k)]
                if mismatch:
                    self.failed = True
                    report = (
                        f"collective desync in group '{entry['group']}' at sequence number {entry['seq']} "
                        f"(different {', '.join('op' if k == 'name' else k for k in mismatch)}):\n"
                        f"  rank {first['rank']}: {describe(first)}\n"
                        f"  rank {rank}: {describe(entry)}")
                    threading.Thread(target=self.on_failure, args=(report, DESYNC_EXIT_CODE), daemon=True).start()

    def last_collective(self, rank: int | None) -> str | None:
        with self._lock:
            entry = self.last.get(rank) if rank is not None else None
        if entry is None:
            return None
        state = "waiting in" if self.inside.get(rank) is entry else "done"
        return f"{state} #{entry['seq']} {entry['name']} (group '{entry['group']}') at {entry.get('callsite', '?')}"

    def _watch(self) -> None:
        while not self.failed:
            time.sleep(min(1.0, max(self.hang_timeout / 4, 0.05)))
            now = time.monotonic()
            with self._lock:
                stuck = {r: e for r, e in self.inside.items() if now - e["t"] > self.hang_timeout}
                if not stuck or self.failed:
                    continue
                self.failed = True
                oldest = min(stuck.values(), key=lambda e: e["t"])
                group_ranks = oldest.get("group_ranks") or sorted(self.last)
                waiting = sorted(r for r, e in self.inside.items()
                                 if e["group"] == oldest["group"] and e["seq"] == oldest["seq"])
                absent = [r for r in group_ranks if r not in waiting]
                lines = [f"hang: ranks {waiting} have waited more than {self.hang_timeout:g} s in "
                         f"#{oldest['seq']} {describe(oldest)} (group '{oldest['group']}')"]
                for r in absent:
                    last = self.last.get(r)
                    where = describe(last) + f", sequence #{last['seq']}" if last else "none recorded yet"
                    lines.append(f"  rank {r} never arrived; its last collective: {where}")
            for r in absent:  # outside the lock: asking a rank for its stack takes a moment
                stack = self.locate(r)
                if stack:
                    lines.append(f"  rank {r} is now at:\n" + "\n".join(f"      {frame}" for frame in stack.splitlines()))
            threading.Thread(target=self.on_failure, args=("\n".join(lines), HANG_EXIT_CODE), daemon=True).start()
