"""A training step under the user's own torch.profiler (ProfilerActivity CPU and CUDA, with_stack,
record_function nesting), as a performance engineer profiles on a GPU box. It writes the Chrome
trace to argv[1] and prints, as one JSON line, the key_averages() keys; tests/test_user_profiler.py
reads both.

No warm-up step: every shape is first seen inside the profiled region, so whatever mirage does
the first time it meets a kernel (its FLOP count in clocked mode) happens while profiling."""

import json
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function


def main(trace_path: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")
    a = torch.randn(48, 96, device="cuda")
    q, k, v = (torch.randn(2, 4, 16, 32, device="cuda") for _ in range(3))
    # The first record_function of a process imports torch.profiler._cupti_monitor inside the
    # profiled region, and torch 2.13's Python tracer then names that module's frame from its
    # code object after the import dropped it (seen: "(0): ", or bytes key_averages() fails to
    # decode, about 1 run in 5), on any build. A first profile with an empty record_function does
    # that import; it holds no op of the step.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True):
        with record_function("import torch.profiler._cupti_monitor"):
            pass
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 record_shapes=True) as prof:
        with record_function("train_step"):
            with record_function("matmul"):
                b = a @ a.T
            with record_function("attention"):
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            loss = model(x).square().mean() + b.mean() + attn.mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    print(json.dumps({"keys": sorted({e.key for e in prof.key_averages()})}))


if __name__ == "__main__":
    main(sys.argv[1])
