"""A test harness's pattern: it starts two ranks, one of them blocks in an all_reduce the other
never joins, the harness kills both (its own timeout) and carries on. The session must not
report the killed rank as hung."""

import os
import sys
import time

import torch
import torch.multiprocessing as mp


def rank_main(rank: int, port: int, waiting) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(4, device="cuda"))  # both: the communicator is up
    if rank == 0:
        waiting.set()
        dist.all_reduce(torch.ones(4, device="cuda"))  # rank 1 never comes
    time.sleep(600)


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    waiting = context.Event()
    ranks = [context.Process(target=rank_main, args=(r, port, waiting)) for r in range(2)]
    for p in ranks:
        p.start()
    waiting.wait(120)
    time.sleep(float(sys.argv[1]))  # rank 0 is in its all_reduce
    for p in ranks:
        p.kill()
        p.join()
    time.sleep(float(sys.argv[2]))  # past the session's hang timeout
    print("harness carried on", flush=True)
