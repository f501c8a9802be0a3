"""FlexAttention on the emulated GPUs: block-sparse, in eager and compiled calls, forward and backward.

On a GPU, torch.compile lowers FlexAttention's higher-order ops (flex_attention and
flex_attention_backward) to Triton kernels that visit only the KV blocks a BlockMask lists. mirage
compiles device graphs with inductor's C++ backend (inductor.py), whose FlexAttention template is
forward-only ("torch.compile on CPU only supports inference"), and eager FlexAttention runs torch's
dense reference, which builds the S x S score matrix of every head (one head at sequence 8192, with
this file's backward: 836 MiB of device memory at the peak of a forward and backward, against 43 MiB
with its forward too). Neither can train a model as it trains on a GPU.

So on an emulated device both ops run the implementation here, which does what the GPU kernels do
with ordinary tensor operations on the device (its memory is device memory, counted as such):

- per query block, only the KV blocks the BlockMask lists (kv_num_blocks/kv_indices, evaluated
  with mask_mod, and full_kv_num_blocks/full_kv_indices, where mask_mod is not evaluated) are
  gathered; score_mod and mask_mod are vmapped over them as torch's reference vmaps them, with each
  (batch, head)'s own KV positions; the softmax keeps its logsumexp (the ops return it in log2
  units, as torch's kernels do);
- the backward takes the forward's out and logsumexp, as the GPU kernel and torch's reference do,
  recomputes each query block's scores under autograd, forms the scores' gradient from the softmax
  weights exp(score - logsumexp) and delta = out . grad_out, and takes dq and the gradients of
  score_mod's captured buffers (a learned bias) with torch.autograd.grad (score_mod's derivative is
  autograd's, as in eager); dk and dv are scatter-added into the KV positions gathered.

Peak memory is a query block's scores (B x H x block x listed keys), never S x S.

In clocked mode a call is one GPU kernel, as FlexAttention's Triton kernel is: its ops are not
timed alone, and it is costed by the attention model from the FLOPs of the blocks it visits
(every listed block whole, as the kernel computes it: 4 x D per query-key pair forward, 2.5 times
that backward, the flash-attention convention) and the bytes of its operands and results.

Eager calls reach it through a py_impl of the ops for the CUDA dispatch key (emulated tensors
carry it). A compiled graph is handed to inductor as a host graph (inductor.py), where each
flex node becomes a call of a host operator (`mirage_host::flex_attention` and its backward)
that inductor calls as an extern kernel: it moves its arguments to the device (views, no copies)
and runs the same implementation there. The node's score_mod and mask_mod, subgraphs an operator
cannot take, are kept in a table this process fills as it rewrites the node; the generated code
names them by their index (an FX graph cache hit in another process is safe: the table is filled
when the graph is rewritten, before inductor looks the graph up).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Sequence

_LN2 = math.log(2.0)
# BlockMask.as_tuple(): Q_LEN, KV_LEN, its tensors (or None), Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod
_MASK_TENSORS = slice(2, -3)


def _vmap_bhmn(fn: Callable, torch: ModuleType, with_score: bool, buffers: int) -> Callable:
    """fn(score?, b, h, q_idx, kv_idx, *buffers) on scalars, vmapped to scores [B, H, R, L] with
    b [B], h [H], q_idx [R] and kv_idx [B, H, L]: each (batch, head) attends to its own KV positions
    (those its BlockMask row lists), so kv_idx is mapped along the batch and head dims too."""
    prefix, suffix = ((0,) if with_score else ()), (None,) * buffers
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, 0), (0, None, None, 0)):
        fn = torch.vmap(fn, in_dims=prefix + dims + suffix)
    return fn


@dataclass
class _Call:
    """One call's operands and the BlockMask's geometry, expanded to the query's batch and heads."""

    query: Any
    key: Any
    value: Any
    score_mod: Callable
    mask_mod: Callable
    scale: float
    score_buffers: tuple
    mask_buffers: tuple
    kv_num: Any  # [B, Hq, query blocks]
    kv_indices: Any
    full_num: Any  # None when the mask lists no full blocks
    full_indices: Any
    q_block: int
    kv_block: int
    work: Any  # working precision: float64 for float64 inputs, float32 otherwise (torch's reference)


def _call(torch: ModuleType, query: Any, key: Any, value: Any, score_mod: Callable, block_mask: tuple,
          scale: float, score_buffers: tuple, mask_buffers: tuple) -> _Call:
    """The call's operands, with the BlockMask's rows broadcast to every (batch, query head)."""
    batch, heads = query.size(0), query.size(1)
    if not (key.size(0) == batch or key.size(0) == 1):
        raise RuntimeError(f"Bq and Bkv must broadcast. Got Bq={batch} and Bkv={key.size(0)}")
    kv_num, kv_indices, full_num, full_indices = block_mask[2:6]
    # A block wider than the sequence (the default BlockMask's 2**30) covers it: clamped, so that a
    # block's KV positions and its cost are the sequence's, not 2**30's
    q_block = min(int(block_mask[-3]), query.size(2))
    kv_block = min(int(block_mask[-2]), key.size(2))

    def expand(t: Any) -> Any:
        return None if t is None else t.expand(batch, heads, *t.shape[2:])

    return _Call(query, key, value, score_mod, block_mask[-1], scale, tuple(score_buffers), tuple(mask_buffers),
                 expand(kv_num), expand(kv_indices), expand(full_num), expand(full_indices), q_block, kv_block,
                 torch.float64 if query.dtype == torch.float64 else torch.float32)


@dataclass
class _Block:
    """A query block's rows and the KV positions its BlockMask row lists for each (batch, head)."""

    span: slice  # its query positions
    rows: Any  # [R] the same, on the device
    tokens: Any  # [B, H, L] KV positions, clamped into range
    valid: Any  # [B, H, L] listed and inside the sequence
    partial: int  # the first `partial` of the L positions are in partial blocks: mask_mod applies


def _blocks(torch: ModuleType, call: _Call):
    """The query blocks, each with the KV positions to attend to (padded to the widest row)."""
    q_len, kv_len = call.query.size(2), call.key.size(2)
    device = call.query.device
    count = (q_len + call.q_block - 1) // call.q_block
    if count > call.kv_num.size(-1):
        raise RuntimeError(f"flex_attention: the BlockMask has {call.kv_num.size(-1)} query blocks of "
                           f"{call.q_block}, fewer than a query of length {q_len} needs")
    widest_partial = call.kv_num[..., :count].amax(dim=(0, 1)).tolist()
    widest_full = ([0] * count if call.full_num is None else call.full_num[..., :count].amax(dim=(0, 1)).tolist())
    offsets = torch.arange(call.kv_block, device=device)
    for i in range(count):
        span = slice(i * call.q_block, min((i + 1) * call.q_block, q_len))
        rows = torch.arange(span.start, span.stop, device=device)
        parts = []
        for num, indices, width in ((call.kv_num, call.kv_indices, widest_partial[i]),
                                    (call.full_num, call.full_indices, widest_full[i])):
            if width == 0:
                continue
            listed = torch.arange(width, device=device) < num[:, :, i, None]  # [B, H, width]
            tokens = indices[:, :, i, :width, None].long() * call.kv_block + offsets  # [B, H, width, block]
            valid = listed[..., None] & (tokens < kv_len)
            parts.append((tokens.flatten(2), valid.flatten(2)))
        if not parts:
            yield _Block(span, rows, None, None, 0)
            continue
        tokens = torch.cat([p[0] for p in parts], dim=2) if len(parts) > 1 else parts[0][0]
        valid = torch.cat([p[1] for p in parts], dim=2) if len(parts) > 1 else parts[0][1]
        yield _Block(span, rows, tokens.clamp(0, kv_len - 1), valid, widest_partial[i] * call.kv_block)


def _gather(torch: ModuleType, call: _Call, tensor: Any, tokens: Any) -> Any:
    """tensor [Bkv, Hkv, S, D] at each (batch, query head)'s KV positions: [B, Hq, L, D]."""
    batch, heads = call.query.size(0), call.query.size(1)
    device = tensor.device
    b = (torch.arange(batch, device=device) if tensor.size(0) == batch
         else torch.zeros(batch, dtype=torch.long, device=device))
    h = torch.arange(heads, device=device) // (heads // tensor.size(1))  # GQA: query head -> its KV head
    return tensor[b[:, None, None], h[None, :, None], tokens]


def _scatter_add(torch: ModuleType, call: _Call, into: Any, tokens: Any, grad: Any) -> None:
    """The adjoint of _gather: grad [B, Hq, L, D] summed into into [Bkv, Hkv, S, D]."""
    batch, heads = call.query.size(0), call.query.size(1)
    device = into.device
    b = (torch.arange(batch, device=device) if into.size(0) == batch
         else torch.zeros(batch, dtype=torch.long, device=device))
    h = torch.arange(heads, device=device) // (heads // into.size(1))
    index = (b[:, None, None].expand_as(tokens), h[None, :, None].expand_as(tokens), tokens)
    into.index_put_(index, grad, accumulate=True)


def _scores(torch: ModuleType, call: _Call, block: _Block, q: Any, k: Any, score_buffers: Sequence[Any]) -> Any:
    """One query block's scores after score_mod, in working precision, -inf where masked."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    batch, heads = q.size(0), q.size(1)
    device = q.device
    b, h = torch.arange(batch, device=device), torch.arange(heads, device=device)
    scores = (q @ k.transpose(-2, -1)) * call.scale
    score_mod = _vmap_bhmn(call.score_mod, torch, True, len(score_buffers))
    keep = block.valid[:, :, None, :].expand(-1, -1, block.rows.numel(), -1)
    with TransformGetItemToIndex():
        scores = score_mod(scores, b, h, block.rows, block.tokens, *score_buffers).to(call.work)
        if block.partial:
            mask_mod = _vmap_bhmn(call.mask_mod, torch, False, len(call.mask_buffers))
            allowed = mask_mod(b, h, block.rows, block.tokens[..., :block.partial].contiguous(), *call.mask_buffers)
            keep = torch.cat([keep[..., :block.partial] & allowed, keep[..., block.partial:]], dim=-1)
    return torch.where(keep, scores, torch.tensor(-math.inf, dtype=call.work, device=device))


def _attend(torch: ModuleType, call: _Call, block: _Block, q: Any, k: Any, v: Any,
            score_buffers: Sequence[Any]) -> tuple[Any, Any, Any]:
    """One query block's attention over its gathered keys, in working precision: (out [B, H, R, Dv],
    logsumexp [B, H, R] (natural log), max score [B, H, R]). Rows with no key left have out 0 and
    logsumexp and max -inf, as torch's reference gives them."""
    scores = _scores(torch, call, block, q, k, score_buffers)
    top = scores.amax(dim=-1)
    shift = torch.where(torch.isinf(top), 0, top).detach()
    weights = torch.exp(scores - shift[..., None])
    total = weights.sum(dim=-1)
    empty = total == 0
    total = torch.where(empty, 1, total)
    logsumexp = torch.where(empty, -math.inf, torch.log(total) + shift)
    return (weights @ v) / total[..., None], logsumexp, top


_FORWARD_KERNEL, _BACKWARD_KERNEL = 0, 1  # the shim's names for them (op_cost.cpp's fused_kernel_end)
_BACKWARD_FLOPS = 2.5  # the backward's FLOPs over the forward's: 5 block matmuls against 2


def _listed_blocks(call: _Call) -> tuple[int, int]:
    """The key blocks the BlockMask lists (the GPU kernel computes each whole, for every (batch,
    query head)), and the blocks of query rows listing them."""
    count = (call.query.size(2) + call.q_block - 1) // call.q_block
    listing = call.kv_num[..., :count]
    listed = listing.sum()
    if call.full_num is not None:
        listed = listed + call.full_num[..., :count].sum()
    return int(listed.item()), listing.numel()


@contextlib.contextmanager
def _one_kernel(torch: ModuleType, kernel: int, call: _Call, tensors: Callable[[], Sequence[Any]]):
    """Times what runs inside as the one kernel it stands for (clocked mode only; see the module's
    docstring). `tensors()`, called at the end, lists the operands and results the kernel moves."""
    if not torch.ops.mirage.clock_enabled():
        yield
        return
    torch.ops.mirage.fused_kernel_begin()  # first: the block count's read below is the kernel's, no host sync
    clocked, flops, keys_per_query_block = False, 0.0, 0.0
    try:
        head_dims = call.query.size(-1) + call.value.size(-1)
        listed, query_blocks = _listed_blocks(call)
        flops = 2.0 * listed * call.q_block * call.kv_block * head_dims * (
            _BACKWARD_FLOPS if kernel == _BACKWARD_KERNEL else 1.0)
        keys_per_query_block = listed * call.kv_block / max(query_blocks, 1)
        yield
        clocked = True
    finally:
        moved = [t for t in tensors() if isinstance(t, torch.Tensor)]
        torch.ops.mirage.fused_kernel_end(kernel if clocked else -1, call.query.device.index,
                                          sum(t.numel() * t.element_size() for t in moved),
                                          flops, call.query.dtype, call.query.size(-1), keys_per_query_block)


def _outputs_like_fake(torch: ModuleType, fake: Callable, *args: Any) -> Any:
    """Empty device tensors laid out as the op's fake implementation (what inductor planned for)
    lays out its results."""
    from torch.utils._pytree import tree_map

    device = args[0].device

    def to_meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return value

    def to_device(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        return value

    return tree_map(to_device, fake(*tree_map(to_meta, args)))


def forward(torch: ModuleType, query: Any, key: Any, value: Any, score_mod: Callable, block_mask: tuple,
            scale: float, score_buffers: tuple, mask_buffers: tuple) -> tuple[Any, Any, Any]:
    """The flex_attention op: (out, logsumexp / ln 2, max score / ln 2), block-sparse."""
    from torch._higher_order_ops.flex_attention import flex_attention_fake_impl

    call = _call(torch, query, key, value, score_mod, block_mask, scale, score_buffers, mask_buffers)
    out, logsumexp, max_scores = _outputs_like_fake(torch, flex_attention_fake_impl, query, key, value, None,
                                                    (), scale, {}, score_buffers, mask_buffers)
    with torch.no_grad(), _one_kernel(torch, _FORWARD_KERNEL, call,
                                      lambda: (query, key, value, out, logsumexp)):
        for block in _blocks(torch, call):
            rows = block.span
            if block.tokens is None:
                out[:, :, rows] = 0
                logsumexp[:, :, rows] = -math.inf
                max_scores[:, :, rows] = -math.inf
                continue
            k = _gather(torch, call, key, block.tokens).to(call.work)
            v = _gather(torch, call, value, block.tokens).to(call.work)
            o, lse, top = _attend(torch, call, block, query[:, :, rows].to(call.work), k, v, call.score_buffers)
            out[:, :, rows] = o.to(out.dtype)
            logsumexp[:, :, rows] = lse / _LN2
            max_scores[:, :, rows] = top / _LN2
    return out, logsumexp, max_scores


def _plain_dispatch(torch: ModuleType) -> Any:
    """A guard under which operators dispatch as in user code (only autocast's keys excluded). An
    op's kernel runs with the keys above it excluded: below an autograd kernel a recomputation would
    record no graph to differentiate, and below functorch's keys vmap would not batch."""
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    for name, key in torch._C.DispatchKey.__members__.items():
        if name.startswith("Autocast"):
            exclude = exclude.add(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def backward(torch: ModuleType, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, grad_out: Any,
             grad_logsumexp: Any, score_mod: Callable, block_mask: tuple, scale: float, score_buffers: tuple,
             mask_buffers: tuple, buffer_grads: Sequence[bool]) -> tuple[Any, Any, Any, tuple]:
    """The flex_attention_backward op: (dq, dk, dv, grads of score_mod's buffers; None where
    buffer_grads says none is wanted). As torch's reference and the GPU kernel do, it takes the
    forward's out and logsumexp (log2 units) as given, recomputing only the scores: the softmax's
    weights are exp(score - logsumexp), and each row's delta is out . grad_out. So its results are
    those of the out the forward returned (rounded to its dtype), not of a fresh one."""
    from torch._higher_order_ops.flex_attention import flex_attention_backward_fake_tensor_mode as fake

    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise ValueError(f"Backward pass with mixed query, key, and value dtype is not supported, got "
                         f"query.dtype={query.dtype}, key.dtype={key.dtype}, and value.dtype={value.dtype}")
    call = _call(torch, query, key, value, score_mod, block_mask, scale, score_buffers, mask_buffers)
    dq, dk, dv, _ = _outputs_like_fake(torch, fake, query, key, value, None, None, None, None, None, None, (),
                                       scale, {}, (), mask_buffers)
    differentiable = [i for i, b in enumerate(score_buffers)
                      if buffer_grads[i] and isinstance(b, torch.Tensor) and b.is_floating_point()]
    buffers = [b.detach().requires_grad_() if i in differentiable else b for i, b in enumerate(score_buffers)]
    buffer_sums = {i: torch.zeros_like(score_buffers[i], dtype=call.work) for i in differentiable}
    with _plain_dispatch(torch), torch.enable_grad(), _one_kernel(
            torch, _BACKWARD_KERNEL, call, lambda: (query, key, value, out, logsumexp, grad_out, dq, dk, dv)):
        dk_sum = torch.zeros(dk.shape, dtype=call.work, device=key.device)  # the kernel's own accumulators
        dv_sum = torch.zeros(dv.shape, dtype=call.work, device=value.device)
        for block in _blocks(torch, call):
            rows = block.span
            if block.tokens is None or grad_out is None and grad_logsumexp is None:
                dq[:, :, rows] = 0
                continue
            q = query[:, :, rows].detach().to(call.work).requires_grad_()
            k = _gather(torch, call, key.detach(), block.tokens).to(call.work).requires_grad_()
            v = _gather(torch, call, value.detach(), block.tokens).to(call.work)
            scores = _scores(torch, call, block, q, k, buffers)
            row_lse = logsumexp[:, :, rows].detach().to(call.work)[..., None] * _LN2
            empty = torch.isinf(row_lse)  # a row with no key: no weights, no gradient
            weights = torch.where(empty, 0, torch.exp(scores.detach() - torch.where(empty, 0, row_lse)))
            grad_scores = torch.zeros_like(weights)
            if grad_out is not None:
                d_out = grad_out[:, :, rows].to(call.work)
                delta = (d_out * out[:, :, rows].detach().to(call.work)).sum(-1, keepdim=True)
                grad_scores = weights * (d_out @ v.transpose(-2, -1) - delta)
                _scatter_add(torch, call, dv_sum, block.tokens, weights.transpose(-2, -1) @ d_out)
            if grad_logsumexp is not None:
                grad_scores = grad_scores + weights * (grad_logsumexp[:, :, rows].to(call.work)[..., None] / _LN2)
            inputs = [q, k, *(buffers[i] for i in differentiable)]
            got = [torch.zeros_like(x) if g is None else g  # a score_mod that ignores the score: no gradient
                   for x, g in zip(inputs, torch.autograd.grad(scores, inputs, grad_scores, allow_unused=True))]
            dq[:, :, rows] = got[0].to(dq.dtype)
            _scatter_add(torch, call, dk_sum, block.tokens, got[1])
            for i, g in zip(differentiable, got[2:]):
                buffer_sums[i] += g
        dk.copy_(dk_sum)
        dv.copy_(dv_sum)
    grads = tuple(buffer_sums[i].to(score_buffers[i].dtype).contiguous() if i in buffer_sums
                  else (torch.zeros_like(b, memory_format=torch.contiguous_format) if buffer_grads[i] else None)
                  for i, b in enumerate(score_buffers))
    return dq, dk, dv, grads


class HostOps:
    """The host operators a compiled graph's flex nodes become (see the module's docstring)."""

    def __init__(self, torch: ModuleType):
        self.torch = torch
        self.mods: list[tuple[Callable, Callable]] = []  # (score_mod, mask_mod) by handle
        self.library = torch.library.Library("mirage_host", "FRAGMENT")
        self.library.define("flex_attention(Tensor query, Tensor key, Tensor value, Tensor?[] block_mask, "
                            "SymInt[] sizes, Tensor[] score_buffers, Tensor[] mask_buffers, float scale, int handle, "
                            "int device) -> (Tensor, Tensor, Tensor)")
        self.library.define("flex_attention_backward(Tensor query, Tensor key, Tensor value, Tensor out, "
                            "Tensor logsumexp, Tensor? grad_out, "
                            "Tensor? grad_logsumexp, Tensor?[] block_mask, SymInt[] sizes, Tensor[] score_buffers, "
                            "Tensor[] mask_buffers, float scale, int handle, int device) -> (Tensor, Tensor, Tensor, "
                            "Tensor[])")
        self.library.impl("flex_attention", self._forward, "CPU")
        self.library.impl("flex_attention_backward", self._backward, "CPU")
        torch.library.register_fake("mirage_host::flex_attention", self._fake_forward, lib=self.library)
        torch.library.register_fake("mirage_host::flex_attention_backward", self._fake_backward, lib=self.library)
        self.forward_op = torch.ops.mirage_host.flex_attention.default
        self.backward_op = torch.ops.mirage_host.flex_attention_backward.default

    def _on_device(self, values: Sequence[Any], device: int) -> list[Any]:
        present = [i for i, v in enumerate(values) if v is not None]
        moved = self.torch.ops.mirage.device_views([values[i] for i in present], [device] * len(present))
        result = list(values)
        for i, view in zip(present, moved):
            result[i] = view
        return result

    def _block_mask(self, handle: int, tensors: Sequence[Any], sizes: Sequence[int]) -> tuple:
        return (sizes[0], sizes[1], *tensors, sizes[2], sizes[3], self.mods[handle][1])

    def _forward(self, query: Any, key: Any, value: Any, block_mask: list, sizes: list, score_buffers: list,
                 mask_buffers: list, scale: float, handle: int, device: int) -> tuple:
        q, k, v, *rest = self._on_device([query, key, value, *block_mask, *score_buffers, *mask_buffers], device)
        masks, rest = rest[:len(block_mask)], rest[len(block_mask):]
        with _plain_dispatch(self.torch):
            results = forward(self.torch, q, k, v, self.mods[handle][0], self._block_mask(handle, masks, sizes), scale,
                              tuple(rest[:len(score_buffers)]), tuple(rest[len(score_buffers):]))
        return tuple(self.torch.ops.mirage.host_view(r) for r in results)

    def _backward(self, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, grad_out: Any,
                  grad_logsumexp: Any, block_mask: list, sizes: list, score_buffers: list, mask_buffers: list,
                  scale: float, handle: int, device: int) -> tuple:
        q, k, v, o, lse, g_out, g_lse, *rest = self._on_device(
            [query, key, value, out, logsumexp, grad_out, grad_logsumexp, *block_mask, *score_buffers,
             *mask_buffers], device)
        masks, rest = rest[:len(block_mask)], rest[len(block_mask):]
        # every buffer gets a gradient, as the op's fake implementation (the graph's plan) gives one
        dq, dk, dv, grads = backward(self.torch, q, k, v, o, lse, g_out, g_lse, self.mods[handle][0],
                                     self._block_mask(handle, masks, sizes), scale, tuple(rest[:len(score_buffers)]),
                                     tuple(rest[len(score_buffers):]), [True] * len(score_buffers))
        host_view = self.torch.ops.mirage.host_view
        return host_view(dq), host_view(dk), host_view(dv), [host_view(g) for g in grads]

    def _fake_forward(self, query: Any, key: Any, value: Any, block_mask: list, sizes: list, score_buffers: list,
                      mask_buffers: list, scale: float, handle: int, device: int) -> tuple:
        from torch._higher_order_ops.flex_attention import flex_attention_fake_impl

        return flex_attention_fake_impl(query, key, value, None, (), scale, {}, tuple(score_buffers),
                                        tuple(mask_buffers))

    def _fake_backward(self, query: Any, key: Any, value: Any, out: Any, logsumexp: Any, grad_out: Any,
                       grad_logsumexp: Any, block_mask: list, sizes: list, score_buffers: list, mask_buffers: list,
                       scale: float, handle: int, device: int) -> tuple:
        from torch._higher_order_ops.flex_attention import flex_attention_backward_fake_tensor_mode as fake

        dq, dk, dv, grads = fake(query, key, value, None, None, grad_out, grad_logsumexp, None, None, (), scale, {},
                                 tuple(score_buffers), tuple(mask_buffers))
        return dq, dk, dv, list(grads)

    def rewrite(self, gm: Any, node: Any, device: int) -> None:
        """Turns a flex_attention(_backward) node of a host graph into a call of the host operator."""
        torch = self.torch
        hop = torch.ops.higher_order
        if node.target is hop.flex_attention:
            query, key, value, score_mod, block_mask, scale, _options, *buffers = node.args
        else:
            query, key, value, out, lse, grad_out, grad_lse, score_mod, joint, block_mask, scale, _options, \
                *buffers = node.args
            _reject_as_on_cuda(_submodule(gm, joint))
        head_dims = (query.meta["val"].size(-1), value.meta["val"].size(-1))
        if min(head_dims) < 16:  # Triton's tl.dot: inductor's CUDA lowering of both ops refuses it
            raise NotImplementedError(f"NYI: embedding dimension of the query, key, and value must be at least 16 "
                                      f"but got E={head_dims[0]} and Ev={head_dims[1]}")
        score_buffers, mask_buffers = (list(buffers[0]) if buffers else []), (list(buffers[1]) if len(buffers) > 1 else [])
        for buffer in score_buffers + mask_buffers:
            if not isinstance(buffer.meta.get("val"), torch.Tensor):
                raise NotImplementedError(f"mirage: a flex_attention score_mod or mask_mod capturing a non-tensor "
                                          f"value ({buffer}) is not emulated in a compiled graph; capture a tensor")
        handle = len(self.mods)
        self.mods.append((_submodule(gm, score_mod), _submodule(gm, block_mask[-1])))

        masks, sizes = list(block_mask[_MASK_TENSORS]), [block_mask[0], block_mask[1], block_mask[-3], block_mask[-2]]
        common = (masks, sizes, score_buffers, mask_buffers, float(scale), handle, device)
        if node.target is hop.flex_attention:
            node.target, node.args = self.forward_op, (query, key, value, *common)
        else:
            node.target, node.args = self.backward_op, (query, key, value, out, lse, grad_out, grad_lse, *common)
        node.kwargs = {}


def _reject_as_on_cuda(joint: Any) -> None:
    """The checks inductor's CUDA lowering of flex_attention_backward makes of score_mod's joint
    graph, with its errors: a buffer that wants a gradient indexed twice (torch's own check), and
    a score_mod whose result does not depend on the score (no gradient for it: the lowering's
    assertion, which an H200 with torch 2.11 raised for `score > 0`)."""
    from torch._inductor.kernel.flex.flex_attention import validate_joint_graph

    joint.graph.eliminate_dead_code()
    validate_joint_graph(joint.graph)
    if _no_score_gradient(joint):
        raise AssertionError("joint_subgraph_buffer is None - this is a bug!")


def _no_score_gradient(joint: Any) -> bool:
    """Whether score_mod's joint graph gives no gradient for the score (its first output)."""
    output = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    return output.args[0][0] is None


def _raise_as_torchs_reference(torch: ModuleType, joint: Any, query: Any, buffers: tuple) -> None:
    """A score_mod that gives the score no gradient fails in torch's eager backward (on CUDA too)
    where it vmaps the joint graph: that vmap, on one element, raises torch's error."""
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    rest = (None,) * len(buffers)
    vmapped = _vmap_for_bhqkv(joint, prefix=(0,), suffix=(0,) + rest, out_dims=[0, None, None, None, None, *rest])
    one, index = query.new_zeros(1, 1, 1, 1, dtype=torch.float32), torch.zeros(1, dtype=torch.int, device=query.device)
    vmapped(one, index, index, index, index, one, *buffers)


def _submodule(gm: Any, node: Any) -> Any:
    """The subgraph a get_attr node of gm names (score_mod, mask_mod)."""
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part)
    return value


def install(torch: ModuleType) -> None:
    """Eager calls on an emulated device: the ops' implementation for the CUDA dispatch key."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.flex_attention import flex_attention as forward_op
    from torch._higher_order_ops.flex_attention import flex_attention_backward as backward_op

    def eager_forward(query: Any, key: Any, value: Any, score_mod: Callable, block_mask: tuple, scale: float,
                      kernel_options: dict, score_mod_other_buffers: tuple = (),
                      mask_mod_other_buffers: tuple = ()) -> tuple:
        return forward(torch, query, key, value, score_mod, block_mask, scale, score_mod_other_buffers,
                       mask_mod_other_buffers)

    def eager_backward(query: Any, key: Any, value: Any, out: Any, logsumexp: Any, grad_out: Any, grad_logsumexp: Any,
                       fw_graph: Callable, joint_graph: Callable, block_mask: tuple, scale: float, kernel_options: dict,
                       score_mod_other_buffers: tuple = (), mask_mod_other_buffers: tuple = ()) -> tuple:
        if isinstance(joint_graph, torch.fx.GraphModule) and _no_score_gradient(joint_graph):
            _raise_as_torchs_reference(torch, joint_graph, query, score_mod_other_buffers)
        wanted = [isinstance(b, torch.Tensor) and b.requires_grad for b in score_mod_other_buffers]
        return backward(torch, query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, block_mask, scale,
                        score_mod_other_buffers, mask_mod_other_buffers, wanted)

    forward_op.py_impl(DispatchKey.CUDA)(eager_forward)
    backward_op.py_impl(DispatchKey.CUDA)(eager_backward)
