"""CUDA's random generators as CUDA has them: a Philox state of (seed, offset) per device.

What a program can observe: the 16-byte state (seed, then offset, as uint64s), the offset's
arithmetic (a multiple of 4; an op on n elements of the common distributions moves it by n
rounded up to 4), CUDA's errors, resume from a saved state bit for bit, graph-safe state
sharing, and values that depend on (seed, offset, element index) only.
"""

import pytest
import torch


def offset_of(state: torch.Tensor) -> int:
    return int.from_bytes(bytes(state[8:].tolist()), "little")


def seed_of(state: torch.Tensor) -> int:
    return int.from_bytes(bytes(state[:8].tolist()), "little")


def test_state_is_cudas_seed_and_offset():
    torch.cuda.manual_seed(1234)
    state = torch.cuda.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.numel() == 16
    assert (seed_of(state), offset_of(state)) == (1234, 0)
    assert torch.cuda.initial_seed() == 1234
    torch.rand(10, device="cuda")  # 10 counters, rounded up to 4
    assert offset_of(torch.cuda.get_rng_state()) == 12
    torch.randn(3, 5, device="cuda")
    assert offset_of(torch.cuda.get_rng_state()) == 28
    assert torch.cuda.default_generators[0].device == torch.device("cuda", 0)
    assert torch.Generator(device="cuda").device == torch.device("cuda", torch.cuda.current_device())


def test_resume_from_a_saved_state_is_bit_for_bit():
    torch.cuda.manual_seed_all(7)
    torch.rand(100, device="cuda:1")
    saved = torch.cuda.get_rng_state_all()
    first = [torch.randn(33, device="cuda:1"), torch.rand(8, 8, device="cuda:1", dtype=torch.bfloat16),
             torch.nn.functional.dropout(torch.ones(64, device="cuda:1"), 0.5),
             torch.randint(0, 100, (16,), device="cuda:1"), torch.randperm(20, device="cuda:1")]
    torch.cuda.set_rng_state_all(saved)
    again = [torch.randn(33, device="cuda:1"), torch.rand(8, 8, device="cuda:1", dtype=torch.bfloat16),
             torch.nn.functional.dropout(torch.ones(64, device="cuda:1"), 0.5),
             torch.randint(0, 100, (16,), device="cuda:1"), torch.randperm(20, device="cuda:1")]
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_values_are_a_function_of_seed_offset_and_element_index():
    g = torch.Generator(device="cuda").manual_seed(99)
    whole = torch.empty(64, device="cuda").normal_(generator=g)
    g.manual_seed(99)
    g.set_offset(32)  # the counters of elements 32..63
    tail = torch.empty(32, device="cuda").normal_(generator=g)
    assert torch.equal(whole[32:], tail)
    g.manual_seed(100)
    assert not torch.equal(torch.empty(64, device="cuda").normal_(generator=g), whole)  # seeds are independent


def test_generators_are_independent_and_deterministic():
    a = torch.Generator(device="cuda").manual_seed(5)
    b = torch.Generator(device="cuda").manual_seed(5)
    x = torch.rand(1000, device="cuda", generator=a)
    torch.rand(10, device="cuda")  # the default generator does not move a or b
    assert torch.equal(x, torch.rand(1000, device="cuda", generator=b))
    assert not torch.equal(x, torch.rand(1000, device="cuda", generator=a))  # a moved on


def test_distributions_have_their_moments_and_bounds():
    torch.cuda.manual_seed(0)
    n = torch.randn(200_000, device="cuda", dtype=torch.float64)
    assert abs(n.mean().item()) < 0.01 and abs(n.std().item() - 1) < 0.01
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        u = torch.empty(200_000, device="cuda", dtype=dtype).uniform_(-2, 3)
        assert u.min().item() >= -2 and u.max().item() < 3 and abs(u.float().mean().item() - 0.5) < 0.02
    p = torch.linspace(0, 1, 11, device="cuda").repeat(20_000)
    drawn = torch.bernoulli(p).view(20_000, 11).mean(0)
    assert torch.allclose(drawn.cpu(), torch.linspace(0, 1, 11), atol=0.02)


def test_cudas_errors():
    g = torch.Generator(device="cuda")
    with pytest.raises(RuntimeError, match="offset must be a multiple of 4"):
        g.set_offset(6)
    with pytest.raises(RuntimeError, match="RNG state is wrong size"):
        torch.cuda.set_rng_state(torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
        torch.rand(3, device="cuda", generator=torch.Generator())
    with pytest.raises(RuntimeError, match="from"):  # PyTorch's own check of the bounds still runs
        torch.empty(3, device="cuda").uniform_(2, 1)


def test_graphsafe_state_is_shared():
    g = torch.Generator(device="cuda").manual_seed(11)
    shared = g.graphsafe_get_state()
    torch.rand(8, device="cuda", generator=shared)
    assert g.get_offset() == 8  # one state behind both
    other = torch.Generator(device="cuda").manual_seed(12)
    g.graphsafe_set_state(other)
    assert g.initial_seed() == 12


def test_a_complex_tensor_draws_its_parts_as_a_real_tensor_of_twice_its_elements():
    """CUDA's uniform_ and normal_ fill a complex tensor through view_as_real (normal_ with
    std / sqrt(2) per part, so each complex value has the std asked for): the same counters as a
    real tensor of twice the elements."""
    g = torch.Generator(device="cuda").manual_seed(7)
    z = torch.empty(50_000, device="cuda", dtype=torch.complex64).uniform_(-1, 2, generator=g)
    g.manual_seed(7)
    real = torch.empty(100_000, device="cuda").uniform_(-1, 2, generator=g)
    assert torch.equal(torch.view_as_real(z).flatten(), real) and g.get_offset() == 100_000
    n = torch.empty(200_000, device="cuda", dtype=torch.complex128).normal_(1.0, 2.0)
    parts = torch.view_as_real(n)
    assert abs(parts.mean().item() - 1) < 0.02 and abs(parts.std().item() - 2 / 2**0.5) < 0.02
