"""A test harness's pattern: it starts two ranks, one of them blocks in an all_reduce the other
never joins, the harness kills both (its own timeout) and carries on. The session must not
report the killed rank as hung. Arguments: seconds rank 0 waits in its all_reduce before the kill,
then seconds the harness goes on (past the session's --hang-timeout, so a wrong report would come)."""

import os
import sys
import threading
import time

import torch
import torch.multiprocessing as mp


def _tell_when_in_all_reduce(main: int, waiting) -> None:
    """Sets `waiting` once the main thread is inside torch.distributed's all_reduce (where it waits
    for rank 1), seen in its stack, rather than a fixed time after it was about to call it."""
    while True:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "all_reduce" and frame.f_code.co_filename.endswith("distributed_c10d.py"):
                waiting.set()
                return
            frame = frame.f_back
        time.sleep(0.01)


def rank_main(rank: int, rendezvous: str, waiting) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4, device="cuda"))  # both: the communicator is up
    if rank == 0:
        threading.Thread(target=_tell_when_in_all_reduce, args=(threading.get_ident(), waiting), daemon=True).start()
        dist.all_reduce(torch.ones(4, device="cuda"))  # rank 1 never comes
    time.sleep(600)


if __name__ == "__main__":
    import tempfile

    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")  # a file: no port to find free
    context = mp.get_context("spawn")
    waiting = context.Event()
    ranks = [context.Process(target=rank_main, args=(r, rendezvous, waiting)) for r in range(2)]
    for p in ranks:
        p.start()
    assert waiting.wait(120), "rank 0 never reached its all_reduce"
    time.sleep(float(sys.argv[1]))  # how long rank 0 waits before the kill (past --hang-timeout: a hang)
    for p in ranks:
        p.kill()
        p.join()
    time.sleep(float(sys.argv[2]))  # past the session's hang timeout
    print("harness carried on", flush=True)
