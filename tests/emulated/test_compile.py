"""torch.compile on an emulated GPU: inductor's host code runs on device memory, with eager's
results (within inductor's CPU tolerances), gradients too."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

DEVICE = torch.device("cuda", 1)


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    """Token and position embeddings, two attention blocks, the head tied to the embedding."""

    def __init__(self, vocab: int = 96, width: int = 32, heads: int = 4, context: int = 32):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(Block(width, heads), Block(width, heads))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(self.norm(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def tokens(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 96, (4, length + 1), generator=generator).to(DEVICE)
    return idx[:, :-1], idx[:, 1:]


def test_a_compiled_gpt_matches_eager_loss_gradients_and_step():
    torch.manual_seed(0)
    eager = GPT().to(DEVICE)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model)
    idx, targets = tokens(32, seed=1)
    loss, compiled_loss = eager(idx, targets), compiled(idx, targets)
    assert compiled_loss.device == DEVICE
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    compiled_loss.backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert q.grad.device == DEVICE
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    for m in (eager, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    torch.testing.assert_close(compiled(idx, targets), eager(idx, targets), rtol=1e-5, atol=1e-5)


def test_compiled_code_reads_and_writes_device_memory_in_place_and_its_buffers_are_device_memory():
    @torch.compile(fullgraph=True)
    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x.add_(1)  # a mutated input: written where it lives
        return (x.sin() @ w).relu() @ w

    x = torch.randn(512, 512, device=DEVICE)
    w = torch.randn(512, 512, device=DEVICE)
    expected = ((x + 1).sin() @ w).relu() @ w
    before = x.clone()
    step(x.clone(), w)  # compile
    torch.cuda.synchronize(DEVICE)
    torch.cuda.reset_peak_memory_stats(DEVICE)
    base = torch.cuda.memory_allocated(DEVICE)
    busy = torch.ops.mirage.busy_time_ns(DEVICE.index)
    out = step(x, w)
    assert torch.ops.mirage.busy_time_ns(DEVICE.index) > busy  # its host kernels are the device's work
    torch.testing.assert_close(x, before + 1)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)
    one_matrix = 512 * 512 * 4
    assert torch.cuda.memory_allocated(DEVICE) - base == one_matrix  # the output, on the device
    assert torch.cuda.max_memory_allocated(DEVICE) - base >= 2 * one_matrix  # with a generated buffer


@pytest.mark.slow  # 17-20 s of compiling: MIRAGE_SLOW_TESTS=1 (docs/benchmarks.md, "The default suite")
def test_dynamic_shapes_compile_one_graph_for_every_length():
    torch.manual_seed(0)
    model = GPT().to(DEVICE)
    compiled = torch.compile(model, dynamic=True)
    for length in (16, 24, 32):
        idx, targets = tokens(length, seed=length)
        torch.testing.assert_close(compiled(idx, targets), model(idx, targets), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_graph_break_splits_the_function_and_both_parts_run_on_the_device():
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x.cos() * 2
        if y.sum().item() > 0:  # data-dependent: a graph break
            return (y + 1).exp()
        return y - 1

    x = torch.randn(64)
    torch.compile(f)(x)
    graphs_on_the_host = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    x = x.to(DEVICE)
    out = torch.compile(f)(x)
    assert out.device == DEVICE
    torch.testing.assert_close(out, f(x))
    assert counters["stats"]["unique_graphs"] == graphs_on_the_host > 1


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_modes_give_eager_results(mode):
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(DEVICE)
    compiled = torch.compile(model, mode=mode)
    x = torch.randn(16, 64, device=DEVICE)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_a_compiled_optimizer_step_updates_the_parameters_as_eager():
    torch.manual_seed(0)
    params = [torch.randn(256, 64, device=DEVICE, requires_grad=True) for _ in range(3)]
    twins = [p.detach().clone().requires_grad_() for p in params]
    for p, q in zip(params, twins):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    eager, compiled = torch.optim.AdamW(params, lr=0.01), torch.optim.AdamW(twins, lr=0.01)
    step = torch.compile(compiled.step)
    for _ in range(2):
        eager.step()
        step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_a_compiled_function_captured_in_a_cuda_graph_runs_again_on_each_replay():
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).relu() + 1

    compiled = torch.compile(f)
    x = torch.randn(32, 32, device=DEVICE)
    w = torch.randn(32, 32, device=DEVICE)
    with torch.cuda.device(DEVICE):
        compiled(x, w)  # compiled (and warmed up) before the capture, as CUDA graphs want
        graph = torch.cuda.CUDAGraph()
        # a stream of its own: torch.cuda.graph's shared default is made on the first caller's device
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(DEVICE)):
            out = compiled(x, w)
        for seed in (1, 2):
            x.copy_(torch.randn(32, 32, generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            torch.testing.assert_close(out, f(x, w))
        allocated = torch.cuda.memory_allocated(DEVICE)
        del w  # the recorded call still holds it (the graph does not own pool memory, it owns this)
        graph.reset()  # what the capture recorded goes with the graph
        assert torch.cuda.memory_allocated(DEVICE) == allocated - 32 * 32 * 4


def test_reduce_overhead_cudagraph_trees_warm_up_record_and_replay_into_the_same_memory():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh()).to(DEVICE)
    compiled = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(16, 64, device=DEVICE)
    with torch.no_grad(), torch.cuda.device(DEVICE):
        compiled(x)  # warm-up
        recorded = compiled(x + 1)
        torch.testing.assert_close(recorded, model(x + 1), rtol=1e-5, atol=1e-5)
        address = recorded.data_ptr()
        replayed = compiled(x + 2)
        assert replayed.data_ptr() == address
        torch.testing.assert_close(replayed, model(x + 2), rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="overwritten by a subsequent run"):
            recorded + 1
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.slow  # the GPT compiled again (10 s); the default suite keeps the tree tests below
def test_the_gpt_trains_under_cudagraph_trees_as_eager():
    """reduce-overhead's warm-up, recording and replays of the GPT's forward and backward; the
    warm-up's outputs must be in the tree's pool (inductor's slow-path check, on by default),
    including extern kernels' and the device-only attention kernels' results."""
    torch.manual_seed(0)
    eager = GPT().to(DEVICE)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, mode="reduce-overhead")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, model)]
    with torch.cuda.device(DEVICE):
        for seed in range(4):
            idx, targets = tokens(32, seed=seed)
            losses = [eager(idx, targets), compiled(idx, targets)]
            for loss, optimizer in zip(losses, optimizers):
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_cudagraph_trees_train_through_a_graph_break_and_new_shapes_as_eager():
    """Forward and backward graphs of two compiled parts in one tree; new batch sizes after
    replays record new branches, which restores the pool's allocator checkpoint; inductor's slow
    path asserts check after each step that the pool's live blocks are exactly the tree's."""

    class TwoParts(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(32, 32), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.first(x).relu()
            torch._dynamo.graph_break()
            return self.second(h)

    from torch._inductor import config as inductor_config
    from torch._inductor.cudagraph_trees import get_container

    torch.manual_seed(0)
    model = TwoParts().to(DEVICE)
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead")
    optimizer, twin_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    with inductor_config.patch({"triton.slow_path_cudagraph_asserts": True}), torch.cuda.device(DEVICE):
        for batch in (8, 8, 8, 16, 16, 8, 24, 16):
            x = torch.randn(batch, 32, device=DEVICE)
            loss = compiled(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            reference = twin(x).square().mean()
            reference.backward()
            twin_optimizer.step()
            twin_optimizer.zero_grad()
            torch.testing.assert_close(loss, reference)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), twin(x))
        manager = get_container(DEVICE.index).tree_manager
        assert manager.debug_checkpointing_counter > 0
    assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] > 0
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_reduce_overhead_without_trees_replays_one_cuda_graph_per_compiled_graph():
    from torch._inductor import config as inductor_config

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh()).to(DEVICE)
    with inductor_config.patch({"triton.cudagraph_trees": False}):
        compiled = torch.compile(model, mode="reduce-overhead")
        x = torch.randn(16, 64, device=DEVICE)
        with torch.no_grad(), torch.cuda.device(DEVICE):
            first = compiled(x)  # captured
            second = compiled(x + 1)  # replayed: into the same output memory, as a CUDA graph's
            assert second.data_ptr() == first.data_ptr()
            torch.testing.assert_close(second, model(x + 1), rtol=1e-5, atol=1e-5)


def test_the_same_graph_compiled_for_the_host_keeps_its_buffers_on_the_host():
    @torch.compile
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() @ x).cos() @ x

    f(torch.randn(128, 128, device=DEVICE))
    torch.cuda.reset_peak_memory_stats(DEVICE)
    before = torch.cuda.memory_allocated(DEVICE)
    out = f(torch.randn(128, 128))  # the same generated code (inductor's code cache), for "cpu"
    assert out.device.type == "cpu"
    assert torch.cuda.max_memory_allocated(DEVICE) == before


def test_aotinductor_on_an_emulated_gpu_raises_that_it_is_not_emulated(tmp_path):
    model = nn.Linear(16, 16).to(DEVICE)
    exported = torch.export.export(model, (torch.randn(4, 16, device=DEVICE),))
    with pytest.raises(NotImplementedError, match="AOTInductor .* is not emulated.*Fix:"):
        torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "model.pt2"))


def test_fused_attention_outputs_have_the_meta_kernels_shapes_strides_and_dtypes():
    """Compiled graphs assert the meta kernel's layout of every output, and DTensor's context
    parallelism wraps the philox seed and offset as it does on the real build."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (torch.randn(2, 128, 4, 64, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    real = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)
    with FakeTensorMode() as mode:
        fake = torch.ops.aten._scaled_dot_product_flash_attention(*(mode.from_tensor(t) for t in (q, k, v)),
                                                                  is_causal=True)
    for index, (r, f) in enumerate(zip(real, fake)):
        if isinstance(f, torch.Tensor) and f.numel() > 0:
            assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), index
        elif isinstance(f, torch.Tensor):
            assert (r.shape, r.dtype) == (f.shape, f.dtype), index


def test_compiled_activation_checkpointing_replays_the_generator_around_attention():
    """Selective activation checkpointing under torch.compile (torchtitan's default): AOTAutograd
    recomputes the random-seeded attention op in the backward through graphsafe_run_with_rng_state,
    which the host graph runs with the device generator."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = checkpoint_wrapper(Block(64, 4).to(DEVICE, torch.bfloat16))  # as torchtitan: wrapped, then compiled
    x = torch.randn(2, 128, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)

    def step(block: nn.Module) -> list[torch.Tensor]:
        x.grad = None
        model.zero_grad()
        block(x).float().square().mean().backward()
        return [x.grad, *(p.grad for p in model.parameters())]

    eager = step(model)
    compiled = step(torch.compile(model))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=2e-2, rtol=2e-2)
