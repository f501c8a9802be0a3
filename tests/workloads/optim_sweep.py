"""Optimizer sweep: every OptimizerInfo of PyTorch's optim_db, on an emulated GPU against the CPU.

Run under `mirage run --gpus-per-node 1 -- python tests/workloads/optim_sweep.py`. For every
optimizer input that optim_db gives for cuda (its kwargs: capturable, amsgrad, maximize, weight
decay, ...) and every implementation the optimizer has on CUDA (the for-loop one; foreach where
supported; fused where optim_db says CUDA supports it), the same two-layer model (2-D parameters
only, so every optimizer takes it) trains for 5 steps on cuda:0 and on the CPU with the same
implementation (capturable, which a CPU refuses, only on the device; where the CPU refuses the
combination, e.g. a Tensor lr with foreach, the CPU's for-loop implementation is the reference); after every step the
parameters (and the loss a closure returned) are compared, with the dtype's default tolerance. An
optimizer that takes sparse gradients only (SparseAdam) trains the same parameters as two
embedding tables with sparse gradients (sparse COO tensors on the device).

The last line of stdout is one JSON object: {"optim_sweep": 1, "passed", "failed", "total",
"fraction", "failures": [{"optimizer", "input", "impl", "step", "message"}], "skipped": {...}}.
"""

from __future__ import annotations

import json
import sys
import time
import warnings

import torch
from torch.testing._internal.common_optimizers import optim_db

DEVICE = torch.device("cuda", 0)
STEPS = 5


def make_params(device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(8, 6, generator=generator).to(device).requires_grad_(),
            torch.randn(4, 8, generator=generator).to(device).requires_grad_()]


def loss_of(params: list[torch.Tensor], sparse_gradients: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    if sparse_gradients:  # rows of each parameter looked up as an embedding: sparse COO gradients
        rows = torch.tensor([1, 5, 5, 7]).to(params[0].device)
        first = torch.nn.functional.embedding(rows, params[0], sparse=True)
        second = torch.nn.functional.embedding(rows % 4, params[1], sparse=True)
        return (torch.relu(first).sum(1) - second.square().sum(1)).square().sum()
    x = torch.randn(6, 3, generator=generator).to(params[0].device)
    target = torch.randn(4, 3, generator=generator).to(params[0].device)
    return (params[1] @ torch.relu(params[0] @ x) - target).square().sum()


def train(optim_info, kwargs: dict, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """The parameters (and the closure's loss) after each step."""
    params = make_params(device)
    optimizer = optim_info.optim_cls(params, **kwargs)

    def closure():
        optimizer.zero_grad()
        loss = loss_of(params, optim_info.only_supports_sparse_grads)
        loss.backward()
        return loss

    history = []
    for _ in range(STEPS):
        if optim_info.step_requires_closure:
            loss = optimizer.step(closure)
        else:
            closure()
            loss = optimizer.step()
        entry = tuple(p.detach().cpu().clone() for p in params)
        if isinstance(loss, torch.Tensor):
            entry += (loss.detach().cpu(),)
        history.append(entry)
    return history


def implementations(optim_info, kwargs: dict) -> list[tuple[str, dict]]:
    """(name, extra kwargs) of each CUDA implementation that applies to these kwargs."""
    impls = [("forloop", {"foreach": False} if "foreach" in optim_info.supported_impls else {})]
    if "foreach" in optim_info.supported_impls and "foreach" not in kwargs and not kwargs.get("differentiable"):
        impls.append(("foreach", {"foreach": True}))
    if ("cuda" in optim_info.supports_fused_on and not kwargs.get("differentiable")
            and "foreach" not in kwargs):
        impls.append(("fused", {"fused": True}))
    return impls


def main() -> int:
    warnings.simplefilter("ignore")
    start = time.time()
    passed = failed = 0
    failures, skipped = [], {}
    for optim_info in optim_db:
        for optim_input in optim_info.optim_inputs_func(device="cuda"):
            kwargs = dict(optim_input.kwargs)
            for impl, extra in implementations(optim_info, kwargs):
                record = {"optimizer": optim_info.name, "input": optim_input.desc, "impl": impl}
                cpu_kwargs = {k: v for k, v in {**kwargs, **extra}.items() if k != "capturable"}
                try:
                    expected = train(optim_info, cpu_kwargs, torch.device("cpu"))
                except ValueError:  # a combination only a GPU takes (Tensor lr + foreach needs capturable)
                    record["reference"] = "CPU for-loop"
                    forloop = {k: v for k, v in cpu_kwargs.items() if k not in ("foreach", "fused")}
                    expected = train(optim_info, forloop, torch.device("cpu"))
                try:
                    got = train(optim_info, {**kwargs, **extra}, DEVICE)
                    for step, (e, g) in enumerate(zip(expected, got)):
                        record["step"] = step
                        for a, b in zip(e, g):
                            torch.testing.assert_close(b, a, equal_nan=True)
                    passed += 1
                except Exception as error:  # noqa: BLE001 - recorded per case
                    failed += 1
                    failures.append({**record, "message": f"{type(error).__name__}: {' '.join(str(error).split())}"[:400]})
    total = passed + failed
    for f in failures:
        print(f"FAIL {f['optimizer']} [{f['input']}] {f['impl']} step {f.get('step')}: {f['message']}", file=sys.stderr)
    print(json.dumps({"optim_sweep": 1, "passed": passed, "failed": failed, "total": total,
                      "fraction": passed / max(total, 1), "seconds": round(time.time() - start, 1),
                      "failures": failures, "skipped": skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
