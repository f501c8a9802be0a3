"""What a rank sees of its emulated node when nodes are isolated: prints one JSON line per rank
with its hostname, the address its hostname resolves to, MASTER_ADDR, what is in /dev/shm after
every rank wrote a file there, and the bytes its node's eth0 sent during an all_reduce over the
ranks of its own node and during one over a group that spans the nodes. Run with 2 nodes x 2 ranks.

    python isolated_nodes.py MiB
"""

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def eth0_sent() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
per_node = int(os.environ["LOCAL_WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
marker = Path(f"/dev/shm/isolated-nodes-test-rank{rank}")
marker.write_text("x")
dist.init_process_group("nccl")
cpu = dist.new_group(backend="gloo")  # gloo finds its address from the hostname
dist.barrier(group=cpu)
shm = sorted(p.name for p in Path("/dev/shm").glob("isolated-nodes-test-*"))
payload = torch.ones(int(sys.argv[1]) << 18, device="cuda")  # MiB of float32
same_node = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(world // per_node)]
across = dist.new_group([n * per_node for n in range(world // per_node)])  # local rank 0 of every node
mine = same_node[rank // per_node]
dist.all_reduce(torch.ones(1, device="cuda"), group=mine)  # connect first: count only the data
if rank % per_node == 0:
    dist.all_reduce(torch.ones(1, device="cuda"), group=across)
dist.barrier(group=cpu)
before = eth0_sent()
dist.all_reduce(payload, group=mine)
torch.cuda.synchronize()
dist.barrier(group=cpu)
within = eth0_sent() - before
dist.barrier(group=cpu)
before = eth0_sent()
if rank % per_node == 0:
    dist.all_reduce(payload, group=across)
    torch.cuda.synchronize()
dist.barrier(group=cpu)
crossing = eth0_sent() - before
marker.unlink()
print(json.dumps({"rank": rank, "hostname": socket.gethostname(), "resolves": socket.gethostbyname(socket.gethostname()),
                  "master": os.environ["MASTER_ADDR"], "shm": shm, "sent_within": within, "sent_across": crossing,
                  "sum": payload[0].item()}), flush=True)
dist.destroy_process_group()
