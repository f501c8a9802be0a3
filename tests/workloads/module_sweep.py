"""Module sweep: every ModuleInfo of PyTorch's module_db, on the CPU and on an emulated GPU.

Run under `mirage run --gpus-per-node 1 -- python tests/workloads/module_sweep.py`. What PyTorch's
own test_modules.py checks as test_cpu_gpu_parity, for every float32 sample input of every module,
in training mode and (where the two differ) in eval mode: the module is built on the CPU (a lazy
module materialised by one CPU forward), deep-copied to cuda:0, and both run the same inputs;
compared are the outputs (values, dtypes, shapes; every tensor output on the device) and, after
a backward of the sum of the floating outputs, the gradients of the parameters and of the
inputs. Random modules (dropout, RReLU) are compared by shape, dtype and device only.

A sample the CPU itself fails is excluded from the counts. A sample that module_db itself marks
as an expected failure or skip of test_cpu_gpu_parity on CUDA (what a real GPU fails too) is
counted apart, as "known on a GPU".

The last line of stdout is one JSON object: {"module_sweep": 1, "passed", "failed", "total",
"fraction", "failures": [{"module", "sample", "training", "check", "error", "message"}], ...}.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings

import torch
from torch.testing._internal.common_modules import module_db
from torch.utils._pytree import tree_flatten, tree_map

RANDOM_MODULES = ("Dropout", "RReLU")
DEVICE = torch.device("cuda", 0)


def known_on_a_gpu(module_info) -> str | None:
    """module_db's own expected failure or skip of the CPU/GPU parity test on CUDA, if any."""
    for decorator in module_info.decorators:
        if getattr(decorator, "test_name", None) != "test_cpu_gpu_parity":
            continue
        if getattr(decorator, "device_type", None) not in (None, "cuda"):
            continue
        dtypes = getattr(decorator, "dtypes", None)
        if dtypes is not None and torch.float32 not in dtypes:
            continue
        return ", ".join(getattr(d, "__name__", repr(d)) for d in decorator.decorators)
    return None


def fresh_copy(value):
    """A leaf copy of a tensor input (module_db's inputs may be results of ops: not deep-copyable)."""
    if isinstance(value, torch.Tensor):
        copied = value.detach().clone()
        return copied.requires_grad_(value.requires_grad) if value.is_floating_point() else copied
    return copy.deepcopy(value)


def to_device(value):
    if isinstance(value, torch.Tensor):
        moved = value.detach().to(DEVICE)
        return moved.requires_grad_(value.requires_grad) if value.is_floating_point() else moved
    return value


def floating(outputs) -> list[torch.Tensor]:
    return [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def compare(expected, got, random: bool) -> None:
    expected_leaves, _ = tree_flatten(expected)
    got_leaves, _ = tree_flatten(got)
    assert len(expected_leaves) == len(got_leaves), "different number of outputs"
    for e, g in zip(expected_leaves, got_leaves):
        if not isinstance(e, torch.Tensor):
            assert e == g or random, f"{g!r} != {e!r}"
            continue
        assert g.device == DEVICE, f"an output on {g.device}"
        assert g.dtype == e.dtype and g.shape == e.shape, f"{g.dtype}{list(g.shape)} != {e.dtype}{list(e.shape)}"
        if not random:
            torch.testing.assert_close(g.detach().cpu(), e.detach(), equal_nan=True)


def run_sample(module_info, sample, training: bool) -> tuple[str, str] | None:
    """None if the devices agree; (check, message) if not. Raises CpuFailure if the CPU fails."""
    args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
    forward_args, forward_kwargs = sample.forward_input.args, sample.forward_input.kwargs
    random = any(name in module_info.name for name in RANDOM_MODULES)
    try:
        torch.manual_seed(0)
        cpu_module = module_info.module_cls(*args, **kwargs).train(training)
        if module_info.is_lazy:
            cpu_module(*tree_map(fresh_copy, forward_args), **tree_map(fresh_copy, forward_kwargs))
        device_module = copy.deepcopy(cpu_module).to(DEVICE)
        cpu_args, cpu_kwargs = tree_map(fresh_copy, forward_args), tree_map(fresh_copy, forward_kwargs)
        torch.manual_seed(0)
        expected = cpu_module(*cpu_args, **cpu_kwargs)
        expected_float = floating(expected)
        if expected_float:
            sum(t.sum() for t in expected_float).backward()
    except Exception as error:  # noqa: BLE001 - any CPU failure excludes the sample
        raise CpuFailure(f"{type(error).__name__}: {error}") from None
    device_args, device_kwargs = tree_map(to_device, forward_args), tree_map(to_device, forward_kwargs)
    check = "forward"
    try:
        torch.cuda.manual_seed(0)
        got = device_module(*device_args, **device_kwargs)
        compare(expected, got, random)
        if expected_float:
            check = "backward"
            sum(t.sum() for t in floating(got)).backward()
            for (name, p_cpu), p_device in zip(cpu_module.named_parameters(), device_module.parameters()):
                if p_cpu.grad is None:
                    assert p_device.grad is None, f"{name}: a gradient on the device only"
                    continue
                assert p_device.grad is not None and p_device.grad.device == DEVICE, f"{name}: no device gradient"
                if not random:
                    torch.testing.assert_close(p_device.grad.cpu(), p_cpu.grad, equal_nan=True,
                                               msg=lambda m, name=name: f"{name}: {m}")
            for a_cpu, a_device in zip(tree_flatten((cpu_args, cpu_kwargs))[0], tree_flatten((device_args, device_kwargs))[0]):
                if isinstance(a_cpu, torch.Tensor) and a_cpu.grad is not None and not random:
                    torch.testing.assert_close(a_device.grad.cpu(), a_cpu.grad, equal_nan=True)
    except Exception as error:  # noqa: BLE001 - recorded per sample
        return check, f"{type(error).__name__}: {' '.join(str(error).split())}"[:400]
    return None


class CpuFailure(Exception):
    pass


def main() -> int:
    warnings.simplefilter("ignore")
    start = time.time()
    stats = {"passed": 0, "failed": 0, "known_on_a_gpu": 0, "excluded_cpu_failure": 0}
    failures, known = [], []
    for module_info in module_db:
        if torch.float32 not in module_info.dtypes:
            continue
        marked = known_on_a_gpu(module_info)
        modes = (True, False) if module_info.train_and_eval_differ else (True,)
        for training in modes:
            # The inputs are random draws: seeded here, each module's samples are the same
            # whatever ran before them (unseeded, a sample's values depended on the sweep's order).
            torch.manual_seed(0)
            samples = module_info.module_inputs_func(module_info, device="cpu", dtype=torch.float32,
                                                     requires_grad=True, training=training)
            for index, sample in enumerate(samples):
                try:
                    outcome = run_sample(module_info, sample, training)
                except CpuFailure:
                    stats["excluded_cpu_failure"] += 1
                    continue
                if outcome is None:
                    stats["passed"] += 1
                    continue
                record = {"module": module_info.name, "sample": index, "training": training,
                          "check": outcome[0], "message": outcome[1]}
                if marked:
                    stats["known_on_a_gpu"] += 1
                    known.append({**record, "marked": marked})
                else:
                    stats["failed"] += 1
                    failures.append(record)
    total = stats["passed"] + stats["failed"]
    for f in failures:
        print(f"FAIL {f['module']} sample {f['sample']} training={f['training']} {f['check']}: {f['message']}",
              file=sys.stderr)
    print(json.dumps({"module_sweep": 1, **stats, "total": total, "fraction": stats["passed"] / max(total, 1),
                      "seconds": round(time.time() - start, 1), "failures": failures, "known": known}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
