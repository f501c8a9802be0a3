"""Faults on purpose: `mirage run --fault SPEC` (repeatable) and `--faults FILE.toml`.

    --fault kill:rank=3:at=collective:120      SIGKILL rank 3 as its 120th collective starts
    --fault kill:rank=1:at=op:5000             ... at its 5000th device op
    --fault oom:rank=2:at=alloc:40             its 40th device allocation fails with the
                                               caching allocator's out-of-memory error
    --fault stall:rank=5:at=collective:40:for=900s
                                               rank 5 holds its 40th collective for 900 s, so
                                               the peers' timeouts fire as on a cluster
    --fault lose-gpu:rank=1:at=op:300          rank 1's GPU falls off the bus at its 300th op: that op
                                               and every later one raise CUDA's "unknown error"
                                               (torch.AcceleratorError); its collectives fail with
                                               ncclUnhandledCudaError, and once it dies or aborts the
                                               peers' collectives fail with ncclRemoteError, which
                                               their watchdog turns into taking them down
    --fault kill:rank=2:at=after:30s           SIGKILL rank 2 (and its children) 30 s into the session
    --fault kill-node:node=1:at=after:30s      SIGKILL every process of emulated node 1 at once
                                               (its torchrun agent too), as a node that fails; the
                                               other nodes go on and find out as on a cluster
    --fault kill-node:node=1:at=after:30s:rejoin=10s
                                               ... and 10 s later node 1 starts its command again,
                                               as a rebooted node rejoins (elastic torchrun
                                               --nnodes=1:2 re-forms the world around it)
    --fault kill-node:node=1:at=collective:20  ... as node 1's first rank (its local rank 0)
                                               starts its 20th collective: a point in the job,
                                               not in time (rejoin= too)
    --fault kill:rank=0:at=collective:random --seed 7
                                               the count drawn from --seed (1-100)
    --fault slow-gpu:rank=3:factor=2           clocked mode (--timing): rank 3's GPU runs its kernels
                                               2x slower for the whole run (a straggler)
    --fault slow-link:nodes=0-1:factor=4       clocked mode: the links between emulated nodes 0 and 1
                                               carry 4x less (collectives spanning both pay it)

A FILE holds `[[fault]]` tables with the same keys (kind, rank, node, nodes, at, count, for, factor, rejoin). Every spec is
checked before the workload starts (exit 2, naming the fix); each fault fires once per session
(a worker torchrun restarts does not fire it again), is logged on stderr with its rank and
trigger, and is listed in the session summary. The work itself happens at the two choke points:
the shim's op path and allocator, and the emulated NCCL's collective (mirage/shim/faults.h).
A node cannot kill itself all at once (its torchrun agent is not in the collective), so at a
kill-node fault's collective the shim asks the launcher (NodeKiller) and waits to be killed.
"""

from __future__ import annotations

import difflib
import json
import os
import random
import signal
import threading
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from mirage.launcher.supervisor import session_processes

# What each kind of fault can be triggered by.
KINDS: dict[str, tuple[str, ...]] = {
    "kill": ("collective", "op", "alloc", "after"),
    "kill-node": ("after", "collective"),
    "stall": ("collective",),
    "oom": ("alloc",),
    "lose-gpu": ("op", "alloc", "collective"),
    "slow-gpu": ("start",),
    "slow-link": ("start",),
}
SLOW_KINDS = ("slow-gpu", "slow-link")  # clocked mode's: they change the predicted timeline only
RANDOM_RANGE = (1, 100)  # at=random draws the count from here


class FaultError(ValueError):
    """A fault spec that cannot work; the message names the fix."""


@dataclass(frozen=True)
class Fault:
    id: int
    kind: str
    rank: int                # -1 for kill-node
    trigger: str
    count: int               # the Nth collective / op / allocation (0 for at=after)
    stall_s: float = 0.0
    after_s: float = 0.0     # at=after: seconds into the session
    node: int = -1           # kill-node's node
    drawn: bool = False      # the count came from --seed (at=TRIGGER:random)
    factor: float = 1.0      # slow-gpu / slow-link: how many times slower
    rejoin_s: float = 0.0    # kill-node: seconds after the kill that the node starts again (0: never)
    link: tuple[int, int] = (-1, -1)  # slow-link's two nodes

    def describe(self) -> str:
        if self.kind == "slow-link":
            return f"slow-link between nodes {self.link[0]} and {self.link[1]}, {self.factor:g}x slower"
        if self.kind == "slow-gpu":
            return f"slow-gpu rank {self.rank}, {self.factor:g}x slower"
        who = f"node {self.node}" if self.kind == "kill-node" else f"rank {self.rank}"
        if self.trigger == "after":
            rejoin = f", rejoining {self.rejoin_s:g} s later" if self.rejoin_s else ""
            return f"{self.kind} {who} {self.after_s:g} s into the session{rejoin}"
        stall = f" for {self.stall_s:g} s" if self.kind == "stall" else ""
        if self.kind == "kill-node":
            rejoin = f", rejoining {self.rejoin_s:g} s later" if self.rejoin_s else ""
            return f"{self.kind} {who} at its first rank's {self.trigger} {self.count}{rejoin}"
        return f"{self.kind} {who} at its {self.trigger} {self.count}{stall}"


def _nearest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _number(spec: str, key: str, text: str, example: str, too_small: str, above: float = 0.0) -> float:
    """The number a key gives (a duration may end in 's'), more than `above`."""
    try:
        value = float(text[:-1] if text.endswith("s") else text)
    except ValueError:
        raise FaultError(f"fault '{spec}': {key}={text} is not a number; e.g. {example}") from None
    if not value > above:
        raise FaultError(f"fault '{spec}': {key}={text} {too_small}")
    return value


def _seconds(text: str, spec: str, key: str = "for") -> float:
    return _number(spec, key, text, f"{key}=900s", "must be a positive number of seconds")


def _target(fields: dict, key: str, limit: int, spec: str, example: str, there: str) -> int:
    """The fault's rank or node, in range."""
    try:
        value = int(fields[key])
    except (KeyError, ValueError):
        raise FaultError(f"fault '{spec}': say which {key}, e.g. {example}") from None
    if not 0 <= value < limit:
        raise FaultError(f"fault '{spec}': {key} {value} is out of range: {there}")
    return value


def _factor(fields: dict, spec: str) -> float:
    if "factor" not in fields:
        raise FaultError(f"fault '{spec}': say how many times slower, e.g. :factor=2")
    return _number(spec, "factor", str(fields["factor"]), "factor=2", "slows nothing; it must be more than 1", above=1.0)


def _build_slow(fields: dict, spec: str, index: int, world: int, nodes: int, clocked: bool) -> Fault:
    """slow-gpu / slow-link: from the start, in clocked mode only."""
    kind = fields["kind"]
    if not clocked:
        raise FaultError(f"fault '{spec}': {kind} slows the predicted timeline: it needs clocked mode (add --timing)")
    if fields.get("at", "start") != "start":
        raise FaultError(f"fault '{spec}': a {kind} fault lasts the whole run; leave out at= (or at=start)")
    factor = _factor(fields, spec)
    if kind == "slow-gpu":
        rank = _target(fields, "rank", world, spec, "slow-gpu:rank=0:factor=2",
                       f"this session has {world} GPU(s), ranks 0 to {world - 1}")
        return Fault(index, kind, rank, "start", 0, factor=factor)
    pair = str(fields.get("nodes", ""))
    try:
        a, b = (int(n) for n in pair.split("-"))
    except ValueError:
        raise FaultError(f"fault '{spec}': say which two nodes the link joins, e.g. slow-link:nodes=0-1:factor=4") from None
    if a == b or not (0 <= a < nodes and 0 <= b < nodes):
        raise FaultError(f"fault '{spec}': nodes={pair} is not a link between two of this session's {nodes} node(s) "
                         f"(0 to {nodes - 1}; more with --num-nodes)")
    return Fault(index, kind, -1, "start", 0, factor=factor, link=(min(a, b), max(a, b)))


def _build(fields: dict, spec: str, index: int, rng: random.Random, world: int, nodes: int, clocked: bool) -> Fault:
    kind = str(fields.get("kind", ""))
    if kind not in KINDS:
        raise FaultError(f"fault '{spec}': unknown kind '{kind}'{_nearest(kind, KINDS)}; the kinds are {', '.join(KINDS)}")
    keys = ["rank", "node", "nodes", "at", "count", "for", "factor", "rejoin"]
    unknown = set(fields) - {"kind", *keys}
    if unknown:
        key = sorted(unknown)[0]
        raise FaultError(f"fault '{spec}': unknown key '{key}'{_nearest(key, keys)}")
    if kind in SLOW_KINDS:
        return _build_slow(fields, spec, index, world, nodes, clocked)
    if "factor" in fields or "nodes" in fields:
        raise FaultError(f"fault '{spec}': factor= and nodes= apply to slow-gpu / slow-link faults only")
    if "rejoin" in fields and kind != "kill-node":
        raise FaultError(f"fault '{spec}': rejoin= applies to kill-node faults only (a node that comes back)")
    rank = node = -1
    if kind == "kill-node":
        node = _target(fields, "node", nodes, spec, "kill-node:node=0:at=after:30s",
                       f"this session has {nodes} node(s), 0 to {nodes - 1} (more with --num-nodes)")
    else:
        rank = _target(fields, "rank", world, spec, f"{kind}:rank=0:at={KINDS[kind][0]}:10",
                       f"this session has {world} GPU(s), ranks 0 to {world - 1} (more with --gpus-per-node / --num-nodes)")
    trigger = str(fields.get("at", ""))
    if trigger not in KINDS[kind]:
        example = f"node={node}:at=collective" if kind == "kill-node" else f"rank={rank}:at={KINDS[kind][0]}"
        raise FaultError(f"fault '{spec}': a fault of kind {kind} fires at={' or at='.join(KINDS[kind])}, not at={trigger or '?'}; "
                         f"e.g. {kind}:{example}:10")
    count = fields.get("count")
    rejoin = _seconds(str(fields["rejoin"]), spec, "rejoin") if "rejoin" in fields else 0.0
    if trigger == "after":
        if count is None:
            raise FaultError(f"fault '{spec}': at=after needs a time, e.g. at=after:30s")
        return Fault(index, kind, rank, trigger, 0, after_s=_seconds(str(count), spec, "at=after"), node=node,
                     rejoin_s=rejoin)
    drawn = count == "random"
    if drawn:
        count = rng.randint(*RANDOM_RANGE)
    try:
        count = int(count)
    except (TypeError, ValueError):
        raise FaultError(f"fault '{spec}': at={trigger} needs the count it fires at (or 'random'), "
                         f"e.g. at={trigger}:10") from None
    if count < 1:
        raise FaultError(f"fault '{spec}': it can never fire: counts start at 1 (the first {trigger} is 1)")
    stall_s = 0.0
    if kind == "stall":
        if "for" not in fields:
            raise FaultError(f"fault '{spec}': say how long the stall lasts, e.g. :for=900s")
        stall_s = _seconds(str(fields["for"]), spec)
    elif "for" in fields:
        raise FaultError(f"fault '{spec}': for= applies to stall faults only")
    return Fault(index, kind, rank, trigger, count, stall_s, node=node, drawn=drawn, rejoin_s=rejoin)


def parse_spec(spec: str) -> dict:
    """'kill:rank=3:at=collective:120' -> {kind, rank, at, count}; a bare token after at=X is its count."""
    parts = spec.split(":")
    fields: dict = {"kind": parts[0]}
    for part in parts[1:]:
        key, eq, value = part.partition("=")
        if eq:
            fields[key] = value
        elif "at" in fields and "count" not in fields:
            fields["count"] = part
        else:
            raise FaultError(f"fault '{spec}': '{part}' is not key=value; write e.g. kill:rank=3:at=collective:120")
    if fields.get("at") == "random":
        raise FaultError(f"fault '{spec}': write at=TRIGGER:random, e.g. kill:rank=0:at=collective:random")
    return fields


def load(specs: list[str], file: str | None, seed: int | None, world: int, nodes: int,
         clocked: bool = False) -> list[Fault]:
    """Every fault of the request, checked; raises FaultError naming the fix."""
    rng = random.Random(seed)
    entries: list[tuple[str, dict]] = [(spec, parse_spec(spec)) for spec in specs]
    if file:
        try:
            tables = tomllib.loads(Path(file).expanduser().read_text()).get("fault", [])
        except OSError as err:
            raise FaultError(f"--faults {file}: cannot read it ({err.strerror})") from None
        except tomllib.TOMLDecodeError as err:
            raise FaultError(f"--faults {file}: not TOML ({err})") from None
        if not tables:
            raise FaultError(f"--faults {file}: no [[fault]] tables (kind, rank, at, count, for)")
        entries += [(f"{file} [[fault]] {i + 1}", {k: str(v) if k != "count" else v for k, v in t.items()})
                    for i, t in enumerate(tables)]
    return [_build(fields, spec, i + 1, rng, world, nodes, clocked) for i, (spec, fields) in enumerate(entries)]


def environment(faults: list[Fault]) -> dict[str, str]:
    """What the processes read: MIRAGE_FAULTS, 'target:id,kind,trigger,count,stall_ms;...', the faults
    they count themselves (at=after is the launcher's, see FaultTimer), whose target is a RANK, or
    nN for node N's first rank (kill-node); MIRAGE_SLOW_GPUS
    'rank:factor,...' and MIRAGE_SLOW_LINKS 'a-b:factor,...' for clocked mode's cost model."""
    return {
        "MIRAGE_FAULTS": ";".join(f"{f'n{f.node}' if f.kind == 'kill-node' else f.rank}:"
                                  f"{f.id},{f.kind},{f.trigger},{f.count},{round(f.stall_s * 1000)}"
                                  for f in faults if f.trigger not in ("after", "start")),
        "MIRAGE_SLOW_GPUS": ",".join(f"{f.rank}:{f.factor}" for f in faults if f.kind == "slow-gpu"),
        "MIRAGE_SLOW_LINKS": ",".join(f"{f.link[0]}-{f.link[1]}:{f.factor}" for f in faults if f.kind == "slow-link"),
    }


def fire_at_start(folder: Path, faults: list[Fault], log) -> None:
    """The faults that hold from the start (slow-gpu, slow-link) fire as the session starts."""
    for fault in faults:
        if fault.trigger == "start":
            _claim(folder, fault, os.getpid())
            log(f"fault {fault.id} injected: {fault.describe()}, from the start")


class FaultTimer(threading.Thread):
    """The launcher's half: faults at=after. At its time it SIGKILLs, all at once, every process
    of the session that is the rank (RANK=R in its environment: the rank and what it started) or
    the node (MIRAGE_NODE_RANK=N: the node's torchrun agent included), claims the fault's marker
    and logs it as the shim does. A killed node's processes are spared by the supervisor (the
    other nodes go on); with rejoin= the node's command starts again that much later."""

    def __init__(self, faults: list[Fault], session_id: str, folder: Path, started: float, log, supervisor) -> None:
        super().__init__(name="mirage-faults", daemon=True)
        after = [f for f in faults if f.trigger == "after"]
        # (seconds into the session, what happens, fault)
        self.events = sorted([(f.after_s, "kill", f) for f in after] +
                             [(f.after_s + f.rejoin_s, "rejoin", f) for f in after if f.rejoin_s],
                             key=lambda event: event[0])
        self.session_id, self.folder, self.started, self.log = session_id, folder, started, log
        self.supervisor = supervisor
        self.stopped = threading.Event()
        self.fired: set[int] = set()

    def run(self) -> None:
        for at, what, fault in self.events:
            if self.stopped.wait(max(0.0, self.started + at - time.time())):
                return
            if what == "rejoin":
                if fault.id not in self.fired:
                    continue  # its node was not killed (not started yet, or gone)
                self.log(f"fault {fault.id}: node {fault.node} rejoins, starting its command again")
                self.supervisor.rejoin_node(fault.node)
                continue
            key, value = ("MIRAGE_NODE_RANK", fault.node) if fault.kind == "kill-node" else ("RANK", fault.rank)
            victims = [pid for pid in session_processes(self.session_id) if _environ(pid).get(key) == str(value)]
            if not victims:
                continue  # not started yet or already gone: the fault did not fire
            _claim(self.folder, fault, victims[0])
            self.fired.add(fault.id)
            _kill_all(fault, victims, self.supervisor)
            who = f"node {fault.node} ({len(victims)} processes)" if fault.kind == "kill-node" else f"rank {fault.rank}"
            self.log(f"fault {fault.id} injected: SIGKILL on {who} {fault.after_s:g} s into the session")


KILL_NODE_PIPE = "kill-node"  # the FIFO in the session's faults folder through which a rank asks NodeKiller


class NodeKiller(threading.Thread):
    """The launcher's half of kill-node at=collective. The node's first rank counts its collectives
    (the shim, mirage/shim/faults.cpp); at the fault's it claims the fault, writes 'ID PID' to the
    FIFO folder/kill-node and waits there. This thread then SIGKILLs, all at once, every process of
    the session on that node (MIRAGE_NODE_RANK=N: its torchrun agent and every rank) and the
    asking process, as FaultTimer does for at=after; with rejoin= the node's command starts again
    that much later. A FIFO, not a signal to the launcher: the request names its fault and its
    process, and a rank in a container of the node (--image) reaches it through the session folder."""

    def __init__(self, faults: list[Fault], session_id: str, folder: Path, log, supervisor) -> None:
        super().__init__(name="mirage-node-killer", daemon=True)
        self.faults = {f.id: f for f in faults if f.kind == "kill-node" and f.trigger == "collective"}
        self.session_id, self.log, self.supervisor = session_id, log, supervisor
        pipe = folder / KILL_NODE_PIPE
        os.mkfifo(pipe, 0o600)
        # read and write: the FIFO never reads end-of-file between requests, and stop() wakes it
        self.fd = os.open(pipe, os.O_RDWR)
        self.rejoins: list[threading.Timer] = []

    def run(self) -> None:
        with open(self.fd, "rb", closefd=False) as requests:
            for line in requests:
                fields = line.split()
                if fields == [b"stop"]:
                    return
                fault, pid = self.faults[int(fields[0])], int(fields[1])
                victims = sorted({pid, *(p for p in session_processes(self.session_id)
                                         if _environ(p).get("MIRAGE_NODE_RANK") == str(fault.node))})
                _kill_all(fault, victims, self.supervisor)
                self.log(f"fault {fault.id}: SIGKILL on node {fault.node} ({len(victims)} processes), "
                         f"asked by its first rank at its collective {fault.count}")
                if fault.rejoin_s:
                    rejoin = threading.Timer(fault.rejoin_s, self._rejoin, (fault,))
                    rejoin.daemon = True
                    self.rejoins.append(rejoin)
                    rejoin.start()

    def _rejoin(self, fault: Fault) -> None:
        self.log(f"fault {fault.id}: node {fault.node} rejoins, starting its command again")
        self.supervisor.rejoin_node(fault.node)

    def stop(self) -> None:
        """Once the job is over: no request is served and no node rejoins any more."""
        os.write(self.fd, b"stop\n")
        self.join()
        for rejoin in self.rejoins:
            rejoin.cancel()
        os.close(self.fd)


def _kill_all(fault: Fault, victims: list[int], supervisor) -> None:
    """SIGKILL on every victim at once; a node's are spared by the supervisor (the job goes on)."""
    if fault.kind == "kill-node":
        supervisor.spare(victims, rejoin=fault.rejoin_s > 0)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _claim(folder: Path, fault: Fault, pid: int) -> None:
    """The marker the shim writes when it fires a fault, written by the launcher for at=after."""
    with open(folder / str(fault.id), "x") as marker:
        marker.write(json.dumps({"id": fault.id, "kind": fault.kind, "rank": fault.rank, "trigger": fault.trigger,
                                 "count": fault.count, "pid": pid, "time": time.time()}) + "\n")


def fired(folder: Path, faults: list[Fault], started: float) -> list[dict]:
    """What the summary lists: every fault, whether and when it fired (seconds into the session)."""
    out = []
    for fault in faults:
        marker = folder / str(fault.id)
        entry = {**asdict(fault), "description": fault.describe(), "fired": marker.exists()}
        if entry["fired"]:
            try:
                seen = json.loads(marker.read_text())
                entry.update(pid=seen["pid"], at_s=round(seen["time"] - started, 3))
            except (OSError, ValueError, KeyError):
                pass
        out.append(entry)
    return out


def effects(folder: Path, faults: list[dict], started: float) -> dict:
    """What the faults did, from the ranks' own record (the shim's folder/observed): which rank saw
    which error (first time each, seconds into the session), how many times torchrun restarted
    the workers, and the downtime: from each fault to the first worker of the next attempt."""
    errors: dict[tuple, dict] = {}
    attempt_starts: dict[int, float] = {}
    try:
        lines = (folder / "observed").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            seen = json.loads(line)
        except ValueError:
            continue  # a line a killed process left half-written
        if seen["event"] == "start":
            attempt_starts[seen["restart"]] = min(attempt_starts.get(seen["restart"], seen["time"]), seen["time"])
        else:
            errors.setdefault((seen["rank"], seen["detail"], seen["restart"]), {
                "rank": seen["rank"], "restart": seen["restart"], "error": seen["detail"],
                "at_s": round(seen["time"] - started, 3)})
    fired_at = sorted(started + f["at_s"] for f in faults if f.get("at_s") is not None)
    downtime = 0.0
    for attempt, first_start in attempt_starts.items():
        before = [t for t in fired_at if t < first_start]
        if attempt > 0 and before:
            downtime += first_start - before[-1]
    return {"errors": sorted(errors.values(), key=lambda e: (e["at_s"], e["rank"])),
            "restarts": max(attempt_starts, default=0), "downtime_s": round(downtime, 3)}
