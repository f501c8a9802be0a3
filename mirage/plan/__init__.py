"""`mirage plan`: runs the user's own program over a grid of configurations in clocked
predict-only mode and ranks them.

    grid.py     the axes, the templates they fill, every point checked before anything runs
    runner.py   each point a `mirage run --timing --predict-only` subprocess, in parallel, cached
    report.py   the ranking, the Pareto front, the table and JSON
    picture.py  throughput against peak memory, as HTML (inline SVG) and PNG (with matplotlib)
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

from mirage.launcher.request import UsageError, check_torch_is_cpu_build
from mirage.plan import grid, picture, report, runner

DESCRIPTION = """\
Runs CMD once per point of a grid, each as `mirage run --timing --predict-only`, and ranks the
points by predicted throughput.

Axes: --axis NAME={V1,V2,...} (repeatable; the grid is their product). {NAME} is replaced by the
point's value wherever it appears: in the mirage run flags given here (--env BATCH={batch},
--gpus-per-node {gpus}), in CMD (--parallelism.tensor_parallel_degree={tp}, a config file name)
and in --tokens-per-step. An axis named profile, num-nodes, gpus-per-node or nproc-per-node that
appears nowhere sets that mirage run flag. {NAME} must name an axis; ${NAME} is left to the shell
and {{NAME}} is a literal {NAME}.

    mirage plan --axis 'tp={1,2,4,8}' --axis 'batch={1,2}' --axis 'profile={h100,mi300x}' \\
        --tokens-per-step '{batch}*8192*8/{tp}' --price-per-gpu-hour 2.5 --gpus-per-node 8 -- \\
        torchrun --standalone --nproc_per_node=8 -m torchtitan.train --job.config_file llama3_8b.toml \\
        --parallelism.tensor_parallel_degree={tp} --training.local_batch_size={batch}

Other mirage run flags before `--` apply to every point. Results are cached by each point's full
command line, the files it names, the profile and mirage's build (--cache), so a rerun with one
more value runs only the new points. Points that fail are listed with the error line that says
why. Prints the ranked table (or --json) on stdout; progress on stderr; writes PREFIX.html (an
inline SVG) and, where matplotlib is installed, PREFIX.png. Exit 0 when a point ran, 1 when none
did, 2 for bad input (before anything runs), 128+N when stopped by signal N (the cache is kept).
"""

PLAN_ONLY_OF_RUN = ("--summary-json", "--in-process")  # the plan needs the session summary itself


def _positive(kind):
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number; give one, e.g. {kind(2.5)}")
        return value
    return check


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--axis", action="append", default=[], metavar="NAME={V1,V2,...}",
                        help="an axis of the grid; {NAME} in the flags and CMD takes its values (repeatable)")
    parser.add_argument("--jobs", "-j", type=_positive(int), metavar="N",
                        help=f"points run at once (default {runner.default_jobs()} here: half the cores, "
                             "at most one per 4 GiB of available memory)")
    parser.add_argument("--cache", metavar="DIR", help=f"the result cache (default {runner.default_cache()})")
    parser.add_argument("--retry-failed", action="store_true", help="run again the points cached as failed")
    parser.add_argument("--tokens-per-step", metavar="EXPR",
                        help="tokens one step trains, all ranks together: a number or arithmetic over "
                             "placeholders, e.g. '{batch}*2048*8'; ranks by tokens/s/GPU (else by steps/s)")
    parser.add_argument("--price-per-gpu-hour", type=_positive(float), metavar="PRICE",
                        help="with --tokens-per-step: adds the cost of a million tokens")
    parser.add_argument("--json", action="store_true", help="print the ranking as JSON instead of the table")
    parser.add_argument("--picture", default="mirage-plan", metavar="PREFIX",
                        help="write PREFIX.html and PREFIX.png (default mirage-plan)")
    parser.add_argument("--no-picture", action="store_true", help="write no picture")
    parser.add_argument("--yes", action="store_true", help=f"run a grid of more than {grid.MAX_POINTS} points")


def _usage_error(message: str) -> int:
    print(f"mirage plan: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str], plan_parser: argparse.ArgumentParser, run_parser: argparse.ArgumentParser) -> int:
    """`mirage plan [plan flags] [mirage run flags] -- CMD`; argv is what follows `plan`."""
    if "--" in argv:
        at = argv.index("--")
        flags, command = argv[:at], argv[at + 1:]
    else:
        flags, command = argv, []
    args, run_flags = plan_parser.parse_known_args(flags)
    known = [f for action in plan_parser._actions + run_parser._actions for f in action.option_strings]
    for token in run_flags:
        name = token.split("=", 1)[0]
        if name in PLAN_ONLY_OF_RUN:
            return _usage_error(f"{name} is the plan's own (it reads each point's summary): drop it; "
                                "--json prints the plan's results")
        if name == "--check-races" and token != "--check-races=off":
            return _usage_error("--check-races is not for a plan: its points run --predict-only, which runs no "
                                "kernels to check. Fix: check one configuration with mirage run --check-races")
    if not command:
        return _usage_error("no command to plan; put it after `--`: mirage plan --axis 'b={1,2}' -- python train.py")
    if args.price_per_gpu_hour is not None and not args.tokens_per_step:
        return _usage_error("--price-per-gpu-hour needs --tokens-per-step (a cost per million tokens)")

    def parse_run_flags(point_flags: list[str], label: str) -> argparse.Namespace:
        try:
            parsed, unknown = run_parser.parse_known_args(point_flags)
        except SystemExit:
            print(f"mirage plan: (in the mirage run flags of point {label})", file=sys.stderr)
            raise
        if unknown:
            near = difflib.get_close_matches(unknown[0].split("=")[0], known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else \
                ("" if unknown[0].startswith("-") else "; put `--` before the command")
            raise grid.GridError(f"unrecognized argument {unknown[0]}{hint}")
        return parsed

    try:
        axes = [grid.parse_axis(spec) for spec in args.axis]
        points = grid.expand(axes, run_flags, command, args.tokens_per_step, parse_run_flags, args.yes)
    except grid.GridError as err:
        return _usage_error(str(err))

    try:  # the cache key names the torch it runs on; without torch no point could run either
        check_torch_is_cpu_build()
    except UsageError as err:
        return _usage_error(str(err))
    cache = Path(args.cache) if args.cache else runner.default_cache()
    try:
        outcomes = runner.run_points(points, cache, args.jobs or runner.default_jobs(), args.retry_failed)
    except runner.Interrupted as stopped:
        print(f"mirage plan: stopped by {stopped}; finished points are kept in {cache} "
              "(the same command goes on from there)", file=sys.stderr)
        return 128 + stopped.signum
    rows = report.rank(points, outcomes, args.price_per_gpu_hour)
    tokens_given = args.tokens_per_step is not None
    text = report.table(rows, tokens_given, args.price_per_gpu_hour)
    if args.json:
        print(json.dumps(report.to_json(rows, tokens_given, args.price_per_gpu_hour), indent=2))
    else:
        print(text)
    if not args.no_picture and any(row.ok for row in rows):
        prefix = Path(args.picture)
        y_label = "tokens/s per GPU" if tokens_given else "steps/s"
        picture.write_html(rows, y_label, text, prefix.with_name(prefix.name + ".html"))
        png = picture.write_png(rows, y_label, prefix.with_name(prefix.name + ".png"))
        print(f"mirage plan: picture in {prefix}.html" + (f" and {prefix}.png" if png else
              " (no PNG: matplotlib is not installed; pip install matplotlib)"), file=sys.stderr)
    return 0 if any(row.ok for row in rows) else 1

