"""Faults on purpose: `mirage run --fault SPEC` (repeatable) and `--faults FILE.toml`.

    --fault kill:rank=3:at=collective:120      SIGKILL rank 3 as its 120th collective starts
    --fault kill:rank=1:at=op:5000             ... at its 5000th device op
    --fault oom:rank=2:at=alloc:40             its 40th device allocation fails with the
                                               caching allocator's out-of-memory error
    --fault stall:rank=5:at=collective:40:for=900s
                                               rank 5 holds its 40th collective for 900 s, so
                                               the peers' timeouts fire as on a cluster
    --fault kill:rank=0:at=random --seed 7     the count drawn from --seed (1-100)

A FILE holds `[[fault]]` tables with the same keys (kind, rank, at, count, for). Every spec is
checked before the workload starts (exit 2, naming the fix); each fault fires once per session
(a worker torchrun restarts does not fire it again), is logged on stderr with its rank and
trigger, and is listed in the session summary. The work itself happens at the two choke points:
the shim's op path and allocator, and the emulated NCCL's collective (mirage/shim/faults.h).
"""

from __future__ import annotations

import difflib
import json
import random
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

# What each kind of fault can be triggered by.
KINDS: dict[str, tuple[str, ...]] = {
    "kill": ("collective", "op", "alloc"),
    "stall": ("collective",),
    "oom": ("alloc",),
}
RANDOM_RANGE = (1, 100)  # at=random draws the count from here


class FaultError(ValueError):
    """A fault spec that cannot work; the message names the fix."""


@dataclass(frozen=True)
class Fault:
    id: int
    kind: str
    rank: int
    trigger: str
    count: int
    stall_s: float = 0.0

    def describe(self) -> str:
        stall = f" for {self.stall_s:g} s" if self.kind == "stall" else ""
        return f"{self.kind} rank {self.rank} at its {self.trigger} {self.count}{stall}"


def _nearest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _seconds(text: str, spec: str) -> float:
    try:
        value = float(text[:-1] if text.endswith("s") else text)
    except ValueError:
        raise FaultError(f"fault '{spec}': for={text} is not a duration; write seconds, e.g. for=900s") from None
    if not value > 0:
        raise FaultError(f"fault '{spec}': for={text} must be a positive number of seconds")
    return value


def _build(fields: dict, spec: str, index: int, rng: random.Random, world: int) -> Fault:
    kind = str(fields.get("kind", ""))
    if kind not in KINDS:
        raise FaultError(f"fault '{spec}': unknown kind '{kind}'{_nearest(kind, KINDS)}; the kinds are {', '.join(KINDS)}")
    unknown = set(fields) - {"kind", "rank", "at", "count", "for"}
    if unknown:
        key = sorted(unknown)[0]
        raise FaultError(f"fault '{spec}': unknown key '{key}'{_nearest(key, ['rank', 'at', 'for'])}")
    try:
        rank = int(fields["rank"])
    except (KeyError, ValueError):
        raise FaultError(f"fault '{spec}': say which rank, e.g. {kind}:rank=0:at={KINDS[kind][0]}:10") from None
    if not 0 <= rank < world:
        raise FaultError(f"fault '{spec}': rank {rank} is out of range: this session has {world} GPU(s), "
                         f"ranks 0 to {world - 1} (more with --gpus-per-node / --num-nodes)")
    trigger = str(fields.get("at", ""))
    if trigger not in KINDS[kind]:
        raise FaultError(f"fault '{spec}': a fault of kind {kind} fires at={' or at='.join(KINDS[kind])}, not at={trigger or '?'}; "
                         f"e.g. {kind}:rank={rank}:at={KINDS[kind][0]}:10")
    count = fields.get("count")
    if count == "random":
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
    return Fault(index, kind, rank, trigger, count, stall_s)


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


def load(specs: list[str], file: str | None, seed: int | None, world: int) -> list[Fault]:
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
    return [_build(fields, spec, i + 1, rng, world) for i, (spec, fields) in enumerate(entries)]


def draws_at_random(specs: list[str], file: str | None) -> bool:
    """Whether any fault's count is 'random' (its draw then depends on the seed)."""
    texts = list(specs) + ([Path(file).expanduser().read_text()] if file else [])
    return any("random" in text for text in texts)


def environment(faults: list[Fault]) -> str:
    """MIRAGE_FAULTS as the shim reads it: 'rank:id,kind,trigger,count,stall_ms;...'."""
    return ";".join(f"{f.rank}:{f.id},{f.kind},{f.trigger},{f.count},{round(f.stall_s * 1000)}" for f in faults)


def fired(folder: Path, faults: list[Fault], started: float) -> list[dict]:
    """What the summary lists: every fault, whether and when it fired (seconds into the session)."""
    out = []
    for fault in faults:
        marker = folder / str(fault.id)
        entry = {**asdict(fault), "fired": marker.exists()}
        if entry["fired"]:
            try:
                seen = json.loads(marker.read_text())
                entry.update(pid=seen["pid"], at_s=round(seen["time"] - started, 3))
            except (OSError, ValueError, KeyError):
                pass
        out.append(entry)
    return out
