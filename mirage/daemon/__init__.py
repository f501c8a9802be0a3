"""The session daemon: the emulated cluster's shared state, served by the `mirage run` process.

shared_table.py (device memory, in a memfd, updated by the shim without round trips),
service.py (the Unix socket: registration, smi/ps/exec requests), flight_recorder.py
(collective sequences: desync and hang diagnosis). The runtime talks to it only through the
socket and the shared table; it is never imported by the workload's own code paths.
"""
