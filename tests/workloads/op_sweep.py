"""Operator sweep: every OpInfo in PyTorch's op_db, run on the CPU and on an emulated GPU.

Run under `mirage run --gpus-per-node 2 -- python tests/workloads/op_sweep.py`. For each op
that supports float32 on the CPU and on CUDA (op_db's dtypesIfCUDA: histogram and histogramdd
have no CUDA kernel, and PyTorch's GPU tests leave them out), the first few float32 sample
inputs are run on the CPU and on
cuda:0 (the same samples, moved), and the results are compared on the CPU: the outputs
(values, dtypes, shapes; the device of every output; which outputs alias which inputs), and,
where the op supports autograd and has differentiable floating (or complex) outputs, the
gradients of the inputs for a backward of the sum of the outputs.

A sample that fails on the CPU itself is excluded from the counts (a sample whose CPU backward
fails is compared forward only). Random ops (and ops whose output is uninitialised memory)
are compared by shape/dtype/device only. Torch is seeded before each run on each device.
Tensors that OpInfo's own cuda samples keep on the CPU (e.g. tensor_split's indices) stay on
the CPU; results are expected on cuda:0 unless nothing was moved (a factory op given no device).

Robustness: every exception is caught per sample. The ops run in a worker process that this
script (the driver, which never imports torch) starts and watches: if the worker crashes
(e.g. a segfault in a kernel) or one sample runs past the per-sample limit, the driver records
that sample as failed ("Crash" / "Hang"), ends the worker and starts a new one at the next
sample. So the summary is always printed.

The last line of stdout is one JSON object: {"op_sweep": 1, "passed", "failed", "total",
"fraction", "failures": [{"op", "variant", "sample", "check", "error", "message"}], ...}.

Environment knobs (all optional):
  OP_SWEEP_SAMPLES     samples per op (default 3; "all": every sample, ~4x the time)
  OP_SWEEP_OPS         comma-separated op names to run (default: all)
  OP_SWEEP_BUDGET_S    stop starting new ops after this many seconds (default 900: the default
                       sweep measured 120 s on 2 cores shared with other work, 2026-12-04; ops
                       past the budget are listed under "not_reached", which fails
                       tests/test_op_sweep.py)
  OP_SWEEP_SAMPLE_S    per-sample limit (default 60 s)
  OP_SWEEP_VERBOSE     1: one line per failure on stderr as it happens
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

START = time.time()
_samples = os.environ.get("OP_SWEEP_SAMPLES", "3")
SAMPLES_PER_OP = None if _samples == "all" else int(_samples)
BUDGET_S = float(os.environ.get("OP_SWEEP_BUDGET_S", "900"))
SAMPLE_LIMIT_S = float(os.environ.get("OP_SWEEP_SAMPLE_S", "60"))
STARTUP_S = 120  # extra allowance for a worker to import torch and op_db
VERBOSE = os.environ.get("OP_SWEEP_VERBOSE") == "1"
ONLY = {n for n in os.environ.get("OP_SWEEP_OPS", "").split(",") if n}

# Random ops: the same seed on both devices, but each device draws from its own generator, so
# only shape/dtype/device are compared (outputs and gradients).
RANDOM_SUBSTRINGS = ("rand", "dropout", "bernoulli", "multinomial", "normal", "uniform",
                     "exponential", "cauchy", "geometric", "rrelu", "gumbel",
                     "fractional_max_pool", "lowrank")
# Names that match the substrings above but are deterministic: compared fully.
DETERMINISTIC_DESPITE_NAME = {"__rand__", "nn.functional.normalize", "masked.normalize",
                              "signal.windows.exponential", "native_dropout_backward"}

# Ops not run at all, with the reason (reported under "skipped"). None is needed today: the
# whole float32 sweep takes 120 s on 2 shared cores (2026-12-04), the slowest op is
# max_unpool2d's sample generation (~2 s), and a hang or crash costs one sample (see above).
# Ops without float32 support on the CPU (bitwise_*, gcd, ...) are skipped automatically.
SKIP: dict[str, str] = {}


# ================================================================ driver (no torch here)

def drive() -> int:
    stats = {"passed": 0, "failed": 0, "excluded_cpu_failure": 0, "workers": 0, "grads_compared": 0}
    failures: list[dict] = []
    excluded: list[dict] = []
    incidents: list[str] = []  # worker deaths outside any sample (e.g. while importing torch)
    skipped: dict[str, str] = {}
    random_ops: set[str] = set()
    not_reached: list[str] = []
    ops: dict[int, tuple[str, str]] = {}
    ops_run: set[int] = set()
    resume = (0, 0)  # (op index, sample index) the next worker starts at
    done = False
    while not done:
        stats["workers"] += 1
        read_fd, write_fd = os.pipe()
        worker = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", str(write_fd), str(resume[0]), str(resume[1]),
             str(START)], pass_fds=(write_fd,), stdout=sys.stderr, stderr=sys.stderr)
        os.close(write_fd)
        in_flight = None   # (op index, sample index, phase) or ("gen"/"gen_device", op index)
        last = resume      # where to resume if the worker dies between samples
        # Silence longer than the limit ends the worker, wherever it is; starting (importing
        # torch and op_db) gets a fixed allowance on top.
        deadline = time.time() + SAMPLE_LIMIT_S + STARTUP_S
        buffer = ""
        hung = False
        while True:
            ready, _, _ = select.select([read_fd], [], [], 1.0)
            if not ready:
                if time.time() > deadline:
                    hung = True
                    worker.kill()
                    break
                continue
            chunk = os.read(read_fd, 65536).decode()
            if not chunk:
                break
            deadline = time.time() + SAMPLE_LIMIT_S
            buffer += chunk
            *lines, buffer = buffer.split("\n")
            for line in lines:
                ev = json.loads(line)
                kind = ev["ev"]
                if kind in ("gen", "gen_device"):
                    ops[ev["i"]] = (ev["op"], ev["variant"])
                    in_flight = (kind, ev["i"])
                elif kind == "op":
                    ops_run.add(ev["i"])
                    if ev["random"]:
                        random_ops.add(ev["op"])
                    in_flight = None
                    last = max(last, (ev["i"], 0))
                elif kind == "skip":
                    skipped[ev["key"]] = ev["why"]
                    in_flight = None
                elif kind == "unreached":
                    not_reached.append(ev["key"])
                elif kind == "begin":
                    in_flight = (ev["i"], ev["s"], "cpu")
                elif kind == "phase":
                    in_flight = (in_flight[0], in_flight[1], ev["phase"])
                elif kind == "end":
                    in_flight = None
                    last = (ev["i"], ev["s"] + 1)
                    status = ev["status"]
                    stats["grads_compared"] += ev["grads"]
                    if status == "excluded":
                        stats["excluded_cpu_failure"] += 1
                        excluded.append(ev["failure"])
                    elif status == "passed":
                        stats["passed"] += 1
                    else:
                        stats["failed"] += 1
                        failures.append(ev["failure"])
                        if VERBOSE:
                            print(f"FAIL {ev['failure']}", file=sys.stderr, flush=True)
                elif kind == "done":
                    done = True
        os.close(read_fd)
        rc = worker.wait()
        if done:
            break
        # The worker died (or was ended) in the middle of something: record it, move past it.
        cause = (f"no progress for {SAMPLE_LIMIT_S:.0f}s" if hung else
                 f"worker died: {signal.Signals(-rc).name}" if rc < 0 else f"worker exited with {rc}")
        error = "Hang" if hung else "Crash"
        if in_flight is None:
            incidents.append(f"{error}: {cause}, outside any sample (resuming at op #{last[0]}, sample {last[1]})")
            if incidents.count(incidents[-1]) >= 3:  # dies at the same place every time
                not_reached.append(f"op #{last[0]} onwards: {incidents[-1]}")
                break
            resume = last
        elif in_flight[0] == "gen":  # making CPU samples: not a device problem
            op, variant = ops[in_flight[1]]
            skipped[f"{op}.{variant}" if variant else op] = f"CPU sample generation: {cause}"
            resume = (in_flight[1] + 1, 0)
        elif in_flight[0] == "gen_device":  # OpInfo making samples on the device
            op, variant = ops[in_flight[1]]
            stats["failed"] += 1
            failures.append({"op": op, "variant": variant, "sample": -1, "check": "sample_inputs",
                             "error": error, "message": f"{cause} making samples on the device"})
            resume = (in_flight[1] + 1, 0)
        else:
            i, s, phase = in_flight
            op, variant = ops.get(i, ("?", ""))
            if phase == "cpu":
                stats["excluded_cpu_failure"] += 1
                excluded.append({"op": op, "variant": variant, "sample": s, "check": None, "error": error,
                                 "message": cause})
            else:
                stats["failed"] += 1
                check = "backward" if "backward" in phase else "forward"
                where = "comparing" if phase.startswith("compare") else "running"
                entry = {"op": op, "variant": variant, "sample": s, "check": check, "error": error,
                         "message": f"{cause} ({where} on the device)"}
                failures.append(entry)
                if VERBOSE:
                    print(f"FAIL {entry}", file=sys.stderr, flush=True)
            resume = (i, s + 1)
        if stats["workers"] > 100:  # something is badly wrong; do not loop forever
            not_reached.append(f"op #{resume[0]} onwards: too many worker restarts")
            break
    total = stats["passed"] + stats["failed"]
    summary = {
        "op_sweep": 1,
        "passed": stats["passed"],
        "failed": stats["failed"],
        "total": total,
        "fraction": round(stats["passed"] / total, 4) if total else 0.0,
        "excluded_cpu_failure": stats["excluded_cpu_failure"],
        "ops_run": len(ops_run),
        "grads_compared": stats["grads_compared"],
        "samples_per_op": SAMPLES_PER_OP or "all",
        "workers_started": stats["workers"],
        "worker_incidents": incidents,
        "seconds": round(time.time() - START, 1),
        "random_ops_shape_only": sorted(random_ops),
        "skipped": skipped,
        "not_reached": not_reached,
        "failures": failures,
        "excluded": excluded,
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__" and sys.argv[1:2] != ["--worker"]:
    sys.exit(drive())


# ================================================================ worker

import itertools  # noqa: E402
import math  # noqa: E402
import warnings  # noqa: E402

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

DEVICE = "cuda:0"
SEED = 1234


# Ops whose `training=True` samples apply dropout (their dropout_p is positional).
DROPOUT_WHEN_TRAINING = {"nn.functional.multi_head_attention_forward"}


def draws_dropout(op, sample) -> bool:
    """A sample of an op that is not random by name but applies dropout (attention with
    dropout_p > 0, multi-head attention in training): the device's generator is CUDA's Philox,
    not the CPU's, so its mask differs from the CPU's, as a real GPU's does; only shapes can be
    compared."""
    if float(sample.kwargs.get("dropout_p", 0.0)) > 0.0:
        return True
    return op.name in DROPOUT_WHEN_TRAINING and bool(sample.kwargs.get("training"))


def is_random(op) -> bool:
    if op.has_nondeterministic_output:  # e.g. empty*: uninitialised memory
        return True
    if op.name in DETERMINISTIC_DESPITE_NAME:
        return False
    return any(s in op.name for s in RANDOM_SUBSTRINGS)


# ---------------------------------------------------------------- moving samples

def move(x, device: str, leaves: list, stays_on_cpu=None, moved: list | None = None):
    """A copy of a sample's structure on `device`: tensors detached and copied (so that no run
    mutates the shared sample), requires_grad re-enabled on copies of tensors that had it
    (appended to `leaves`, in traversal order); `device="cpu"` arguments follow the move.
    `stays_on_cpu`: an iterator of one bool per tensor (traversal order), True for a tensor the
    op wants on the CPU even for device samples (e.g. tensor_split's indices tensor).
    `moved` collects one entry per tensor or device argument actually put on the device."""
    moved = [] if moved is None else moved
    if isinstance(x, torch.Tensor):
        keep = next(stays_on_cpu) if stays_on_cpu is not None else False
        with torch.no_grad():
            if device == "cpu" or keep:
                y = x.detach().clone()
            else:
                y = x.detach().to(device)
                moved.append(y)
        if x.requires_grad:
            y.requires_grad_(True)
            leaves.append(y)
        return y
    if isinstance(x, torch.device) and x.type == "cpu" and device != "cpu":
        moved.append(x)
        return torch.device(device)
    if isinstance(x, str) and x == "cpu" and device != "cpu":
        moved.append(x)
        return device
    if isinstance(x, list):
        return [move(v, device, leaves, stays_on_cpu, moved) for v in x]
    if isinstance(x, tuple) and type(x) is tuple:
        return tuple(move(v, device, leaves, stays_on_cpu, moved) for v in x)
    if isinstance(x, dict):
        return {k: move(v, device, leaves, stays_on_cpu, moved) for k, v in x.items()}
    return x


def tensors_in(x, out: list) -> list:
    """The tensors of a sample's structure, in move()'s traversal order."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)) and (type(x) is tuple or isinstance(x, list)):
        for v in x:
            tensors_in(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            tensors_in(v, out)
    return out


def cpu_placement(cpu_sample, device_sample) -> list[bool] | None:
    """Per tensor of the CPU sample: does OpInfo keep it on the CPU in its device sample?
    None when the two samples do not line up (then every tensor moves)."""
    if device_sample is None:
        return None
    cpu_ts = tensors_in([cpu_sample.input, cpu_sample.args, cpu_sample.kwargs], [])
    dev_ts = tensors_in([device_sample.input, device_sample.args, device_sample.kwargs], [])
    if len(cpu_ts) != len(dev_ts) or any(c.shape != d.shape for c, d in zip(cpu_ts, dev_ts)):
        return None
    return [d.device.type == "cpu" for d in dev_ts]


def flatten(x, out: list) -> list:
    """Leaves of an op's result (tuples, lists, return_types structseqs, dicts)."""
    if isinstance(x, (list, tuple)):
        out.append(("seq", len(x)))
        for v in x:
            flatten(v, out)
    elif isinstance(x, dict):
        out.append(("dict", tuple(sorted(map(str, x)))))
        for k in sorted(x, key=str):
            flatten(x[k], out)
    else:
        out.append(x)
    return out


def input_tensors(sample_args) -> list:
    found = []
    for leaf in flatten(sample_args, []):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
    return found


def storage_key(t: torch.Tensor):
    try:
        if t.layout != torch.strided:
            return None
        s = t.untyped_storage()
        return s.data_ptr() if s.nbytes() else None
    except Exception:  # noqa: BLE001
        return None


def aliasing(outputs: list, inputs: list) -> list:
    """For each output tensor, the indices of the inputs it shares memory with."""
    keys = [storage_key(t) for t in inputs]
    result = []
    for o in outputs:
        if not isinstance(o, torch.Tensor):
            continue
        k = storage_key(o)
        result.append(tuple(i for i, ik in enumerate(keys) if k is not None and ik == k))
    return result


# ---------------------------------------------------------------- comparing

class Mismatch(AssertionError):
    """The device result differs from the CPU result."""


class WrongDevice(AssertionError):
    """A device result is not on the device."""


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu")


def compare_leaves(cpu: list, dev: list, *, shape_only: bool, what: str, expected: str) -> None:
    """Leaf by leaf. A tensor the CPU run returns on the CPU must come back on `expected` from
    the device run; values are compared on the CPU (shape/dtype only for random ops)."""
    if len(cpu) != len(dev):
        raise Mismatch(f"{what}: structure differs ({len(cpu)} vs {len(dev)} leaves)")
    for i, (c, d) in enumerate(zip(cpu, dev)):
        where = f"{what}[{i}]"
        if isinstance(c, torch.Tensor) or isinstance(d, torch.Tensor):
            if not (isinstance(c, torch.Tensor) and isinstance(d, torch.Tensor)):
                raise Mismatch(f"{where}: {type(c).__name__} on CPU, {type(d).__name__} on device")
            if c.device.type == "cpu" and d.device != torch.device(expected):
                raise WrongDevice(f"{where}: result on {d.device}, expected {expected}")
            if shape_only:
                if c.shape != d.shape or c.dtype != d.dtype or c.layout != d.layout:
                    raise Mismatch(f"{where}: {tuple(c.shape)}/{c.dtype} on CPU, "
                                   f"{tuple(d.shape)}/{d.dtype} on device")
                continue
            try:
                torch.testing.assert_close(on_cpu(d), on_cpu(c), equal_nan=True,
                                           check_device=False, check_layout=True)
            except AssertionError as e:
                detail = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
                raise Mismatch(f"{where}: {detail}") from None
        elif isinstance(c, tuple) and c and c[0] in ("seq", "dict"):
            if c != d:
                raise Mismatch(f"{where}: structure {c} on CPU, {d} on device")
        elif isinstance(c, float) and isinstance(d, float):
            if not (shape_only or c == d or (math.isnan(c) and math.isnan(d))
                    or math.isclose(c, d, rel_tol=1.3e-6, abs_tol=1e-5)):
                raise Mismatch(f"{where}: {c} on CPU, {d} on device")
        elif shape_only:
            continue
        elif type(c) is not type(d):
            raise Mismatch(f"{where}: {type(c).__name__} on CPU, {type(d).__name__} on device")
        elif isinstance(c, (int, bool, complex, str)) and c != d:
            raise Mismatch(f"{where}: {c!r} on CPU, {d!r} on device")


def first_line(e: BaseException, limit: int = 240) -> str:
    text = " ".join(str(e).strip().split("\n")[:2]).strip() or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- running one sample

def differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())


def run(op, sample, device: str, placement: list[bool] | None = None):
    """Forward (and, where possible, backward) of one sample on `device`.
    Returns (flat outputs, output aliasing, gradients or None, backward error, expected
    device of the outputs)."""
    leaves: list = []
    keep = iter(placement) if placement is not None and device != "cpu" else None
    moved: list = []
    inp = move(sample.input, device, leaves, keep, moved)
    args = move(sample.args, device, leaves, keep, moved)
    kwargs = move(sample.kwargs, device, leaves, keep, moved)
    inputs = input_tensors([inp, args, kwargs])
    torch.manual_seed(SEED)
    result = op(inp, *args, **kwargs)
    flat = flatten(result, [])
    alias = aliasing(flat, inputs)
    grads, grad_error = None, None
    if op.supports_autograd and leaves:
        try:
            processed = sample.output_process_fn_grad(result)
            outs = [t for t in flatten(processed, []) if differentiable(t)]
            if outs:
                if device != "cpu":
                    tell(ev="phase", phase="backward")
                loss = sum(t.sum() if not t.is_complex() else t.real.sum() + t.imag.sum() for t in outs)
                grads = list(torch.autograd.grad(loss, leaves, allow_unused=True))
        except Exception as e:  # noqa: BLE001
            grad_error = e
    # Results belong on the device if anything was put there (a factory op given no device
    # makes CPU tensors on both runs).
    return flat, alias, grads, grad_error, DEVICE if moved else "cpu"


def check_sample(op, sample, random_op: bool, placement: list[bool] | None):
    """Returns (status, check, error, gradients compared): status 'excluded' (the sample fails
    on the CPU; error is the CPU's), 'passed' or 'failed' (check: 'forward' or 'backward')."""
    try:
        cpu_flat, cpu_alias, cpu_grads, cpu_grad_error, _ = run(op, sample, "cpu")
    except Exception as e:  # noqa: BLE001
        return "excluded", None, e, False
    tell(ev="phase", phase="device")
    try:
        dev_flat, dev_alias, dev_grads, dev_grad_error, expected = run(op, sample, DEVICE, placement)
    except Exception as e:  # noqa: BLE001
        return "failed", "forward", e, False
    tell(ev="phase", phase="compare_forward")
    try:
        compare_leaves(cpu_flat, dev_flat, shape_only=random_op, what="output", expected=expected)
        if not random_op and cpu_alias != dev_alias:
            raise Mismatch(f"output aliasing differs: outputs share memory with inputs "
                           f"{cpu_alias} on CPU, {dev_alias} on device")
    except Exception as e:  # noqa: BLE001
        return "failed", "forward", e, False
    if cpu_grad_error is not None or cpu_grads is None:
        return "passed", None, None, False  # no gradient check possible on the CPU either
    if dev_grad_error is not None:
        return "failed", "backward", dev_grad_error, True
    tell(ev="phase", phase="compare_backward")
    try:
        if dev_grads is None:
            raise Mismatch("no differentiable outputs on device")
        cpu_g = [g if g is not None else "none" for g in cpu_grads]
        dev_g = [g if g is not None else "none" for g in dev_grads]
        compare_leaves(cpu_g, dev_g, shape_only=random_op, what="grad", expected=expected)
    except Exception as e:  # noqa: BLE001
        return "failed", "backward", e, True
    return "passed", None, None, True


_channel = None


def tell(**event) -> None:
    _channel.write(json.dumps(event) + "\n")
    _channel.flush()


def work(fd: int, first_op: int, first_sample: int, started: float) -> int:
    global _channel
    _channel = os.fdopen(fd, "w", buffering=1)
    for index, op in enumerate(op_db):
        if index < first_op or (ONLY and op.name not in ONLY):
            continue
        key = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
        if op.name in SKIP:
            tell(ev="skip", key=key, why=SKIP[op.name])
            continue
        if not op.supports_dtype(torch.float32, "cpu"):
            tell(ev="skip", key=key, why="no float32 on CPU")
            continue
        if not op.supports_dtype(torch.float32, "cuda"):  # as PyTorch's GPU tests leave it out
            tell(ev="skip", key=key, why="no float32 on CUDA (op_db: a CUDA build has no kernel)")
            continue
        if time.time() - started > BUDGET_S:
            tell(ev="unreached", key=key)
            continue
        random_op = is_random(op)
        tell(ev="gen", i=index, op=op.name, variant=op.variant_test_name)
        torch.manual_seed(SEED + index)
        try:
            samples = list(itertools.islice(
                op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd), SAMPLES_PER_OP))
        except Exception as e:  # noqa: BLE001 - CPU-made samples: not a device problem
            tell(ev="skip", key=key, why=f"sample generation failed: {first_line(e, 120)}")
            continue
        # OpInfo's own device samples tell which tensors must stay on the CPU (same seed, so
        # same structure); their values are not used.
        tell(ev="gen_device", i=index, op=op.name, variant=op.variant_test_name)
        torch.manual_seed(SEED + index)
        try:
            device_samples = list(itertools.islice(
                op.sample_inputs(DEVICE, torch.float32, requires_grad=op.supports_autograd), SAMPLES_PER_OP))
        except Exception:  # noqa: BLE001 - then every tensor moves
            device_samples = []
        tell(ev="op", i=index, op=op.name, variant=op.variant_test_name, random=random_op)
        for s, sample in enumerate(samples):
            if index == first_op and s < first_sample:
                continue
            tell(ev="begin", i=index, s=s)
            placement = cpu_placement(sample, device_samples[s] if s < len(device_samples) else None)
            status, check, error, grads = check_sample(op, sample, random_op or draws_dropout(op, sample), placement)
            failure = None
            if error is not None:
                failure = {"op": op.name, "variant": op.variant_test_name, "sample": s, "check": check,
                           "error": type(error).__name__, "message": first_line(error, 300 if check else 120)}
            tell(ev="end", i=index, s=s, status=status, failure=failure, grads=grads)
    tell(ev="done")
    return 0


if __name__ == "__main__":
    _, _, _fd, _op, _sample, _started = sys.argv
    sys.exit(work(int(_fd), int(_op), int(_sample), float(_started)))
