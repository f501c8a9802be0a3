"""torch.compile on the emulated GPUs: inductor compiles each device graph as a host graph.

For a CUDA device inductor generates Triton, and a CPU build of torch has no Triton; its GPU
paths also assume a real GPU in many places. So every graph inductor is handed (after
AOTAutograd: a forward, a backward, or an inference graph) that touches an emulated device is
moved to the host before inductor lowers it: device arguments in the graph become "cpu", the
example inputs become host fake tensors of the same geometry, and inductor's C++/OpenMP backend
compiles it as it compiles any CPU graph (its FX graph cache included). What it returns runs on
device memory in place:

- inputs are host views of the device tensors (the same bytes, no copy);
- the buffers the generated code allocates are device memory seen through host views, so
  memory_allocated, OOM and `mirage smi` count them;
- outputs become device tensors again, on the memory they were computed in (a buffer of
  the generated code, or an extern kernel's fresh result, adopted as device memory);
- operators with no host kernel (the CUDA-only ones, e.g. the fused attention kernels SDPA
  chooses on a GPU) and collectives (functional collectives in the graph go through the group's
  emulated NCCL backend) are called on the device from inside the host code.

A call during a CUDA graph capture joins the capture (the host kernels do not pass the shim's op
path, which a capture records), and mode="reduce-overhead" hands each compiled graph to inductor's
cudagraphify as on a GPU: cudagraph trees by default (warm-up, recording into the tree's shared
private pool, replays, checkpoints of the pool's allocator state), or one CUDA graph per compiled
graph with `triton.cudagraph_trees=False`. AOTAutograd's cache stores compiled graphs
without this wrapping, so it is turned off in a mirage process; inductor's FX graph cache (in the
usual cache directory) stays on.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import threading
from types import ModuleType
from typing import Any, Callable, Sequence

from mirage.runtime import flex_attention, import_hooks, timing

_COMPILE_FX = "torch._inductor.compile_fx"
# collectives run on the device: the group's backend for the device is the emulated NCCL
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d"}


def _is_device(value: Any, torch: ModuleType) -> bool:
    return isinstance(value, torch.device) and value.type == "cuda"


def _has_host_kernel(op: Any, torch: ModuleType) -> bool:
    name = op.name()
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
               for key in ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd",
                           "CompositeExplicitAutogradNonFunctional"))


class _DeviceOps:
    """Host-callable twins of operators that only have a device kernel: a custom operator with
    the original's schema whose host kernel moves its tensors to the device (views, no copies),
    calls the original there and hands host views of the results back."""

    def __init__(self, torch: ModuleType):
        self.torch = torch
        self.library = torch.library.Library("mirage_host", "FRAGMENT")
        self.twins: dict[tuple[str, int], Any] = {}

    def twin(self, op: Any, device: int) -> Any:
        key = (str(op), device)
        if key not in self.twins:
            self.twins[key] = self._define(op, device)
        return self.twins[key]

    def _define(self, op: Any, device: int) -> Any:
        torch = self.torch
        name = f"{op.name().replace('::', '_')}_{op._overloadname}_{device}".replace(".", "_")
        schema = str(op._schema)
        self.library.define(name + schema[schema.index("("):])
        host_view, device_views = torch.ops.mirage.host_view, torch.ops.mirage.device_views

        def to_device(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return device_views([value], [device])[0]
            if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                return type(value)(to_device(v) for v in value)
            return value

        def to_host(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return host_view(value)
            if isinstance(value, (list, tuple)):
                return type(value)(to_host(v) for v in value)
            return value

        def on_device(*args: Any, **kwargs: Any) -> Any:
            args = tuple(to_device(a) for a in args)
            kwargs = {k: to_device(v) for k, v in kwargs.items()}
            return to_host(op(*args, **kwargs))

        def fake(*args: Any, **kwargs: Any) -> Any:  # the original's meta kernel, on host fakes
            return op(*args, **kwargs)

        self.library.impl(name, on_device, "CPU")
        torch.library.register_fake(f"mirage_host::{name}", fake, lib=self.library)
        return getattr(torch.ops.mirage_host, name).default


def _host_fake(value: Any, torch: ModuleType, fake_mode: Any) -> Any:
    """A host fake tensor with `value`'s geometry (sizes, strides, offset, dtype)."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cuda":
        return value
    with fake_mode:
        base = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="cpu")
        if value.storage_offset() == 0:
            return base
        storage = torch.empty(value.untyped_storage().nbytes() // value.element_size(), dtype=value.dtype,
                              device="cpu")
        return storage.as_strided(value.size(), value.stride(), value.storage_offset())


def _output_devices(gm: Any, torch: ModuleType) -> list[int]:
    """The device index of each graph output (-1: not on an emulated device)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    devices = []
    for node in output.args[0]:
        value = node.meta.get("val") if hasattr(node, "meta") else None
        devices.append(value.device.index if isinstance(value, torch.Tensor) and value.device.type == "cuda" else -1)
    return devices


def _move_graph_to_host(gm: Any, device_ops: _DeviceOps, flex_ops: flex_attention.HostOps,
                        torch: ModuleType) -> None:
    """Rewrites device arguments to "cpu", device-only operators and collectives to their
    host-callable twins, and FlexAttention's ops to mirage's block-sparse host operators (inductor's
    CPU template for them is forward-only: flex_attention.py)."""
    from torch.utils._pytree import tree_map

    def to_host(value: Any) -> Any:
        return torch.device("cpu") if _is_device(value, torch) else value

    graphsafe_rng = torch._prims.rng_prims.graphsafe_run_with_rng_state
    flex_hops = (torch.ops.higher_order.flex_attention, torch.ops.higher_order.flex_attention_backward)
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        node.args = tree_map(to_host, node.args)
        node.kwargs = tree_map(to_host, node.kwargs)
        target = node.target
        if target in flex_hops:
            flex_ops.rewrite(gm, node, _node_device(node, torch))
            continue
        if target is graphsafe_rng and not _has_host_kernel(node.args[0], torch):
            # A random op whose recomputation (activation checkpointing) replays the device
            # generator's state: the op itself runs on host views, as a node of its own would.
            node.args = (device_ops.twin(node.args[0], _node_device(node, torch)), *node.args[1:])
            continue
        if isinstance(target, torch._ops.OpOverload) and (target.namespace in _COLLECTIVE_NAMESPACES
                                                          or not _has_host_kernel(target, torch)):
            node.target = device_ops.twin(target, _node_device(node, torch))
    for node in list(gm.graph.nodes):  # the subgraphs of rewritten flex nodes
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _node_device(node: Any, torch: ModuleType) -> int:
    """The emulated device a graph node's results are on (0 when none is)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    return next((v.device.index for v in values if isinstance(v, torch.Tensor) and v.device.type == "cuda"), 0)


def _first_device(example_inputs: Sequence[Any], torch: ModuleType) -> int | None:
    for value in example_inputs:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            return value.device.index
    return None


class _CapturedCalls:
    """Compiled graphs called while a CUDA graph is captured. Their host kernels do not pass the
    shim's op path, which is what a capture records, so each such call joins the capture as a
    call of `mirage_host::replay_compiled(handle)`, run again on every replay."""

    def __init__(self, torch: ModuleType):
        from mirage.runtime import cuda_graphs

        self.torch = torch
        self.calls: dict[int, Callable[[], None]] = {}
        self.by_graph: dict[int, list[int]] = {}
        self.handles = itertools.count(1)
        self.library = torch.library.Library("mirage_host", "FRAGMENT")
        self.library.define("replay_compiled(int handle) -> ()")
        self.library.impl("replay_compiled", lambda handle: self.calls[handle](), "CompositeExplicitAutograd")
        cuda_graphs.reset_listeners.append(self.forget)

    def record(self, replay: Callable[[], None]) -> None:
        handle = next(self.handles)
        self.calls[handle] = replay
        self.by_graph.setdefault(self.torch.ops.mirage.graph_capture_id(), []).append(handle)
        self.torch.ops.mirage.graph_record_call("mirage_host::replay_compiled", handle)

    def forget(self, graph: int) -> None:
        """A graph was reset: the calls recorded in it are never replayed again."""
        for handle in self.by_graph.pop(graph, ()):
            del self.calls[handle]


class _OutputGeometry:
    """Each graph output's sizes and strides (or value, for a non-tensor output) as expressions of
    the inputs' sizes. A capture does not run the graph, yet must allocate its outputs: with dynamic
    shapes their sizes are those this call's inputs give."""

    def __init__(self, gm: Any, example_inputs: Sequence[Any], torch: ModuleType):
        self.symbols: list[tuple[int, int | None, Any]] = []  # (input, dim or None for an int input, symbol)
        for index, value in enumerate(example_inputs):
            dims = enumerate(value.size()) if isinstance(value, torch.Tensor) else [(None, value)]
            for dim, size in dims:
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    self.symbols.append((index, dim, size.node.expr))
        self.torch = torch
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self.outputs = [self._describe(node.meta.get("val") if hasattr(node, "meta") else node)
                        for node in output.args[0]]

    def _describe(self, value: Any) -> Any:
        torch = self.torch

        def expression(d: Any) -> Any:
            return d.node.expr if isinstance(d, torch.SymInt) else d

        if isinstance(value, torch.Tensor):
            return ("tensor", [expression(d) for d in value.size()], [expression(d) for d in value.stride()],
                    value.dtype, value.device)
        if isinstance(value, torch.SymInt):
            return ("value", expression(value))
        return ("value", value) if isinstance(value, (int, float, bool, type(None))) else None

    def concrete(self, args: Sequence[Any]) -> list[Any] | None:
        """The outputs' (sizes, strides, dtype, device) or values for these inputs; None when one
        of them does not follow from the inputs' sizes (a data-dependent shape)."""
        import sympy

        bindings = {symbol: sympy.Integer(args[index] if dim is None else args[index].size(dim))
                    for index, dim, symbol in self.symbols}

        def evaluate(e: Any) -> Any:
            if isinstance(e, (int, float, bool, type(None))):
                return e
            value = e.xreplace(bindings)
            if not value.is_Integer:
                raise LookupError(e)
            return int(value)

        if any(d is None for d in self.outputs):
            return None
        try:
            return [("value", evaluate(d[1])) if d[0] == "value" else
                    ([evaluate(e) for e in d[1]], [evaluate(e) for e in d[2]], d[3], d[4]) for d in self.outputs]
        except LookupError:
            return None


def _gemm_shape(packet: Any, tensors: list, out: Any, torch: ModuleType) -> list[int]:
    """A matmul's [batch, rows, cols, K] as the cost model takes it (waves of output tiles, split-K,
    as the op path times the same GEMM run eagerly); [] where it is not one of the mm family or its
    shape is symbolic. addmm and baddbmm take the bias first."""
    first = {torch.ops.aten.mm: 0, torch.ops.aten.bmm: 0, torch.ops.aten.addmm: 1, torch.ops.aten.baddbmm: 1}.get(packet)
    if first is None or len(tensors) <= first or not isinstance(out, torch.Tensor) or out.dim() < 2:
        return []
    try:
        return [math.prod(int(d) for d in out.shape[:-2]), int(out.shape[-2]), int(out.shape[-1]),
                int(tensors[first].shape[-1])]
    except (TypeError, ValueError, RuntimeError):  # a symbolic size without a hint
        return []


@functools.cache
def _reduction_ops(torch: ModuleType) -> tuple[frozenset, dict]:
    """The operators that reduce their first argument, and those that reduce along a dim while
    keeping its shape (softmax and its backward: the dim argument's place)."""
    aten, prims = torch.ops.aten, torch.ops.prims
    reducing = frozenset({aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var, aten.var_mean,
                          aten.std, aten.prod, aten.any, aten.all, aten.argmax, aten.argmin, aten.logsumexp,
                          aten.linalg_vector_norm, aten.norm, prims.sum, prims.amax, prims.amin, prims.var,
                          prims.prod})
    along_dim = {aten._softmax: 1, aten._log_softmax: 1, aten._softmax_backward_data: 2,
                 aten._log_softmax_backward_data: 2}
    return reducing, along_dim


def _reduction_ranges(node: Any, torch: ModuleType) -> tuple[int, int] | None:
    """A reduction node's (outputs, elements reduced into each) as inductor schedules it, or None
    for a node that reduces nothing. Inductor fuses nodes into one kernel only over the same
    ranges (SIMDScheduling.can_fuse compares (numel, rnumel)), so two reductions of different
    ranges in one connected group are two kernels, each reading the group's inputs, unless its
    mix-order reduction takes them (_reduction_passes)."""
    reducing, along_dim = _reduction_ops(torch)
    packet = getattr(node.target, "overloadpacket", None)
    first = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(first, torch.Tensor):
        return None
    try:
        elements = int(first.numel())
        if packet in along_dim:
            dim = node.args[along_dim[packet]]
            size = int(first.shape[dim])
            return (elements // size, size) if size > 1 else None
        if packet in reducing:
            out = node.meta.get("val")
            out = out[0] if isinstance(out, (tuple, list)) else out
            outputs = int(out.numel()) if isinstance(out, torch.Tensor) else 1
            return (outputs, elements // max(outputs, 1)) if elements > outputs else None
    except (TypeError, ValueError, RuntimeError, IndexError):  # a symbolic size without a hint
        return None
    return None


def _reduction_passes(ranges: set, torch: ModuleType) -> int:
    """The kernels a fused group's reductions make: one per distinct range (_reduction_ranges),
    except that a reduction over the rows and one over the columns of the same input are one
    kernel where inductor's mix-order reduction takes them (config.triton.mix_order_reduction, on
    by default in torch 2.13; MixOrderReduction.can_fuse: at least 5 x 2^20 elements, at least
    twice as many rows as columns and 4096 rows, at most 16384 columns, the size checks skipped
    in its non-strict mode). A norm's backward over a training step's tokens is such a pair. Its
    other conditions (sibling sums over contiguous loads) are taken to hold."""
    config = torch._inductor.config
    mix_order, non_strict = config.triton.mix_order_reduction, config.triton.mix_order_reduction_non_strict_mode
    remaining, passes = set(ranges), 0
    while remaining:
        numel, rnumel = remaining.pop()
        passes += 1
        if mix_order and (rnumel, numel) in remaining:
            rows, columns = max(numel, rnumel), min(numel, rnumel)
            if columns <= 16384 and (non_strict or (rows * columns >= 5 * 2**20 and rows >= 2 * columns
                                                    and rows >= 4096)):
                remaining.discard((rnumel, numel))
    return max(passes, 1)


def _graph_kernels(gm: Any, torch: ModuleType) -> list[tuple[float, int, Any, list[int]]]:
    """Clocked mode's estimate of a compiled graph: the kernels inductor makes of it, which run one
    after another on the stream. Each matmul-family node (flop_counter's formulas) is a kernel of
    its own, reading its operands and writing its result. The pointwise and reduction nodes
    between them fuse: each connected group of them is one kernel, reading what flows into the
    group (a graph input, a matmul's result, a device operator's) and writing what leaves it (to a
    matmul, a device operator or the graph's output); what stays inside stays in registers, and
    views move nothing. Nodes on either side of a matmul cannot share a kernel: a node's stage is
    the count of matmuls and device operators on the longest path to it, and a group is of one
    stage. A group holding reductions over different ranges is that many kernels, each reading
    what flows into the group, unless inductor's mix-order reduction fuses a row and a column
    reduction (_reduction_passes). Device operators (mirage_host's twins: fused
    attention) and collectives are timed where they run. Returns each kernel's (FLOPs, bytes,
    dtype), in the graph's order."""
    import operator

    from torch.utils.flop_counter import flop_registry

    def size(value: Any) -> int:
        try:
            return int(value.numel()) * value.element_size() if isinstance(value, torch.Tensor) else 0
        except (TypeError, RuntimeError):  # a symbolic size without a hint
            return 0

    def val(node: Any) -> Any:
        return node.meta.get("val") if isinstance(node, torch.fx.Node) else node

    def tensor_args(node: Any) -> list[Any]:
        flat = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
        return [a for a in flat if isinstance(a, torch.fx.Node) and isinstance(val(a), torch.Tensor)]

    base: dict[Any, Any] = {}  # a node -> the node whose memory it is (a view's base)
    kind: dict[Any, str] = {}  # a base -> "input", "matmul", "outside" or "fused"
    group: dict[Any, Any] = {}  # a fused node -> its group's representative (union-find)
    stage: dict[Any, int] = {}  # a base -> matmuls and device operators on the longest path to it

    def find(node: Any) -> Any:
        while group[node] is not node:
            group[node] = group[group[node]]
            node = group[node]
        return node

    kernels: list[tuple[Any, list]] = []  # (matmul node, or a fused group's first node, [FLOPs, bytes, dtype])
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            base[node], kind[node], stage[node] = node, "input", 0
            continue
        if node.op != "call_function":
            continue
        target = node.target
        sources = [base[a] for a in tensor_args(node) if a in base]
        if isinstance(target, torch._ops.OpOverload) and sources and (
                target.is_view or target.overloadpacket is torch.ops.aten._unsafe_view):  # a view not marked one
            base[node] = sources[0]
            continue
        base[node] = node
        stage[node] = max((stage[s] + (kind[s] in ("matmul", "outside")) for s in sources), default=0)
        if target is operator.getitem:  # one result of a multi-result node: that node's kind
            parent = node.args[0]
            kind[node] = kind.get(base.get(parent), "outside")
            stage[node] = stage.get(base.get(parent), stage[node])
            if kind[node] == "fused":
                group[node] = find(base[parent])
            continue
        packet = getattr(target, "overloadpacket", None)
        if packet in flop_registry:
            kind[node] = "matmul"
            args, kwargs = torch.utils._pytree.tree_map(val, node.args), torch.utils._pytree.tree_map(val, node.kwargs)
            try:
                flops = float(flop_registry[packet](*args, **kwargs, out_val=val(node)))
            except Exception:  # noqa: BLE001 - a formula that cannot read symbolic shapes: no FLOPs counted
                flops = 0.0
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            cost = [flops, sum(size(t) for t in tensors) + size(val(node)), tensors[0].dtype if tensors else torch.float32,
                    _gemm_shape(packet, tensors, val(node), torch)]
            kernels.append((node, cost))
        elif isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims"):
            kind[node] = "fused"
            group[node] = node
            for source in sources:
                if kind.get(source) == "fused" and stage[source] == stage[node]:
                    group[find(source)] = find(node)
        else:
            kind[node] = "outside"

    reads: dict[Any, set] = {}  # a fused group -> the memory it reads from outside it
    writes: dict[Any, set] = {}  # a fused group -> its results that leave it
    for node in gm.graph.nodes:
        if node.op == "output":
            consumer = None
            sources = {base[a] for a in torch.utils._pytree.tree_leaves(node.args)
                       if isinstance(a, torch.fx.Node) and a in base}
        elif node.op == "call_function" and base.get(node) is node and node.target is not operator.getitem:
            consumer = find(node) if kind[node] == "fused" else None
            sources = {base[a] for a in tensor_args(node) if a in base}
        else:
            continue
        for source in sources:
            producer = find(source) if kind.get(source) == "fused" else None
            if consumer is not None and producer is not consumer:
                reads.setdefault(consumer, set()).add(source)
            if producer is not None and producer is not consumer:
                writes.setdefault(producer, set()).add(source)
    fused_costs: dict[Any, list] = {}
    ranges: dict[Any, set] = {}  # a fused group -> the distinct ranges of its reductions (_reduction_ranges)
    for node in gm.graph.nodes:
        if kind.get(node) == "fused" and base.get(node) is node:
            root = find(node)
            if root not in fused_costs:
                fused_costs[root] = [0.0, 0, val(node).dtype if isinstance(val(node), torch.Tensor) else torch.float32, []]
                kernels.append((node, fused_costs[root]))
            reduced = _reduction_ranges(node, torch)
            if reduced is not None:
                ranges.setdefault(root, set()).add(reduced)
    for root, cost in fused_costs.items():
        # A group whose reductions make n kernels (_reduction_passes) reads its inputs n times.
        passes = _reduction_passes(ranges.get(root, set()), torch)
        cost[1] = (passes * sum(size(val(t)) for t in reads.get(root, ()))
                   + sum(size(val(t)) for t in writes.get(root, ())))
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    kernels.sort(key=lambda k: order[k[0]])
    return [tuple(cost) for _, cost in kernels if cost[0] or cost[1]]


class HostCompiledGraph:
    """A graph inductor compiled for the host, called with and returning device tensors."""

    def __init__(self, compiled: Callable, device: int, output_devices: list[int], output_geometry: _OutputGeometry,
                 captured_calls: _CapturedCalls, torch: ModuleType):
        self._boxed_call = True  # an instance attribute: wrappers that copy __dict__ keep it
        self.compiled = compiled
        self.output_devices = output_devices
        self.output_geometry = output_geometry
        self.captured_calls = captured_calls
        self.torch = torch
        self.host_view = torch.ops.mirage.host_view
        self.device_views = torch.ops.mirage.device_views
        self.capturing = torch.ops.mirage.graph_capturing
        self.busy_enter, self.busy_exit = torch.ops.mirage.busy_region_enter, torch.ops.mirage.busy_region_exit
        self.clock_kernel = torch.ops.mirage.clock_compiled_graph
        self.device = device  # whose memory its buffers are, whose busy time its kernels are
        self.tensor_type = torch.Tensor
        self.kernels: list[tuple[float, int, Any, list[int]]] = []  # clocked mode: its kernels' (FLOPs, bytes, dtype, GEMM shape), see _graph_kernels

    def _capture(self, host_args: list) -> list:
        """Called during a CUDA graph capture: the outputs are allocated (their contents undefined
        until a replay, as CUDA's); each replay runs the compiled code and fills them."""
        torch = self.torch
        described = self.output_geometry.concrete(host_args)
        if described is None:
            torch.ops.mirage.graph_check_not_capturing()  # a data-dependent shape: CUDA's capture error
        outputs = [d[1] if d[0] == "value" else torch.empty_strided(d[0], d[1], dtype=d[2], device=d[3])
                   for d in described]

        # the graph refers to its pool's memory without owning it, as CUDA graphs do
        reference = torch.ops.mirage.graph_reference
        replay_args = [reference(a) if isinstance(a, self.tensor_type) else a for a in host_args]
        replay_outputs = [reference(o) if isinstance(o, self.tensor_type) else o for o in outputs]
        del host_args

        def replay() -> None:
            outer, _running.device = getattr(_running, "device", None), self.device
            try:
                results = self.compiled(list(replay_args))
            finally:
                _running.device = outer
            for output, result in zip(replay_outputs, results):
                if isinstance(output, self.tensor_type):
                    output.copy_(result)

        self.captured_calls.record(replay)
        return outputs

    def __call__(self, args: list) -> Any:
        host_args = [self.host_view(a) if isinstance(a, self.tensor_type) and a.is_cuda else a for a in args]
        args.clear()
        if self.capturing():
            return self._capture(host_args)
        self.busy_enter(self.device)  # the host kernels are the device's work (utilization)
        outer, _running.device = getattr(_running, "device", None), self.device
        try:
            outputs = list(self.compiled(host_args))
        finally:
            _running.device = outer
            self.busy_exit()
        for flops, nbytes, dtype, gemm in self.kernels:
            self.clock_kernel(self.device, flops, nbytes, dtype, gemm)
        moved = [i for i, o in enumerate(outputs) if isinstance(o, self.tensor_type) and self.output_devices[i] >= 0]
        views = self.device_views([outputs[i] for i in moved], [self.output_devices[i] for i in moved])
        for i, view in zip(moved, views):
            outputs[i] = view
        return outputs

    def __getattr__(self, name: str) -> Any:  # what AOTAutograd reads of inductor's OutputCode
        return getattr(self.compiled, name)


# The device whose compiled graph this thread is running, if any: a generated module may be shared
# (inductor's code cache) by a host graph compiled for "cpu" and one moved from a device.
_running = threading.local()


def _buffers_on_device(compiled: Any, torch: ModuleType) -> None:
    """Points the generated module's buffer allocation at device memory while a moved graph runs."""
    module_globals = getattr(getattr(compiled, "current_callable", None), "__globals__", None)
    if module_globals is None or "empty_strided_cpu" not in module_globals:
        return
    on_host = module_globals["empty_strided_cpu"]
    if getattr(on_host, "_mirage", False):
        return
    host_view = torch.ops.mirage.host_view

    def empty_strided(size: Sequence[int], stride: Sequence[int], dtype: Any) -> Any:
        device = getattr(_running, "device", None)
        if device is None:
            return on_host(size, stride, dtype)
        return host_view(torch.empty_strided(size, stride, dtype=dtype, device=torch.device("cuda", device)))

    empty_strided._mirage = True
    module_globals["empty_strided_cpu"] = empty_strided


class _ExternKernelsNotRun:
    """--predict-only: inductor's `extern_kernels` namespace as a moved graph's generated code sees
    it. While the graph runs for a device, a call that writes into an `out=` buffer (every matmul
    inductor emits: mm, addmm, bmm, baddbmm) returns that buffer unwritten; any other call, and
    every call of a host graph, is the real one."""

    def __init__(self, namespace: Any):
        self._namespace = namespace

    def __getattr__(self, name: str) -> Any:
        kernel = getattr(self._namespace, name)
        if not callable(kernel):
            return kernel

        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(_running, "device", None) is not None and "out" in kwargs:
                return kwargs["out"]
            return kernel(*args, **kwargs)

        return call


def _kernels_not_run_when_predicting(compiled: Any, torch: ModuleType) -> None:
    """--predict-only runs no kernel (the op path places it on the timeline instead); a moved
    graph's generated code would still run its fused C++ kernels and extern matmuls on the host,
    over every activation of the step (an 8B model's on eight ranks is far more than a host
    holds). Its wrapper still runs, so its buffers are allocated and freed in its own order (the
    peak memory is the graph's), but while it runs for a device its kernels do nothing, except
    one whose tensors all hold integers or bools in a small storage, which runs as the op path
    runs such a kernel; the graph's time is _graph_kernels' estimate either way."""
    module_globals = getattr(getattr(compiled, "current_callable", None), "__globals__", None)
    if module_globals is None or module_globals.get("_mirage_kernels_not_run"):
        return
    tensor_type = torch.Tensor
    # integer and bool data up to this size steers the program, so kernels over only such data run
    # (the op path's rule)
    steering_bytes = torch.ops.mirage.predict_only_steering_bytes()

    def steering(args: Sequence[Any]) -> bool:
        tensors = [a for a in args if isinstance(a, tensor_type)]
        return bool(tensors) and all(not (t.is_floating_point() or t.is_complex())
                                     and t.untyped_storage().nbytes() <= steering_bytes for t in tensors)

    def not_run(kernel: Callable) -> Callable:
        def call(*args: Any) -> None:
            if getattr(_running, "device", None) is None or steering(args):
                kernel(*args)

        return call

    for name, value in list(module_globals.items()):
        if name.startswith("cpp_") and callable(value):  # inductor's C++ kernels: cpp_<fused ops>_<n>
            module_globals[name] = not_run(value)
    if "extern_kernels" in module_globals:
        module_globals["extern_kernels"] = _ExternKernelsNotRun(module_globals["extern_kernels"])
    module_globals["_mirage_kernels_not_run"] = True


def _cudagraph_info(gm: Any) -> dict[str, Any]:
    """What inductor's cudagraphify reports errors with (the outputs' stack traces, the inputs'
    placeholders), read from the graph before inductor's passes rewrite it."""
    from torch._inductor.cudagraph_utils import get_placeholder_info

    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return {"stack_traces": [getattr(arg, "stack_trace", None) for arg in output.args[0]],
            "placeholders": get_placeholder_info(gm.graph)}


def _with_cuda_graphs(host_graph: HostCompiledGraph, info: dict[str, Any], compiled: Any,
                      kwargs: dict[str, Any]) -> Callable:
    """mode="reduce-overhead": inductor's own cudagraphify, as compile_fx applies it to a GPU graph."""
    from torch._inductor.compile_fx import cudagraphify

    run = cudagraphify(host_graph, static_input_idxs=tuple(kwargs.get("static_input_idxs", ())),
                       device_index=host_graph.device, is_backward=bool(kwargs.get("is_backward")),
                       is_inference=bool(kwargs.get("is_inference")),
                       mutated_input_idxs=tuple(getattr(compiled, "mutated_input_idxs", ())), **info)
    run._boxed_call = True
    return run


def _host_compile(inner_compile: Callable, device_ops: _DeviceOps, captured_calls: _CapturedCalls,
                  flex_ops: flex_attention.HostOps, torch: ModuleType) -> Callable:
    def compile_for_host(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        device = _first_device(example_inputs, torch)
        if device is None and not any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_cuda
                                      for n in gm.graph.nodes):
            return inner_compile(gm, example_inputs, **kwargs)  # nothing on an emulated device
        from torch._inductor.virtualized import V

        if V.aot_compilation:
            raise NotImplementedError(
                "mirage: AOTInductor (torch._inductor.aoti_compile_and_package, aot_compile) is not emulated: it "
                "builds a model library for the GPU, and mirage compiles device graphs as host graphs at run time. "
                "Fix: run the model with torch.compile on the emulated GPU, or export and package it on device='cpu'.")
        from torch._guards import detect_fake_mode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        output_devices = _output_devices(gm, torch)
        output_geometry = _OutputGeometry(gm, example_inputs, torch)
        cudagraph_info = _cudagraph_info(gm)
        # inductor would turn CUDA graphs off for a host graph, in the box the forward and backward
        # share, and count a skip a GPU does not have: it compiles with them off, mirage adds them
        cudagraphs = bool(kwargs.get("cudagraphs"))
        if "cudagraphs" in kwargs:
            from torch._inductor.utils import BoxedBool
            kwargs = {**kwargs, "cudagraphs": BoxedBool(False)}
        fake_mode = detect_fake_mode(example_inputs)
        host_inputs = [_host_fake(v, torch, fake_mode) for v in example_inputs]
        _move_graph_to_host(gm, device_ops, flex_ops, torch)
        FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*host_inputs)
        kernels = _graph_kernels(gm, torch) if timing.enabled() else []
        compiled = inner_compile(gm, host_inputs, **kwargs)
        _buffers_on_device(compiled, torch)
        if timing.predict_only():
            _kernels_not_run_when_predicting(compiled, torch)
        if device is None:  # no device inputs: the device of the first device output
            device = next((d for d in output_devices if d >= 0), 0)
        host_graph = HostCompiledGraph(compiled, device, output_devices, output_geometry, captured_calls, torch)
        host_graph.kernels = kernels
        if not cudagraphs:
            return host_graph
        return _with_cuda_graphs(host_graph, cudagraph_info, compiled, kwargs)

    return compile_for_host


def _graphsafe_rng_on_host_views(torch: ModuleType) -> None:
    """AOTAutograd replays a random op's generator state around its recomputation with
    graphsafe_run_with_rng_state, which checks the op's tensors are on a device with graph-safe
    generators. Inside a host graph they are host views of device tensors, whose generator
    (rng_state: a device generator) is CUDA's; CPU tensors elsewhere keep torch's answer."""
    import torch._functorch._aot_autograd.utils as aot_utils

    supported = aot_utils.supports_graphsafe_rng

    def supports_graphsafe_rng(device: Any) -> bool:
        return supported(device) or (device.type == "cpu" and getattr(_running, "device", None) is not None)

    aot_utils.supports_graphsafe_rng = supports_graphsafe_rng


def _patch(compile_fx_module: ModuleType, torch: ModuleType) -> None:
    original = compile_fx_module.compile_fx
    default_inner = compile_fx_module.compile_fx_inner
    # Their operator libraries are registered at the first compilation, not here: every process
    # of a fork server's session runs this (inductor is preloaded there), and registering them
    # writes to the dispatcher's tables, pages a forked child would copy.
    helpers: list[tuple[_DeviceOps, _CapturedCalls, flex_attention.HostOps]] = []
    _graphsafe_rng_on_host_views(torch)

    @functools.wraps(original)
    def compile_fx(model: Any, example_inputs: Any, inner_compile: Callable = default_inner, **kwargs: Any) -> Any:
        if not helpers:
            helpers.append((_DeviceOps(torch), _CapturedCalls(torch), flex_attention.HostOps(torch)))
        if not getattr(inner_compile, "_mirage_host", False):
            inner_compile = _host_compile(inner_compile, *helpers[0], torch)
            inner_compile._mirage_host = True
        return original(model, example_inputs, inner_compile=inner_compile, **kwargs)

    compile_fx_module.compile_fx = compile_fx
    torch._functorch.config.enable_autograd_cache = False


def _no_triton_warning(record: logging.LogRecord) -> bool:
    """A GPU build of torch installs Triton, so it never logs torch.utils.flop_counter's "triton not
    found" (which a CPU build reaches because the emulation sets torch.version.hip / .cuda)."""
    return "triton not found" not in record.getMessage()


def _cache_in_the_users_temp_dir() -> None:
    """Inductor keeps its compile cache (FX graphs, built kernels, the precompiled header) in
    <temp dir>/torchinductor_<user> unless TORCHINDUCTOR_CACHE_DIR says otherwise, and on a real
    box it is there for the next run. A mirage process's temp dir is its session's scratch, gone
    when the session ends, so every run compiled everything again (5-30 s for a small model): its
    cache goes where the user's temp dir (MIRAGE_USER_TMPDIR, from the launcher) puts it.
    cache_dir_utils and runtime_utils, which imports the function by name, may already be loaded
    (torch._dynamo loads both: the fork server preloads it); codecache, which resolves the
    precompiled header's directory when it is imported, is not yet."""
    user_temp_dir = os.environ.get("MIRAGE_USER_TMPDIR")
    if not user_temp_dir:
        return

    def patch(module: ModuleType) -> None:
        # runtime_utils may bind the already patched function: wrapping it again gives the same path
        in_scratch = module.default_cache_dir
        module.default_cache_dir = functools.wraps(in_scratch)(
            lambda: os.path.join(user_temp_dir, os.path.basename(in_scratch())))

    for name in ("torch._inductor.runtime.cache_dir_utils", "torch._inductor.runtime.runtime_utils"):
        import_hooks.after_import(name, patch)


def install(torch: ModuleType) -> None:
    """Arms the compile_fx patch (or applies it, if inductor is already loaded)."""
    logging.getLogger("torch.utils.flop_counter").addFilter(_no_triton_warning)
    _cache_in_the_users_temp_dir()
    import_hooks.after_import("torch._higher_order_ops.flex_attention", lambda module: flex_attention.install(torch))
    import_hooks.after_import(_COMPILE_FX, lambda module: _patch(module, torch))
