"""NCCL's surface where library code meets it, on 2 ranks: prints `surface_ok` on rank 0."""
import json
import os
import pickle

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
options = dist.ProcessGroupNCCL.Options()
options.is_high_priority_stream = True
options.config.max_ctas = 16
dist.init_process_group("nccl", pg_options=options)
backend = dist.group.WORLD._get_backend(torch.device("cuda"))
assert isinstance(backend, dist.ProcessGroupNCCL) and backend.options.is_high_priority_stream
assert backend.options.config.max_ctas == 16
assert dist.get_backend() == "nccl" and dist.is_nccl_available()
version = torch.cuda.nccl.version()
assert len(version) == 3 and version[0] == 2, version

t = torch.arange(6, device="cuda", dtype=torch.float32)
dist.all_reduce(t)
dist.broadcast(t, 0)
trace = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
names = [e["profiling_name"] for e in trace["entries"]]
assert names[-2:] == ["nccl:all_reduce", "nccl:broadcast"], names
assert all(e["state"] == "completed" for e in trace["entries"]), trace["entries"]
assert trace["entries"][-1]["collective_seq_id"] == trace["entries"][-2]["collective_seq_id"] + 1
assert json.loads(torch._C._distributed_c10d._dump_nccl_trace_json())["entries"][-1]["profiling_name"] == "nccl:broadcast"

same = torch._C._distributed_c10d._hash_tensors([t])
hashes = [None, None]
dist.all_gather_object(hashes, same)
assert hashes[0] == hashes[1] and same != torch._C._distributed_c10d._hash_tensors([t + 1])

try:  # a pure-nccl group has no backend for CPU tensors, as on a real box
    dist.all_reduce(torch.ones(2))
    raise AssertionError("a CPU tensor was accepted")
except RuntimeError as e:
    assert "No backend type associated with device type cpu" in str(e), e

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    dist.all_reduce(t)
assert any(e.name == "nccl:all_reduce" for e in prof.events()), sorted({e.name for e in prof.events()})

if rank == 0:
    print("surface_ok")
dist.destroy_process_group()
