"""Emulated NCCL (RCCL on AMD profiles): the c10d backend every collective on an emulated GPU
passes through.

`backend.cpp` is a c10d `Backend` of its own, put where torch.distributed builds
ProcessGroupNCCL (see mirage/runtime/distributed.py); `shm_transport.cpp` moves the bytes
between the ranks through same-host shared memory. Both are compiled with the device shim
(mirage/shim/build.py) into a Python extension module, `mirage_nccl`.
"""
