"""A test harness's pattern: it starts two ranks, one of them blocks in an all_reduce the other
never joins, the harness kills both (its own timeout) and carries on. The session must not
report the killed rank as hung.

    python killed_ranks.py kill   kill the ranks once rank 0 waits in its all_reduce, then carry on
                                  until the session's hang watch has looked past the hang timeout
                                  counted from the kill (a wrong report would have come by then)
    python killed_ranks.py keep   the positive control: leave rank 0 waiting; the session's hang
                                  report ends the job

Both phases are read from the session's own flight recorder (its status, hang_watch): what each
rank waits in, and when the watch last looked and found no hang; no fixed time stands in for them.
"""

import os
import sys
import time

import torch
import torch.multiprocessing as mp

from mirage.daemon.protocol import SOCKET_NAME
from mirage.daemon.service import request


def rank_main(rank: int, rendezvous: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4, device="cuda"))  # both: the communicator is up
    if rank == 0:
        dist.all_reduce(torch.ones(4, device="cuda"))  # rank 1 never comes
    time.sleep(600)


def hang_watch_until(done, what: str) -> dict:
    """The session's hang watch (mirage smi --json's hang_watch), polled until `done(watch)`."""
    deadline = time.monotonic() + 120
    socket = os.path.join(os.environ["MIRAGE_RUNTIME"], SOCKET_NAME)
    while time.monotonic() < deadline:
        watch = request(socket, {"op": "status"}, timeout=10.0)["hang_watch"]
        if done(watch):
            return watch
        time.sleep(0.1)
    raise AssertionError(f"the session never saw {what}: {watch}")


if __name__ == "__main__":
    import tempfile

    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")  # a file: no port to find free
    context = mp.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(r, rendezvous)) for r in range(2)]
    for p in ranks:
        p.start()
    # rank 0 in its second all_reduce (sequence 2), as the session's flight recorder has it
    hang_watch_until(lambda watch: any(w["rank"] == 0 and w["seq"] == 2 for w in watch["waiting"]),
                     "rank 0 waiting in its second all_reduce")
    if sys.argv[1] == "keep":
        for p in ranks:
            p.join()  # until the session's hang report ends the job
    killed_at = time.time()
    for p in ranks:
        p.kill()
        p.join()
    hang_watch_until(lambda watch: watch["checked_at"] > killed_at + watch["timeout_s"],
                     "a hang check past the timeout after the kill")
    print("harness carried on", flush=True)
