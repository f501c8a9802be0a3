"""Every collective on emulated-GPU tensors over init_process_group("nccl"), checked against
the same collective on CPU tensors (gloo) in the same job. Run with 4 ranks on 4 GPUs;
rank 0 prints `ok <name>` per collective and `collectives_ok` at the end.

For the `peer_memory_*` cases it also prints which path they took (peer_memory.py):
`peer_memory_kb <name> [kB, ...]`, per rank the kB of its peers' device memory it touched."""

import contextlib
import datetime
import glob
import os
import sys

import torch
import torch.distributed as dist

from peer_memory import PeerMemory

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dev = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl")
cpu_group = dist.new_group(backend="gloo")
checked = []
peer_memory = PeerMemory(dev)


def data(shape=(6,), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(1, 5, shape, generator=g).to(dtype)


def same(name, device_result, cpu_result):
    device_results = device_result if isinstance(device_result, list) else [device_result]
    cpu_results = cpu_result if isinstance(cpu_result, list) else [cpu_result]
    for d, c in zip(device_results, cpu_results):
        assert d.device == dev, f"{name}: result on {d.device}, not {dev}"
        torch.testing.assert_close(d.cpu(), c, msg=f"{name} differs from gloo on CPU")
    checked.append(name)


def both(name, fn):
    """Runs fn(make_tensor, group) on device tensors (nccl) and CPU tensors (gloo)."""
    with peer_memory.counting(name) if name.startswith("peer_memory") else contextlib.nullcontext():
        on_device = fn(lambda t: t.to(dev), None)
    same(name, on_device, fn(lambda t: t, cpu_group))


# all_reduce with every reduce op; AVG and PREMUL_SUM are checked against their definition.
for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
    def all_reduce(make, group, op=op):
        t = make(data())
        dist.all_reduce(t, op=op, group=group)
        return t
    both(f"all_reduce {op}", all_reduce)
t = data().to(dev)
dist.all_reduce(t, op=dist.ReduceOp.AVG)
s = data()
dist.all_reduce(s, group=cpu_group)
same("all_reduce AVG", t, s / world)
t = data().to(dev)
dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
same("all_reduce PREMUL_SUM", t, s * 0.5)
t = data(dtype=torch.int64).to(dev)
work = dist.all_reduce(t, async_op=True)
work.wait()
s = data(dtype=torch.int64)
dist.all_reduce(s, group=cpu_group)
same("all_reduce async int64", t, s)


# all_reduce over shared memory: several chunks, a length no rank count divides, every dtype
# family and reduce op; the results must be the very same bits on every rank. (bfloat16 data is
# and float16 data are whole numbers: their sums are then exact, whatever order gloo's ring adds in; otherwise both
# transports are equally far from the exact sum but not from each other.)
for dtype, ops in ((torch.float32, ("SUM", "PRODUCT", "MIN", "MAX")), (torch.bfloat16, ("SUM", "MAX")),
                   (torch.float64, ("SUM",)), (torch.int32, ("SUM", "MIN")), (torch.int64, ("MAX", "PRODUCT")),
                   (torch.uint8, ("SUM", "MIN")), (torch.int8, ("SUM",)), (torch.float16, ("SUM",))):
    for op_name in ops:
        def big_all_reduce(make, group, dtype=dtype, op=getattr(dist.ReduceOp, op_name)):
            values = data((100_003,), dtype=dtype, seed=7)
            t = make(values.round() if dtype in (torch.bfloat16, torch.float16) else values)
            dist.all_reduce(t, op=op, group=group)
            return t
        both(f"all_reduce {op_name} {dtype} x 100003", big_all_reduce)
# From 1 MiB every rank's tensor lies in shared device memory, and each rank reduces its part
# straight from every peer's tensor (shared-memory transport): both families of reductions, a
# length no rank count divides, AVG and PREMUL_SUM (which takes the staged path), and reduce,
# which must leave the other ranks' tensors as they were.
for dtype, op_name in ((torch.float32, "SUM"), (torch.float64, "MIN"), (torch.int32, "MAX"),
                       (torch.int64, "PRODUCT")):
    def peer_memory_all_reduce(make, group, dtype=dtype, op=getattr(dist.ReduceOp, op_name)):
        t = make(data((300_007,), dtype=dtype, seed=19))
        dist.all_reduce(t, op=op, group=group)
        return t
    both(f"peer_memory_all_reduce {op_name} {dtype}", peer_memory_all_reduce)
s = data((300_007,), seed=20)
dist.all_reduce(s, group=cpu_group)
for name, op, expected in (("AVG", dist.ReduceOp.AVG, s / world),
                           ("PREMUL_SUM", dist._make_nccl_premul_sum(0.5), s * 0.5)):
    t = data((300_007,), seed=20).to(dev)
    with peer_memory.counting(f"peer_memory_all_reduce {name}"):
        dist.all_reduce(t, op=op)
    same(f"peer_memory_all_reduce {name}", t, expected)
t = data((300_007,), seed=21).to(dev)
with peer_memory.counting("peer_memory_reduce"):
    dist.reduce(t, dst=2)
s = data((300_007,), seed=21)
dist.reduce(s, dst=2, group=cpu_group)
same("peer_memory_reduce", t, s if rank == 2 else data((300_007,), seed=21))
# NCCL has no bitwise reductions: ProcessGroupNCCL refuses them, and so does the emulation.
for op_name in ("BAND", "BOR", "BXOR"):
    try:
        dist.all_reduce(data(dtype=torch.int64).to(dev), op=getattr(dist.ReduceOp, op_name))
        raise AssertionError(f"{op_name} accepted")
    except ValueError as e:
        assert str(e) == f"Cannot use ReduceOp.{op_name} with NCCL", e
    checked.append(f"all_reduce {op_name} refused as by NCCL")
# bool: NCCL's uint8 with SUM as MAX (a logical or) and PRODUCT as MIN (a logical and).
flags = torch.tensor([rank == 0, False, True], device=dev)
dist.all_reduce(flags)
same("all_reduce bool SUM is OR", flags, torch.tensor([True, False, True]))
flags = torch.tensor([rank == 0, False, True], device=dev)
dist.all_reduce(flags, op=dist.ReduceOp.PRODUCT)
same("all_reduce bool PRODUCT is AND", flags, torch.tensor([world == 1, False, True]))
t = data((100_003,), seed=8).to(dev)
dist.all_reduce(t)
replicas = [torch.empty_like(t) for _ in range(world)]
dist.all_gather(replicas, t)
assert all(torch.equal(r, t) for r in replicas), "ranks disagree on the all_reduce result"
checked.append("all_reduce bitwise equal on every rank")
work = dist.all_reduce(t, async_op=True)
assert work.wait() and work.get_future().value()[0].device == dev
checked.append("all_reduce future holds the device tensor")



# The other collectives over shared memory, over several chunks and with uneven lengths.
def big_broadcast(make, group):
    t = make(data((100_003,), seed=9))
    dist.broadcast(t, src=3, group=group)
    return t


def big_all_gather_into_tensor(make, group):
    out = make(torch.zeros(world * 70_001))
    dist.all_gather_into_tensor(out, make(data((70_001,), seed=10)), group=group)
    return out


def all_gather_into_tensor_in_place(make, group):
    """FSDP's way: the input is this rank's part of the output."""
    out = make(torch.zeros(world * 70_001))
    mine = out[rank * 70_001:(rank + 1) * 70_001]
    mine.copy_(make(data((70_001,), seed=11)))
    dist.all_gather_into_tensor(out, mine, group=group)
    return out


def big_reduce_scatter_tensor(make, group):
    out = make(torch.zeros(50_001, dtype=torch.bfloat16))
    dist.reduce_scatter_tensor(out, make(data((world * 50_001,), seed=12).round().to(torch.bfloat16)), group=group)
    return out


def big_reduce_scatter_tensor_max(make, group):
    out = make(torch.zeros(50_001))
    dist.reduce_scatter_tensor(out, make(data((world * 50_001,), seed=13)), op=dist.ReduceOp.MAX, group=group)
    return out


for fn in (big_broadcast, big_all_gather_into_tensor, all_gather_into_tensor_in_place, big_reduce_scatter_tensor,
           big_reduce_scatter_tensor_max):
    both(fn.__name__, fn)


try:  # ProcessGroupNCCL's checkSingleTensor
    dist.all_reduce(data((40, 30)).to(dev).t())
    raise AssertionError("a non-contiguous tensor was accepted")
except ValueError as e:
    assert str(e) == "Tensors must be contiguous", e
checked.append("all_reduce transposed refused as by NCCL")


def broadcast(make, group):
    t = make(data())
    dist.broadcast(t, src=2, group=group)
    return t


def reduce(make, group):
    """Compared on the root only: gloo uses the other ranks' tensors as scratch space; NCCL,
    in place, leaves them as they were (checked below)."""
    t = make(data())
    dist.reduce(t, dst=1, group=group)
    return t if rank == 1 else make(torch.zeros(6))


t = data().to(dev)
dist.reduce(t, dst=1)
if rank != 1:
    same("reduce leaves the other ranks' tensors", t, data())


def all_gather(make, group):
    out = [make(torch.zeros(6)) for _ in range(world)]
    dist.all_gather(out, make(data()), group=group)
    return out


def all_gather_into_tensor(make, group):
    out = make(torch.zeros(6 * world))
    dist.all_gather_into_tensor(out, make(data()), group=group)
    return out


def reduce_scatter(make, group):
    out = make(torch.zeros(3))
    dist.reduce_scatter(out, [make(data((3,), seed=i)) for i in range(world)], group=group)
    return out


def reduce_scatter_tensor(make, group):
    out = make(torch.zeros(3))
    dist.reduce_scatter_tensor(out, make(data((3 * world,))), group=group)
    return out


def all_to_all(make, group):
    out = [make(torch.zeros(2)) for _ in range(world)]
    dist.all_to_all(out, [make(data((2,), seed=i)) for i in range(world)], group=group)
    return out


def all_to_all_single_uneven(make, group):
    # rank r sends (j + 1) elements to rank j, receives (r + 1) from everyone
    send = make(torch.arange(sum(j + 1 for j in range(world)), dtype=torch.float32) + 100 * rank)
    out = make(torch.zeros((rank + 1) * world))
    dist.all_to_all_single(out, send, output_split_sizes=[rank + 1] * world,
                           input_split_sizes=[j + 1 for j in range(world)], group=group)
    return out


def gather(make, group):
    out = [make(torch.zeros(6)) for _ in range(world)] if rank == 0 else None
    dist.gather(make(data()), out, dst=0, group=group)
    return out if rank == 0 else [make(torch.zeros(6))]


def scatter(make, group):
    out = make(torch.zeros(4))
    dist.scatter(out, [make(torch.full((4,), float(i))) for i in range(world)] if rank == 3 else None,
                 src=3, group=group)
    return out


def send_recv(make, group, shape=(6,)):
    """Even ranks send to the next odd one (large shapes: more than a shared-memory ring holds)."""
    t = make(data(shape, seed=14))
    if rank % 2 == 0:
        dist.send(t, dst=rank + 1, group=group)
    else:
        dist.recv(t, src=rank - 1, group=group)
    return t


def isend_irecv_batch(make, group):
    send, recv = make(data()), make(torch.zeros(6))
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world, group=group),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world, group=group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv


def big_send_recv(make, group):
    return send_recv(make, group, (300_007,))


def big_all_to_all_single(make, group):
    out = make(torch.zeros(world * 90_001))
    dist.all_to_all_single(out, make(data((world * 90_001,), seed=15)), group=group)
    return out


def big_isend_irecv_batch_with_self(make, group):
    """NCCL lets a batch send to its own rank (gloo, the reference, does not)."""
    send, recv, mine = make(data((200_003,), seed=16)), make(torch.zeros(200_003)), make(torch.zeros(200_003))
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world, group=group),
           dist.P2POp(dist.irecv, recv, (rank - 1) % world, group=group)]
    to_self = group is None
    if to_self:
        ops += [dist.P2POp(dist.isend, send, rank), dist.P2POp(dist.irecv, mine, rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert not to_self or torch.equal(mine, send)
    return recv


def peer_memory_broadcast(make, group, heap_rank=None):
    """1.6 MB: on the shared-memory transport every rank's tensor lies in its shared device
    memory and each copies straight from the root's (the root writing a share of each copy);
    `heap_rank`'s tensor is a kernel's result instead, which no peer can map."""
    t = make(data((400_009,), seed=17))
    if rank == heap_rank:
        t = t * 1
    dist.broadcast(t, src=1, group=group)
    return t


def peer_memory_broadcast_from_heap(make, group):
    """The root's tensor outside shared device memory: every rank takes the staged path."""
    return peer_memory_broadcast(make, group, heap_rank=1)


def peer_memory_broadcast_to_heap(make, group):
    """One destination outside shared device memory: the root writes no share of it."""
    return peer_memory_broadcast(make, group, heap_rank=2)


def peer_memory_isend_irecv_both_ways(make, group):
    """1.2 MB each way between pairs at once, each receiver copying from its sender's memory."""
    send, recv = make(data((300_007,), seed=18)), make(torch.zeros(300_007))
    ops = [dist.P2POp(dist.isend, send, rank ^ 1, group=group), dist.P2POp(dist.irecv, recv, rank ^ 1, group=group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv


for fn in (broadcast, reduce, all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor,
           all_to_all, all_to_all_single_uneven, gather, scatter, send_recv, isend_irecv_batch, big_send_recv,
           big_all_to_all_single, big_isend_irecv_batch_with_self, peer_memory_broadcast,
           peer_memory_broadcast_from_heap, peer_memory_broadcast_to_heap, peer_memory_isend_irecv_both_ways):
    both(fn.__name__, fn)

# Work objects of async operations, as ProcessGroupNCCL's.
t = torch.ones(8, device=dev)
work = dist.all_reduce(t, async_op=True)
assert work.wait(datetime.timedelta(seconds=30)) and work.is_completed() and work.is_success()
assert work.exception() is None and work.result()[0].data_ptr() == t.data_ptr()
assert work.get_future().wait()[0].device == dev and torch.equal(t, torch.full((8,), float(world), device=dev))
checked.append("async work: wait with timeout, is_completed, is_success, exception, result, future")

# Copies of float8 (NCCL moves them, does not reduce them) and complex tensors as real views.
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    t = torch.full((5,), float(rank + 1), device=dev).to(dtype)
    dist.broadcast(t, src=1)
    same(f"broadcast {dtype}", t.float(), torch.full((5,), 2.0))
    parts = [torch.empty(5, device=dev, dtype=dtype) for _ in range(world)]
    dist.all_gather(parts, t)
    same(f"all_gather {dtype}", [p.float() for p in parts], [torch.full((5,), 2.0)] * world)
z = torch.full((3,), complex(rank, 1), device=dev)
dist.all_reduce(z)
same("all_reduce complex", z, torch.full((3,), complex(sum(range(world)), world)))

# Subgroups: even ranks and odd ranks, each over nccl.
evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
mine = evens if rank % 2 == 0 else odds
t = torch.tensor([float(rank)], device=dev)
dist.all_reduce(t, group=mine)
same("new_group all_reduce", t, torch.tensor([float(rank % 2 * 2 + 2)]))
t = torch.full((70_001,), float(rank), device=dev)
dist.broadcast(t, src=2 + rank % 2, group=mine)  # a global rank: group rank 1 of evens / odds
same("new_group broadcast", t, torch.full((70_001,), float(2 + rank % 2)))
subgroup, _ = dist.new_subgroups(group_size=2)
t = torch.tensor([1.0], device=dev)
dist.all_reduce(t, group=subgroup)
same("new_subgroups all_reduce", t, torch.tensor([2.0]))

# Object collectives and barrier.
objects = [None] * world
dist.all_gather_object(objects, {"rank": rank})
assert objects == [{"rank": r} for r in range(world)]
checked.append("all_gather_object")
box = [{"hello": rank}] if rank == 0 else [None]
dist.broadcast_object_list(box, src=0)
assert box == [{"hello": 0}]
checked.append("broadcast_object_list")
dist.barrier()
checked.append("barrier")
assert dist.get_backend() == "nccl" and dist.is_nccl_available()
checked.append("get_backend == nccl")
assert dist.group.WORLD._get_backend(dev).options._timeout == datetime.timedelta(minutes=10)
checked.append("NCCL's default timeout")

# A rank's batch to itself (its ring has one side) is unlinked as well.
mine_out, mine_in = torch.full((3,), float(rank), device=dev), torch.empty(3, device=dev)
for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine_out, rank), dist.P2POp(dist.irecv, mine_in, rank)]):
    work.wait()
same("batch send to itself", mine_in, torch.full((3,), float(rank)))

# The shared-memory segments are unlinked as soon as every rank has mapped them.
segments = glob.glob(f"/dev/shm/mirage-{os.getuid()}-{os.environ['MIRAGE_SESSION']}.*")
assert not segments, segments
checked.append("no shared-memory segment left in /dev/shm")

if rank == 0:
    for name in checked:
        print(f"ok {name}")
peer_memory.report(cpu_group)
if rank == 0:
    print("collectives_ok")
dist.destroy_process_group()
sys.exit(0)
