"""The ranking of a plan: one row per point from its session summary, the Pareto front of
throughput against peak memory, and the table and JSON that print them.

Figures come from the summary's `timing.job` (what `mirage run --timing --summary-json` writes):
the slowest rank's median step, the mean MFU, the largest peak of memory reserved by any rank
(what the allocator holds, and what the profile's capacity is checked against). GPUs are the ranks
that predicted steps. Throughput is tokens/s per GPU where --tokens-per-step gives the tokens of
one step (of all ranks together), else steps/s, which compares only points doing the same work.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mirage.plan.grid import Point
from mirage.plan.runner import Outcome


@dataclass
class Row:
    point: dict[str, str]
    label: str
    profile: str
    ok: bool
    reason: str | None
    cached: bool
    exit_code: int
    log: str
    rank: int | None = None
    gpus: int | None = None
    step_ms: float | None = None
    mfu: float | None = None
    peak_bytes: int | None = None
    capacity_bytes: int | None = None
    tokens_per_step: float | None = None
    tokens_per_s_per_gpu: float | None = None
    steps_per_s: float | None = None
    cost_per_million_tokens: float | None = None
    pareto: bool = False

    @property
    def throughput(self) -> float:
        return self.tokens_per_s_per_gpu if self.tokens_per_s_per_gpu is not None else self.steps_per_s


def _row(point: Point, outcome: Outcome, price_per_gpu_hour: float | None) -> Row:
    row = Row(point=point.values, label=point.label, profile=point.profile.name, ok=outcome.reason is None,
              reason=outcome.reason, cached=outcome.cached, exit_code=outcome.exit_code, log=outcome.log,
              capacity_bytes=point.profile.memory_bytes, tokens_per_step=point.tokens_per_step)
    if not row.ok:
        return row
    timing = outcome.summary["timing"]
    job = timing["job"]
    row.gpus = job["gpus"]  # the job's: with --stand-ins, more than ran
    row.step_ms, row.mfu, row.peak_bytes = job["step_ms"], job["mfu"], job["peak_reserved"]
    row.steps_per_s = 1e3 / row.step_ms
    if point.tokens_per_step is not None:
        row.tokens_per_s_per_gpu = point.tokens_per_step * row.steps_per_s / row.gpus
        if price_per_gpu_hour is not None:
            row.cost_per_million_tokens = price_per_gpu_hour / 3600 / row.tokens_per_s_per_gpu * 1e6
    return row


def rank(points: list[Point], outcomes: dict[int, Outcome], price_per_gpu_hour: float | None) -> list[Row]:
    """Points that ran, best first (highest throughput; ties in grid order), then those that
    could not, in grid order, each with its reason."""
    rows = [_row(point, outcomes[point.index], price_per_gpu_hour) for point in points]
    ran = sorted((r for r in rows if r.ok), key=lambda r: -r.throughput)
    for place, row in enumerate(ran, 1):
        row.rank = place
        row.pareto = not any(other.throughput >= row.throughput and other.peak_bytes <= row.peak_bytes
                             and (other.throughput > row.throughput or other.peak_bytes < row.peak_bytes)
                             for other in ran)
    return ran + [r for r in rows if not r.ok]


def to_json(rows: list[Row], tokens_given: bool, price: float | None) -> dict:
    return {"throughput": "tokens/s/GPU" if tokens_given else "steps/s", "price_per_gpu_hour": price,
            "points": [asdict(row) for row in rows]}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}" if n < 10 * 2**30 else f"{n / 2**30:.1f}"


def _shorten(text: str, limit: int = 200) -> str:
    """A reason as the table shows it (--json and the run's log have it whole)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def table(rows: list[Row], tokens_given: bool, price: float | None) -> str:
    """The ranked table (stdout). `*` marks the Pareto front; failed points follow, with why."""
    header = ["RANK", "POINT", "TOKENS/S/GPU" if tokens_given else "STEPS/S", "STEP MS", "MFU",
              "PEAK/CAPACITY GiB", "GPUS"] + (["$/M TOKENS"] if price is not None and tokens_given else []) + ["FRONT"]
    lines = [header]
    for row in rows:
        if not row.ok:
            continue
        cells = [str(row.rank), row.label, f"{row.throughput:,.1f}" if tokens_given else f"{row.throughput:.2f}",
                 f"{row.step_ms:.3f}", f"{100 * row.mfu:.1f}%",
                 f"{_gib(row.peak_bytes)}/{_gib(row.capacity_bytes)} ({100 * row.peak_bytes / row.capacity_bytes:.0f}%)",
                 str(row.gpus)]
        if price is not None and tokens_given:
            cells.append(f"{row.cost_per_million_tokens:.4g}")
        lines.append(cells + ["*" if row.pareto else ""])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    failed = [row for row in rows if not row.ok]
    if failed:
        out.append(f"{len(failed)} point(s) could not run:")
        out += [f"  {row.label}: {_shorten(row.reason)}" for row in failed]
    if len(lines) == 1:
        out.insert(1, "  (no point ran to the end)")
    return "\n".join(out)
