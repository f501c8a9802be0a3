"""FlexAttention on an emulated GPU, eager and compiled, forward and backward (issue 38): its
outputs, logsumexp and gradients (q, k, v and a learned bias score_mod captures) against torch's
eager dense reference (torch._higher_order_ops.flex_attention.math_attention, what FlexAttention
runs on a device without a kernel) on CPU copies; and its memory, which must not be S x S.

Tolerances are those of PyTorch's own FlexAttention tests (test/inductor/test_flex_attention.py,
TestFlexAttention._check_equal/_check_out_and_grad): against a float64 "golden" run, the mean
absolute error of the device's result may be at most 10x (float32) or 1.1x (bfloat16/float16) that
of the reference run in the same dtype."""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch._higher_order_ops.flex_attention import math_attention
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention, or_masks

DEVICE = torch.device("cuda", 0)
B, HQ, S, D = 2, 4, 256, 32
BLOCK = 64  # 4 x 4 blocks of a 256 x 256 mask: partial, full and skipped blocks all occur


pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@dataclass
class Case:
    """A mask_mod and score_mod, built from the tensors they capture on one device."""

    name: str
    mask: Callable  # (captured tensors) -> mask_mod
    score: Callable  # (captured tensors) -> score_mod
    mask_batch: int | None = None  # the BlockMask's batch and heads (None: broadcast)
    mask_heads: int | None = None
    kv_heads: int = HQ
    empty_rows: bool = False  # rows with no key: logsumexp -inf, left out of the loss


def documents() -> torch.Tensor:
    """Each batch row a different jagged packing of documents: doc id per position."""
    lengths = [[40, 100, 16, 100], [7, 200, 49]]
    return torch.stack([torch.repeat_interleave(torch.arange(len(l)), torch.tensor(l)) for l in lengths])


def identity(t: dict) -> Callable:
    return lambda score, b, h, q, kv: score


def causal(t: dict) -> Callable:
    return lambda b, h, q, kv: q >= kv


def document_causal(t: dict) -> Callable:
    doc = t["doc"]
    return lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv)


def sliding_window_by_head(t: dict) -> Callable:
    return lambda b, h, q, kv: (q >= kv) & (q - kv <= 24 * (h + 1))


def prefix_lm(t: dict) -> Callable:
    return or_masks(lambda b, h, q, kv: kv < 70, lambda b, h, q, kv: q >= kv)


def late_start(t: dict) -> Callable:
    return lambda b, h, q, kv: (q >= 40) & (kv <= q)


def alibi(t: dict) -> Callable:
    return lambda score, b, h, q, kv: score + torch.exp2(-((h + 1) * 8.0 / HQ)) * (kv - q)


def soft_cap(t: dict) -> Callable:
    return lambda score, b, h, q, kv: 20 * torch.tanh(score / 20)


def relative_bias(t: dict) -> Callable:
    bias = t["bias"]
    return lambda score, b, h, q, kv: score + bias[h, q - kv + S - 1]


CASES = [
    Case("causal", causal, identity),
    Case("document_softcap", document_causal, soft_cap, mask_batch=B),
    Case("sliding_window_alibi", sliding_window_by_head, alibi, mask_heads=HQ),
    Case("prefix_lm_relative_bias", prefix_lm, relative_bias),
    Case("gqa_causal", causal, alibi, kv_heads=2),
    Case("rows_with_no_key", late_start, identity, empty_rows=True),
]


def captured(tensors: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict:
    """What the mods capture: document ids, and a learned relative bias (a leaf that wants a grad)."""
    return {"doc": documents().to(device), "bias": tensors[5].to(device, dtype, copy=True).requires_grad_()}


def inputs(case: Case, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v, the output's and logsumexp's incoming gradients, the bias: values of `dtype`."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(B, HQ, S, D), (B, case.kv_heads, S, D), (B, case.kv_heads, S, D), (B, HQ, S, D), (B, HQ, S),
              (HQ, 2 * S - 1)]
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def reference(case: Case, tensors: list[torch.Tensor], dtype: torch.dtype) -> dict:
    """torch's dense eager FlexAttention on CPU copies in `dtype`: output, lse and gradients."""
    q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in tensors[:3])
    t = captured(tensors, torch.device("cpu"), dtype)
    out, lse, _ = math_attention(q, k, v, case.score(t), (case.mask(t),), 1 / math.sqrt(D), {})
    lse = lse * math.log(2)  # the op's log2 logsumexp, as the public API converts it
    backward(case, out, lse, tensors)
    return {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad, "dbias": t["bias"].grad}


def backward(case: Case, out: torch.Tensor, lse: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    loss = (out * tensors[3].to(out)).sum()
    if not case.empty_rows:
        loss = loss + (lse * tensors[4].to(lse)).sum()
    loss.backward()


def on_device(case: Case, tensors: list[torch.Tensor], dtype: torch.dtype, compiled: bool) -> dict:
    q, k, v = (t.to(DEVICE, dtype, copy=True).requires_grad_() for t in tensors[:3])
    t = captured(tensors, DEVICE, dtype)
    mask = create_block_mask(case.mask(t), case.mask_batch, case.mask_heads, S, S, device=DEVICE, BLOCK_SIZE=BLOCK)
    attend = torch.compile(flex_attention) if compiled else flex_attention
    out, aux = attend(q, k, v, score_mod=case.score(t), block_mask=mask, enable_gqa=case.kv_heads != HQ,
                      return_aux=AuxRequest(lse=True))
    lse = aux.lse
    assert out.device == DEVICE and lse.device == DEVICE
    backward(case, out, lse, tensors)
    return {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad, "dbias": t["bias"].grad}


def check_equal(golden: torch.Tensor, ref: torch.Tensor, result: torch.Tensor, fudge: float, name: str) -> None:
    """PyTorch's FlexAttention test rule: the result's mean error against float64 is at most
    `fudge` times the same-dtype reference's."""
    finite = torch.isfinite(golden)  # rows with no key: -inf logsumexp, compared exactly below
    torch.testing.assert_close(result.cpu()[~finite].double(), golden[~finite], msg=name)
    error = (golden[finite] - result.cpu()[finite].double()).abs().mean()
    ref_error = (golden[finite] - ref[finite].double()).abs().mean()
    assert not torch.isnan(error), name
    assert error <= ref_error * fudge, f"{name}: error {error} > {fudge} x the reference's {ref_error}"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_flex_attention_matches_torchs_reference_forward_and_backward(case: Case, compiled: bool):
    tensors = inputs(case, torch.float32)
    golden = reference(case, tensors, torch.float64)
    ref = reference(case, tensors, torch.float32)
    result = on_device(case, tensors, torch.float32, compiled)
    for name in ("out", "lse", "dq", "dk", "dv") + (("dbias",) if case.score is relative_bias else ()):
        check_equal(golden[name], ref[name], result[name], 10.0, name)
    if case.score is not relative_bias:
        assert result["dbias"] is None


@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=[CASES[1].name, CASES[3].name])
def test_compiled_flex_attention_in_bfloat16(case: Case):
    tensors = inputs(case, torch.bfloat16)
    golden = reference(case, tensors, torch.float64)
    ref = reference(case, tensors, torch.bfloat16)
    result = on_device(case, tensors, torch.bfloat16, compiled=True)
    assert result["out"].dtype == torch.bfloat16 and result["dq"].dtype == torch.bfloat16
    for name in ("out", "lse", "dq", "dk", "dv") + (("dbias",) if case.score is relative_bias else ()):
        check_equal(golden[name], ref[name], result[name], 1.1, name)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_without_a_block_mask(compiled: bool):
    """No block_mask: torch builds one block of 2**30 x 2**30 positions (_create_empty_block_mask),
    which the device must read as "the whole sequence" (it once tried to list 2**30 KV positions:
    a 32 GiB allocation)."""
    case = Case("no_mask", lambda t: (lambda b, h, q, kv: q >= 0), identity)
    tensors = inputs(case, torch.float32)
    golden = reference(case, tensors, torch.float64)
    ref = reference(case, tensors, torch.float32)
    q, k, v = (t.to(DEVICE, copy=True).requires_grad_() for t in tensors[:3])
    attend = torch.compile(flex_attention) if compiled else flex_attention
    out, aux = attend(q, k, v, return_aux=AuxRequest(lse=True))
    backward(case, out, aux.lse, tensors)
    for name, result in (("out", out), ("lse", aux.lse), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        check_equal(golden[name], ref[name], result, 10.0, name)


def test_peak_memory_at_sequence_8192_is_far_below_the_dense_scores():
    """Compiled and eager, forward and backward at S=8192: the device's peak over what it held
    before is a fraction of the B x H x S x S float32 scores torch's dense reference would build
    (measured: 86 MiB for 2 heads, against 512 MiB)."""
    length, heads = 8192, 1
    q, k, v = (torch.randn(1, heads, length, 64, device=DEVICE, requires_grad=True) for _ in range(3))
    mask = create_block_mask(causal({}), None, None, length, length, device=DEVICE)
    dense = heads * length * length * 4
    for name, attend in (("compiled", torch.compile(flex_attention)), ("eager", flex_attention)):
        torch.cuda.synchronize(DEVICE)
        before = torch.cuda.memory_allocated(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
        attend(q, k, v, block_mask=mask).sum().backward()
        peak = torch.cuda.max_memory_allocated(DEVICE) - before
        print(f"{name}: peak {peak / 2**20:.0f} MiB, dense scores {dense / 2**20:.0f} MiB")
        assert peak < dense / 4
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
        q.grad = k.grad = v.grad = None


def rejected(score_mod: Callable | None, mask_mod: Callable, backend: str, head_dim: int = 16) -> BaseException:
    """The error a compiled training call with these mods raises on the device."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 128, head_dim, device=DEVICE, requires_grad=True) for _ in range(3))
    with pytest.raises(Exception) as caught:
        mask = create_block_mask(mask_mod, 1, 1, 128, 128, device=DEVICE)
        torch.compile(flex_attention, backend=backend)(q, k, v, score_mod=score_mod, block_mask=mask).sum().backward()
    return caught.value


BAD_MODS = {
    "score_mod_returns_a_stack": (lambda s, b, h, q, kv: torch.stack([s, s]), causal({})),
    "score_mod_returns_an_int": (lambda s, b, h, q, kv: 0, causal({})),
    "mask_mod_returns_ints": (None, lambda b, h, q, kv: q - kv),
}


@pytest.mark.parametrize("mods", BAD_MODS.values(), ids=BAD_MODS.keys())
def test_a_mod_torch_rejects_fails_with_torchs_error(mods: tuple):
    """These are rejected while torch traces the call, before any device code: inductor on the
    device raises what torch raises with no compiler at all (aot_eager), from torch's code."""
    error, expected = rejected(*mods, "inductor"), rejected(*mods, "aot_eager")
    assert type(error) is type(expected) and str(error) == str(expected)
    assert "/mirage/" not in traceback.extract_tb(error.__traceback__)[-1].filename


def test_what_inductors_cuda_lowering_rejects_is_rejected_with_its_error():
    """Two refusals of inductor's CUDA lowering (torch/_inductor/kernel/flex/flex_attention.py) that
    no other path makes: a captured buffer that wants a gradient indexed twice, and head dims
    below 16 (Triton's tl.dot)."""
    bias = torch.randn(128, device=DEVICE, requires_grad=True)
    error = rejected(lambda s, b, h, q, kv: s + bias[q] + bias[kv], causal({}), "inductor")
    assert isinstance(error, NotImplementedError)
    assert str(error).startswith("Using multiple indexing operations on the same tensor that requires gradients")
    error = rejected(None, causal({}), "inductor", head_dim=8)
    assert "NYI: embedding dimension of the query, key, and value must be at least 16" in str(error)


def test_a_score_mod_that_gives_the_score_no_gradient_fails_in_training_as_on_cuda():
    """`score > 0` leaves the score no gradient. On an H200 (torch 2.11) the compiled call failed in
    inductor's lowering (AssertionError "joint_subgraph_buffer is None - this is a bug!") and the
    uncompiled one in torch's dense backward (a ValueError of vmap: the joint graph "must only
    return Tensors"); torch 2.13's lowering makes the same assertion."""
    error = rejected(lambda s, b, h, q, kv: s > 0, causal({}), "inductor")
    assert "joint_subgraph_buffer is None - this is a bug!" in str(error)
    error = rejected(lambda s, b, h, q, kv: s > 0, causal({}), "aot_eager")
    assert isinstance(error, ValueError) and "must only return Tensors" in str(error)
