"""Emulated NCCL (RCCL on AMD profiles): the c10d backend every collective on an emulated GPU
passes through.

`process_group.h` declares ProcessGroupNCCL, a c10d `Backend` of its own, put where
torch.distributed builds ProcessGroupNCCL (see mirage/runtime/distributed.py); its files, one
concern each, are listed there. `transport.h`'s communicators (`shm_transport.cpp`,
`socket_transport.cpp`, `node_hierarchy.cpp`) move the bytes between the ranks. All are compiled
with the device shim (mirage/shim/build.py) into a Python extension module, `mirage_nccl`.
"""
