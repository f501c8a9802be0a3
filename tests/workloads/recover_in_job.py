"""In-job recovery after a rank dies, as TorchFT-style libraries do it, under `mirage run --fault`.

The parent starts WORLD ranks as its own processes (so no launcher stops the survivors when one
dies) and waits for all of them. Each rank all_reduces in a loop with
TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (errors reach the caller instead of taking the process down);
when a collective fails, the survivors leave the dead rank (DEAD, the fault's rank: finding it
is the recovery library's business, not this test's) behind by HOW and all_reduce again:

    shrink     dist.shrink_group([dead]) (ncclCommShrink), the new default group
    new-group  abort the old group (its ProcessGroupNCCL.abort()), then a new ProcessGroupNCCL
               over the survivors through a fresh prefix of the same store

Each survivor prints one JSON line: the error it saw and the sum after recovery.
"""

import json
import os
import sys

WORLD = 3


def _store(rank: int, published: str):
    """The job's TCPStore: rank 0 binds port 0 (the kernel picks a free one, no check-then-use race)
    and publishes the port in `published` (written whole, by rename); the others wait for it."""
    import time

    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, WORLD, True, wait_for_workers=False)
        with open(published + ".partial", "w") as out:
            out.write(str(store.port))
        os.rename(published + ".partial", published)
        return store
    while not os.path.exists(published):
        time.sleep(0.01)
    with open(published) as port:
        return dist.TCPStore("127.0.0.1", int(port.read()), WORLD, False, wait_for_workers=False)


def rank_main(rank: int, how: str, dead: int, published: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = _store(rank, published)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=WORLD, device_id=torch.device("cuda", rank))
    t = torch.ones(4, device="cuda")
    error = None
    try:
        for _ in range(10):
            dist.all_reduce(t)
            torch.cuda.synchronize()
    except dist.DistBackendError as err:
        error = str(err)
    if error is None:
        print(json.dumps({"rank": rank, "error": None}), flush=True)
        return
    survivors = [r for r in range(WORLD) if r != dead]
    if how == "shrink":
        group = dist.shrink_group([dead])
        new_rank, size = group.rank(), group.size()
        dist.all_reduce(t.fill_(1), group=group)
    else:
        dist.distributed_c10d._abort_process_group()
        new_rank, size = survivors.index(rank), len(survivors)
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("recovery/1", store), new_rank, size)
        pg.allreduce([t.fill_(1)]).wait()
    print(json.dumps({"rank": rank, "error": error[:400], "new_rank": new_rank, "size": size,
                      "sum": t[0].item()}), flush=True)


def main() -> None:
    import multiprocessing
    import tempfile

    how, dead = sys.argv[1], int(sys.argv[2])
    published = os.path.join(tempfile.mkdtemp(), "store-port")  # TMPDIR: the session's private folder
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    context = multiprocessing.get_context("spawn")
    ranks = []
    for rank in range(WORLD):
        os.environ["RANK"] = str(rank)  # what the shim reads for the rank's faults
        ranks.append(context.Process(target=rank_main, args=(rank, how, dead, published)))
        ranks[-1].start()
    for process in ranks:
        process.join()
    print(json.dumps({"exit_codes": [p.exitcode for p in ranks]}), flush=True)


if __name__ == "__main__":
    main()
