"""The flight recorder: every rank's collectives, per process group, in order.

The emulated NCCL backend (mirage/nccl/flight_recorder.cpp), which every collective passes whoever
issues it (Python, DDP's reducer, FSDP), sends an entry when an operation starts ("enter") and
when it completes ("exit"): the group's name and communicator instance, sequence number, op,
dtype, shapes, bytes, reduce op. Entries are keyed by the communicator instance, not the group's
name: a group destroyed and created again under the same name, or the group '0' of each test of
a suite that spawns fresh ranks per test, starts a fresh sequence. The recorder compares the
ranks' collective entries at each sequence number (a different op, dtype or size is a desync,
reported at once, naming both ranks' calls; point-to-point entries are not compared, as ranks
send different things) and watches for stalls (ranks inside an operation longer than the hang
timeout: who waits where, and who never arrived and where they are now). Either report ends the
session (see the launcher).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

DESYNC_EXIT_CODE = 123
# Collectives whose tensors must be the same size on every rank (the others may differ: NCCL
# takes uneven all_gather / reduce_scatter lists and all_to_all splits, and a gather's root passes
# the only output list).
SAME_SIZE = {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}
HANG_EXIT_CODE = 124


def describe(entry: dict) -> str:
    return (f"{entry['name']}(dtype={entry.get('dtype')}, shapes={entry.get('shapes')}"
            + (f", op={entry['reduce_op']}" if entry.get("reduce_op") else "")
            + (f", peer={entry['peer']}" if entry.get("peer") is not None else "") + ")"
            + (f" from C++ during the backward pass at {entry['callsite']} (DDP's reducer or another C++ caller)"
               if entry.get("callsite") and entry.get("in_backward")
               else f" at {entry['callsite']}" if entry.get("callsite")
               else " from C++ (no Python caller: DDP's reducer or another C++ caller)"))


def _key(entry: dict) -> tuple[str, bool, int]:
    """An operation's identity across ranks: its communicator instance, kind and number."""
    return entry.get("instance", entry.get("group", "?")), bool(entry.get("p2p")), entry.get("seq", -1)


@dataclass
class FlightRecorder:
    """Per rank and group sequences; calls `on_failure(report, exit_code)` once."""

    hang_timeout: float
    on_failure: Callable[[str, int], None]
    locate: Callable[[int], str | None] = lambda rank: None  # a rank's current Python stack
    first_at: dict[tuple[str, bool, int], dict] = field(default_factory=dict)  # _key -> first rank's entry
    open_ops: dict[int, dict] = field(default_factory=dict)  # rank -> {_key: entry} not yet exited
    last: dict[int, dict] = field(default_factory=dict)  # rank -> its last entry
    counts: dict[int, list[int]] = field(default_factory=dict)  # rank -> [collectives, bytes]
    failed: bool = False
    checked_at: float = 0.0  # wall-clock time of the watch's last pass that found no hang
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        threading.Thread(target=self._watch, name="mirage-flight-recorder", daemon=True).start()

    def record(self, entry: dict) -> None:
        rank = entry.get("rank")
        if rank is None:
            return
        with self._lock:
            ops = self.open_ops.setdefault(rank, {})
            if entry.get("phase") == "exit":
                ops.pop(_key(entry), None)
                return
            entry["t"] = time.monotonic()
            ops[_key(entry)] = entry
            self.last[rank] = entry
            count = self.counts.setdefault(rank, [0, 0])
            count[0] += 1
            count[1] += int(entry.get("bytes", 0))
            if entry.get("p2p"):
                return
            first = self.first_at.setdefault(_key(entry), entry)
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

    def process_gone(self, pid: int) -> None:
        """A process left the session: what it had open no longer waits (a test harness that
        kills a timed-out test's ranks, then starts the next test's, must not read as a hang)."""
        with self._lock:
            for ops in self.open_ops.values():
                for key in [k for k, e in ops.items() if e.get("pid") == pid]:
                    del ops[key]

    def last_collective(self, rank: int | None) -> str | None:
        with self._lock:
            entry = self.last.get(rank) if rank is not None else None
        if entry is None:
            return None
        state = "waiting in" if any(e is entry for e in self.open_ops.get(rank, {}).values()) else "done"
        return (f"{state} #{entry['seq']} {entry['name']} (group '{entry['group']}')"
                + (f" at {entry['callsite']}" if entry.get("callsite") else ""))

    def watch_state(self) -> dict:
        """For the session's status (hang_watch): the hang timeout; when the watch last looked and
        found no hang (wall-clock seconds: an operation still open that began before checked_at
        minus timeout_s would have been reported by then); what each rank waits in now."""
        with self._lock:
            waiting = [{"rank": rank, "seq": entry.get("seq"), "op": entry.get("name"), "group": entry.get("group")}
                       for rank, ops in sorted(self.open_ops.items()) for entry in ops.values()]
            return {"timeout_s": self.hang_timeout, "checked_at": self.checked_at, "waiting": waiting}

    def _watch(self) -> None:
        while not self.failed:
            time.sleep(min(1.0, max(self.hang_timeout / 4, 0.05)))
            now, wall = time.monotonic(), time.time()
            with self._lock:
                # per rank, the operation it has waited in longest (its collectives and its p2p worker's)
                oldest_open = {r: min(ops.values(), key=lambda e: e["t"]) for r, ops in self.open_ops.items() if ops}
                stuck = {r: e for r, e in oldest_open.items() if now - e["t"] > self.hang_timeout}
                if not stuck and not self.failed:
                    self.checked_at = wall
                if not stuck or self.failed:
                    continue
                self.failed = True
                oldest = min(stuck.values(), key=lambda e: e["t"])
                if oldest.get("p2p"):  # a send or recv waits for its one peer
                    waiting, absent = [oldest["rank"]], [oldest["peer"]]
                else:
                    group_ranks = oldest.get("group_ranks") or sorted(self.last)
                    waiting = sorted(r for r, ops in self.open_ops.items() if _key(oldest) in ops)
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
