"""The grid of `mirage plan`: its axes, the templates they fill, and each point's command line.

An axis is `--axis NAME={V1,V2,...}`. Its values replace `{NAME}` wherever that appears: in the
`mirage run` flags given to `mirage plan` (`--env BATCH={batch}`, `--gpus-per-node {gpus}`), in
the command after `--` (`--parallelism.tensor_parallel_degree={tp}`, a config file's name) and in
`--tokens-per-step`. So one syntax reaches a flag, an environment variable or a config key of the
user's own program. Four names need no placeholder: an axis called `profile`, `num-nodes`,
`gpus-per-node` or `nproc-per-node` that appears nowhere sets that `mirage run` flag.

A placeholder must name an axis (a typo is refused, with the nearest name): `${NAME}` (the shell's)
is left alone, and `{{NAME}}` is written as a literal `{NAME}`. Everything is checked here,
before anything runs; a GridError is a usage error (exit 2) that names the fix.
"""

from __future__ import annotations

import ast
import difflib
import itertools
import operator
import re
from dataclasses import dataclass
from pathlib import Path

from mirage import profiles

MAX_POINTS = 10_000  # larger grids need --yes
RUN_FLAG_AXES = ("profile", "num-nodes", "gpus-per-node", "nproc-per-node")
_NAME = r"[A-Za-z_][A-Za-z0-9_-]*"
_AXIS = re.compile(rf"^({_NAME})=(.*)$", re.S)
_PLACEHOLDER = re.compile(rf"(?<![{{$]){{({_NAME})}}(?!}})")
_ESCAPED = re.compile(rf"{{{{({_NAME})}}}}")


class GridError(ValueError):
    """A grid that cannot run as written; the message says how to fix it (exit 2)."""


@dataclass(frozen=True)
class Axis:
    name: str
    values: tuple[str, ...]


@dataclass
class Point:
    """One configuration: its axis values and the `mirage run` it becomes."""
    index: int  # in grid order (the product of the axes, the first axis slowest)
    values: dict[str, str]
    flags: list[str]  # mirage run flags, placeholders filled
    options: dict  # those flags parsed (what the cache key holds: their order and spelling do not count)
    command: list[str]  # the user's command, placeholders filled
    profile: profiles.Profile
    tokens_per_step: float | None

    @property
    def label(self) -> str:
        return " ".join(f"{name}={value}" for name, value in self.values.items())


def parse_axis(spec: str) -> Axis:
    """`NAME={V1,V2,...}` -> Axis; an axis with no value, or an empty one, is refused."""
    match = _AXIS.match(spec)
    if match is None:
        raise GridError(f"--axis {spec!r}: write NAME={{V1,V2,...}}, e.g. --axis 'tp={{1,2,4,8}}'")
    name, body = match.groups()
    if not (body.startswith("{") and body.endswith("}")) or len(body) < 2:
        raise GridError(f"--axis {spec!r}: put the values in braces: --axis '{name}={{{body or '1,2'}}}'")
    values = tuple(value.strip() for value in body[1:-1].split(","))
    if not any(values) or not all(values):
        raise GridError(f"--axis {spec!r}: the template names no value"
                        f"{'' if not any(values) else ' in one of its places'}; list them: --axis '{name}={{1,2,4}}'")
    if len(set(values)) < len(values):
        repeated = sorted({v for v in values if values.count(v) > 1})
        raise GridError(f"--axis {spec!r}: {', '.join(repeated)} listed twice; list each value once")
    return Axis(name, values)


def placeholders(text: str) -> list[str]:
    """The axis names a template refers to."""
    return _PLACEHOLDER.findall(text)


def fill(text: str, values: dict[str, str]) -> str:
    """A template with its placeholders replaced, `{{NAME}}` unescaped to `{NAME}`."""
    filled = _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
    return _ESCAPED.sub(lambda m: "{" + m.group(1) + "}", filled)


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arithmetic(node: ast.AST) -> float:
    """Numbers and + - * / // % ** only: an expression is the user's, never executed as code."""
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_arithmetic(node.operand))
    raise ValueError(ast.dump(node))


def tokens(expression: str, values: dict[str, str], label: str) -> float:
    """--tokens-per-step at one point: the expression with its placeholders filled, evaluated."""
    filled = fill(expression, values)
    try:
        result = float(_arithmetic(ast.parse(filled, mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError):
        raise GridError(f"--tokens-per-step {expression!r} is {filled!r} at {label}, which is not arithmetic: "
                        "use numbers, axis placeholders and + - * / ( ), e.g. '{batch}*2048*8'") from None
    if not result > 0:
        raise GridError(f"--tokens-per-step {expression!r} is {result:g} at {label}; it must be positive")
    return result


def _flag_given(flags: list[str], flag: str) -> bool:
    return any(token == flag or token.startswith(flag + "=") for token in flags)


def _check_names(axes: list[Axis], templates: list[str]) -> list[Axis]:
    """Every placeholder names an axis, every axis is used (or is a mirage run flag, which it then
    sets); returns the axes that set a flag of their own."""
    names = [axis.name for axis in axes]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise GridError(f"axis {', '.join(twice)} given twice; give each axis once, with all its values")
    used = set()
    for template in templates:
        for name in placeholders(template):
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                hint = f"did you mean {{{near[0]}}}?" if near else f"add --axis '{name}={{...}}';"
                raise GridError(f"{{{name}}} in {template!r} names no axis ({hint} write {{{{{name}}}}} "
                                f"for a literal {{{name}}})")
            used.add(name)
    implicit = []
    for axis in axes:
        if axis.name in used:
            continue
        if axis.name.replace("_", "-") not in RUN_FLAG_AXES:
            raise GridError(f"axis {axis.name} appears nowhere: put {{{axis.name}}} where its value goes "
                            f"(a flag of the command, --env KEY={{{axis.name}}}, a config file's name)")
        implicit.append(axis)
    return implicit


def expand(axes: list[Axis], run_flags: list[str], command: list[str], tokens_expression: str | None,
           parse_run_flags, allow_large: bool) -> list[Point]:
    """Every point of the grid, checked: each becomes a valid `mirage run` with a known profile.
    parse_run_flags(flags) -> argparse.Namespace parses `mirage run`'s flags (exits 2 on a bad one)."""
    if not axes:
        raise GridError("no --axis given: name at least one, e.g. --axis 'profile={h100,mi300x}'")
    templates = run_flags + command + ([tokens_expression] if tokens_expression else [])
    implicit = _check_names(axes, templates)
    extra_flags = []
    for axis in implicit:
        flag = "--" + axis.name.replace("_", "-")
        if _flag_given(run_flags, flag):
            raise GridError(f"{flag} is given and an axis {axis.name} sets it too: drop {flag}, "
                            f"or put {{{axis.name}}} as its value")
        extra_flags += [flag, "{" + axis.name + "}"]
    count = 1
    for axis in axes:
        count *= len(axis.values)
    if count > MAX_POINTS and not allow_large:
        raise GridError(f"the grid has {count} points (over {MAX_POINTS}): narrow an axis, or pass --yes to run them all")
    loaded: dict[str, profiles.Profile] = {}
    points = []
    for index, combination in enumerate(itertools.product(*(axis.values for axis in axes))):
        values = dict(zip((axis.name for axis in axes), combination))
        label = " ".join(f"{n}={v}" for n, v in values.items())
        flags = [fill(token, values) for token in run_flags + extra_flags]
        args = parse_run_flags(flags, label)
        if args.profile not in loaded:
            try:
                loaded[args.profile] = profiles.load(args.profile)
            except profiles.ProfileError as err:
                raise GridError(f"at {label}: {err}") from None
        tokens_per_step = tokens(tokens_expression, values, label) if tokens_expression else None
        points.append(Point(index, values, flags, vars(args), [fill(token, values) for token in command],
                            loaded[args.profile], tokens_per_step))
    return points


INPUT_SUFFIXES = (".py", ".sh", ".toml", ".yaml", ".yml", ".json", ".cfg", ".ini", ".conf")
INPUT_FLAGS = ("--timing-tuning", "--faults", "--profile")  # mirage run flags that name input files


def input_files(flags: list[str], command: list[str]) -> list[Path]:
    """The existing files that decide a point's result as far as its command line tells: scripts
    and config files the command names (a token, or what follows `=` in one) and the files of
    mirage run's input flags. Their contents are part of the point's cache key. Other files (an
    output, a log, what an --env names) are not: they change as the program runs."""
    candidates = [value for flag, value in zip(flags, flags[1:]) if flag in INPUT_FLAGS]
    candidates += [token.split("=", 1)[1] for token in flags if token.split("=", 1)[0] in INPUT_FLAGS and "=" in token]
    for token in command:
        candidates += [c for c in {token, token.split("=", 1)[-1]} if c.endswith(INPUT_SUFFIXES)]
    found = set()
    for candidate in candidates:
        try:
            path = Path(candidate)
            if path.is_file():
                found.add(path.resolve())
        except (OSError, ValueError):
            continue
    return sorted(found)
