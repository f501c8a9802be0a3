"""Benchmark: a training step on mirage's emulated GPU against the same step on native CPU torch.

Not a test. Measures what a user compares: `python train.py` on `cpu` in a process of its own,
without mirage, against `mirage run -- python train.py` on `cuda`. Run it with the venv's
python, outside mirage (it starts mirage itself):

    .venv/bin/python bench/train_step.py [--steps 20] [--warmup 3] [--threads default 1]
                                         [--workload mlp small blocks llama module_db] [--timed] [--check-races]

Each workload runs in three processes at once, started from the same seed, doing identical work:

  native     python bench/train_step.py --worker ... --device cpu          (no mirage: the baseline)
  emulated   mirage run -- python bench/train_step.py ... --device cuda    (the emulated GPU)
  mirage-cpu mirage run -- python bench/train_step.py ... --device cpu     (CPU work inside a mirage process)

and with --timed / --check-races the emulated side again under `mirage run --timing` /
`--check-races`, whose ratio is to the plain emulated step of the same round (what the mode costs).

The driver (this script) hands out one step at a time over a Unix socket, round-robin with the
order rotating each round, so the three processes see the same machine noise while only one of
them runs (the others wait in a blocking read, using no CPU); a short pause between steps lets a
finished step's OpenMP workers stop spinning before the next process starts. Reported per side:
the median step time, and per round the ratio to the native step of the same round; the headline
figure is the median of those ratios, judged against the target. `max|dW|` is the largest
difference between a side's weights and the native process's after all steps.

Workloads (each step = zero_grad + forward + loss + backward + AdamW(foreach=False).step(); the
optimizer is pinned to its per-parameter loop on both sides because its default differs by
device, foreach on cuda and not on cpu, which would compare different work):

  mlp        4 x Linear(2048, 2048), ReLU between, batch 256
  small      60 x [Linear(64, 64) + LayerNorm(64) + GELU], batch 32: about 3,000 small ops a step
  blocks     a model written as users write one (issue 33's second small-op step): 48 residual
             blocks, each x + GELU(LayerNorm(Linear(96, 96)(x))) in a Module of its own, batch 16,
             AdamW with weight decay: about 2,800 small ops a step, most of them the optimizer's
  llama      transformers' LlamaForCausalLM from a config (no download): 2 layers, width 128,
             4 heads, vocabulary 1024, batch 8 x 64 tokens; reported as steps per second too
  module_db  one "step" is a pass over every third ModuleInfo of PyTorch's module_db: each float32
             training sample built on the device, the module moved there, forward, backward

Thread settings: `default` (torch's own choice, one OpenMP thread per core) and `1`
(OMP_NUM_THREADS=1 in every process's environment).

Output: a table for people and one line starting with `JSON ` for machines.
Exit code: 0 all targets met, 3 a target missed, 1 a worker failed, 2 it cannot run here (under
mirage, or transformers missing for `llama`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from record import save  # bench/record.py: the figures beside the doc

REPO = Path(__file__).resolve().parent.parent

# name: (description, target for emulated/native by thread setting)
WORKLOADS: dict[str, tuple[str, dict[str, float | None]]] = {
    "mlp": ("4 x Linear(2048,2048)+ReLU, batch 256", {"default": 1.05, "1": 1.05}),
    "small": ("60 x [Linear(64,64)+LayerNorm+GELU], batch 32", {"default": 1.15, "1": 1.15}),
    "blocks": ("48 x residual [Linear(96,96)+LayerNorm+GELU], batch 16", {"default": 1.15, "1": 1.15}),
    "llama": ("transformers Llama 2 x 128, vocab 1024, batch 8 x 64", {"default": 1.2, "1": 1.2}),
    "module_db": ("every 3rd ModuleInfo of module_db, fwd+bwd per sample", {"default": None, "1": None}),
}
MIRAGE_CPU_TARGET = 1.05  # CPU work inside a mirage process, against the native process
SIDES = ("native", "emulated", "mirage-cpu")
# The emulated side again with a mode of mirage run on, timed against the plain emulated step of
# the same round: side name -> (its mirage run flags, target ratio, what it is).
VARIANTS: dict[str, tuple[list[str], float, str]] = {
    "timed": (["--timing"], 1.15, "clocked mode (--timing)"),  # --timed
    "checked": (["--check-races"], 1.3, "the race checker (--check-races)"),  # --check-races
}
SETTLE_S = 0.02  # pause between two steps: the last step's OpenMP workers stop spinning


# ---------------------------------------------------------------- worker (one process, one device)

def build_workload(name: str, device):
    """A `step()` callable doing one unit of work on `device`, and the module it trains (or None)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name in ("mlp", "small"):
        if name == "mlp":
            width, batch = 2048, 256
            layers: list[nn.Module] = []
            for i in range(4):
                layers += [nn.Linear(width, width)] + ([nn.ReLU()] if i < 3 else [])
        else:
            width, batch = 64, 32
            layers = []
            for _ in range(60):
                layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
        model = nn.Sequential(*layers).to(device)
        x, y = torch.randn(batch, width).to(device), torch.randn(batch, width).to(device)
        loss_of = lambda: nn.functional.mse_loss(model(x), y)  # noqa: E731
    elif name == "blocks":
        class Block(nn.Module):
            def __init__(self, width: int) -> None:
                super().__init__()
                self.linear, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

            def forward(self, x):
                return x + nn.functional.gelu(self.norm(self.linear(x)))

        width, batch = 96, 16
        model = nn.Sequential(*[Block(width) for _ in range(48)]).to(device)
        x, y = torch.randn(batch, width).to(device), torch.randn(batch, width).to(device)
        loss_of = lambda: nn.functional.mse_loss(model(x), y)  # noqa: E731
    elif name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
        model = LlamaForCausalLM(config).to(device)
        tokens = torch.randint(0, config.vocab_size, (8, 64)).to(device)
        loss_of = lambda: model(input_ids=tokens, labels=tokens).loss  # noqa: E731
    elif name == "module_db":
        return module_db_pass(device), None
    else:
        raise ValueError(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01 if name == "blocks" else 0.0,
                                  foreach=False)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of().backward()
        optimizer.step()

    return step, model


def module_db_pass(device):
    """One pass over a fixed slice of module_db, as a parity sweep runs it (see the docstring)."""
    import warnings

    import torch
    from torch.testing._internal.common_modules import module_db
    from torch.utils._pytree import tree_flatten

    infos = module_db[::3]

    def step() -> None:
        torch.manual_seed(0)
        for info in infos:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                samples = info.module_inputs_func(info, device=device, dtype=torch.float32,
                                                  requires_grad=True, training=True)
                for sample in samples:
                    if sample.forward_input is None:
                        continue
                    ctor, fwd = sample.constructor_input, sample.forward_input
                    try:
                        module = info.module_cls(*ctor.args, **ctor.kwargs).to(device)
                        module.train()
                        outputs = tree_flatten(module(*fwd.args, **fwd.kwargs))[0]
                        floating = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
                        if floating:
                            sum(o.sum() for o in floating).backward()
                    except Exception:  # noqa: BLE001 - a sample CPU fails too; both sides skip it alike
                        pass

    return step


def worker(name: str, side: str, address: str) -> int:
    """Connects to the driver, builds the workload, then runs one step per request."""
    import torch

    device = torch.device("cuda" if side == "emulated" or side in VARIANTS else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs mirage: run under `mirage run`")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step, model = build_workload(name, device)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(address)
    stream = conn.makefile("rw")
    stream.write(json.dumps({"side": side, "threads": torch.get_num_threads(),
                             "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}) + "\n")
    stream.flush()
    for line in stream:
        request = json.loads(line)
        if request["op"] == "step":
            sync()
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            sync()
            reply = {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}
        elif request["op"] == "finish":
            if model is not None:
                torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, request["weights"])
            reply = {"done": True}
        stream.write(json.dumps(reply) + "\n")
        stream.flush()
        if request["op"] == "finish":
            return 0
    return 1


# ---------------------------------------------------------------- driver

@dataclass
class Side:
    """One worker process as the driver sees it."""

    name: str
    process: subprocess.Popen
    log: Path
    stream: object = None
    info: dict = field(default_factory=dict)
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def ask(self, request: dict) -> dict:
        self.stream.write(json.dumps(request) + "\n")
        self.stream.flush()
        line = self.stream.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker died; its output:\n{self.log.read_text()[-4000:]}")
        return json.loads(line)


def connect_all(listener: socket.socket, sides: list[Side]) -> None:
    """Waits for every worker to connect (in any order; each names its side first)."""
    by_name = {s.name: s for s in sides}
    listener.settimeout(1.0)
    while any(s.stream is None for s in sides):
        for side in sides:
            if side.stream is None and side.process.poll() is not None:
                raise RuntimeError(f"the {side.name} worker exited ({side.process.returncode}) before it was ready; "
                                   f"its output:\n{side.log.read_text()[-4000:]}")
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        stream = conn.makefile("rw")
        hello = json.loads(stream.readline())
        by_name[hello["side"]].stream, by_name[hello["side"]].info = stream, hello


def worker_command(side: str, workload: str, address: str, mirage_args: list[str]) -> list[str]:
    inner = [sys.executable, str(Path(__file__).resolve()), "--worker", workload, "--side", side,
             "--address", address]
    if side == "native":
        return inner
    mode = VARIANTS[side][0] if side in VARIANTS else []
    return [sys.executable, "-m", "mirage", "run", "--quiet", "--gpus-per-node", "1", *mode, *mirage_args, "--", *inner]


def measure(workload: str, threads: str, steps: int, warmup: int, scratch: Path, mirage_args: list[str],
            names: tuple[str, ...] = SIDES) -> dict:
    """Runs one workload at one thread setting in the three processes (and the variants asked for),
    interleaved."""
    import torch  # only to compare the weights at the end

    address = str(scratch / f"{workload}-{threads}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(len(names))
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if threads != "default":
        env["OMP_NUM_THREADS"] = threads
    sides: list[Side] = []
    try:
        for name in names:
            log = scratch / f"{workload}-{threads}-{name}.log"
            with open(log, "w") as out:
                process = subprocess.Popen(worker_command(name, workload, address, mirage_args), cwd=REPO, env=env,
                                           stdout=out, stderr=subprocess.STDOUT)
            sides.append(Side(name, process, log))
        connect_all(listener, sides)
        for i in range(warmup + steps):
            order = sides[i % len(sides):] + sides[:i % len(sides)]
            for side in order:
                time.sleep(SETTLE_S)
                reply = side.ask({"op": "step"})
                if i >= warmup:
                    side.wall.append(reply["wall"])
                    side.cpu.append(reply["cpu"])
        weights = {}
        for side in sides:
            path = scratch / f"{workload}-{threads}-{side.name}.pt"
            side.ask({"op": "finish", "weights": str(path)})
            side.process.wait(timeout=120)
            weights[side.name] = torch.load(path) if path.exists() else None
    finally:
        for side in sides:  # SIGTERM first: `mirage run` then ends its workload and cleans up
            if side.process.poll() is None:
                side.process.terminate()
        for side in sides:
            try:
                side.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                side.process.kill()
                side.process.wait()
        listener.close()
    native = next(s for s in sides if s.name == "native")
    description, targets = WORKLOADS[workload]
    result = {"workload": workload, "description": description, "threads": threads,
              "threads_seen": native.info.get("threads"), "steps": steps, "warmup": warmup, "sides": {}}
    for side in sides:
        ratios = [w / n for w, n in zip(side.wall, native.wall)]
        cpu_ratios = [w / n for w, n in zip(side.cpu, native.cpu) if n > 0]
        diff = None
        if weights.get(side.name) is not None and weights.get("native") is not None:
            diff = max(((a.double() - weights["native"][k].double()).abs().max().item()
                        for k, a in weights[side.name].items() if a.is_floating_point()), default=0.0)
        target = (None if side.name == "native" else
                  targets[threads if threads in targets else "default"] if side.name == "emulated" else
                  VARIANTS[side.name][1] if side.name in VARIANTS else MIRAGE_CPU_TARGET)
        if side.name in VARIANTS:  # against the plain emulated step of the same round
            emulated = next(s for s in sides if s.name == "emulated")
            ratios = [w / e for w, e in zip(side.wall, emulated.wall)]
        ratio = statistics.median(ratios)
        result["sides"][side.name] = {
            "median_ms": round(statistics.median(side.wall) * 1e3, 3),
            "min_ms": round(min(side.wall) * 1e3, 3),
            "ratio": round(ratio, 4),
            "cpu_time_ratio": round(statistics.median(cpu_ratios), 4) if cpu_ratios else None,
            "steps_per_s": round(1.0 / statistics.median(side.wall), 3),
            "target": target,
            "ok": None if target is None else ratio <= target,
            "max_param_diff": diff,
        }
    return result


def git_commit() -> str | None:
    """The repository's commit (+ "-dirty" if mirage/ has uncommitted changes), if git can tell."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "mirage"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if dirty else "")) if head else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per process (default 20; module_db: a quarter)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per process first (default 3)")
    ap.add_argument("--workload", choices=list(WORKLOADS), nargs="+", default=list(WORKLOADS))
    ap.add_argument("--threads", choices=["default", "1"], nargs="+", default=["default", "1"])
    ap.add_argument("--mirage-arg", action="append", default=[], metavar="ARG",
                    help="an option for `mirage run` of the mirage sides (repeatable), e.g. --mirage-arg=--in-process")
    ap.add_argument("--timed", action="store_true",
                    help="also run the emulated side under clocked mode (--timing); its ratio is to the untimed side")
    ap.add_argument("--check-races", action="store_true",
                    help="also run the emulated side with --check-races; its ratio is to the unchecked side")
    ap.add_argument("--worker", choices=list(WORKLOADS), help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=SIDES + tuple(VARIANTS), help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.side, args.address)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if os.environ.get("MIRAGE_SESSION"):
        print("bench/train_step.py starts mirage itself: run it with plain python, outside `mirage run`",
              file=sys.stderr)
        return 2

    if "llama" in args.workload and importlib.util.find_spec("transformers") is None:
        print("bench/train_step.py: the llama workload needs transformers, which is not installed here.\n"
              f"Fix: {sys.executable} -m pip install transformers torch==2.13.0   (the pin keeps the CPU build of "
              "torch), or leave it out: --workload mlp small blocks module_db", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="mirage-train-step-") as scratch:
        for workload in args.workload:
            for threads in args.threads:
                steps = max(3, args.steps // 4) if workload == "module_db" else args.steps
                warmup = min(args.warmup, 1) if workload == "module_db" else args.warmup
                try:
                    variants = (("timed",) if args.timed else ()) + (("checked",) if args.check_races else ())
                    results.append(measure(workload, threads, steps, warmup, Path(scratch), args.mirage_arg,
                                           SIDES + variants))
                except RuntimeError as error:
                    print(f"train_step: {workload} at {threads} threads failed: {error}", file=sys.stderr)
                    return 1
    info = {"bench": "train_step", "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "python": platform.python_version(), "cores": os.cpu_count(), "commit": git_commit(),
            "results": results}
    print(f"train_step: {info['cores']} cores, commit {info['commit']}, {info['date']}; "
          f"ratio = median over rounds of (side's step / native step of the same round)")
    header = (f"{'workload':<10} {'threads':>7} {'native ms':>10} {'emulated ms':>12} {'ratio':>7} {'target':>7} "
              f"{'':4} {'mirage-cpu ms':>14} {'ratio':>7} {'':4} {'emul steps/s':>12} {'max|dW|':>8}")
    print(header)
    print("-" * len(header))
    for r in results:
        n, e, m = (r["sides"][s] for s in SIDES)
        verdict = lambda s: "" if s["ok"] is None else ("ok" if s["ok"] else "MISS")  # noqa: E731
        threads = f"{r['threads']}({r['threads_seen']})"
        print(f"{r['workload']:<10} {threads:>7} {n['median_ms']:>10.2f} {e['median_ms']:>12.2f} {e['ratio']:>7.3f} "
              f"{e['target'] or float('nan'):>7.2f} {verdict(e):<4} {m['median_ms']:>14.2f} {m['ratio']:>7.3f} "
              f"{verdict(m):<4} {e['steps_per_s']:>12.2f} "
              f"{'-' if e['max_param_diff'] is None else format(e['max_param_diff'], '.1e'):>8}")
        for name, (_, target, what) in VARIANTS.items():
            if name in r["sides"]:
                variant = r["sides"][name]
                print(f"{'':<10} {'':>7} with {what} {variant['median_ms']:.2f} ms: {variant['ratio']:.3f} x the plain "
                      f"emulated step (target {target}) {verdict(variant)}")
    print("JSON " + json.dumps(info))
    save(info)
    return 0 if all(s["ok"] is not False for r in results for s in r["sides"].values()) else 3


if __name__ == "__main__":
    sys.exit(main())
