"""Emulated NCCL across emulated GPUs and nodes: collectives, DDP, the demo commands."""

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, mirage

from mirage.launcher import nodes
from mirage.runtime.visible_devices import gpu_uuid

NCCL_ENV = ["--env", "NCCL_P2P_DISABLE=1", "--env", "NCCL_SHM_DISABLE=1", "--env", "NCCL_SOCKET_IFNAME=lo"]
# Isolated emulated nodes (asked for) reach each other on eth0, as a cluster's nodes on their NIC.
ISOLATED_NODES_NCCL_ENV = ["--isolate-nodes", "--env", "NCCL_P2P_DISABLE=1", "--env", "NCCL_SHM_DISABLE=1",
                           "--env", "NCCL_SOCKET_IFNAME=eth0"]
needs_isolation = pytest.mark.skipif(nodes.unavailable_reason() is not None, reason="cannot isolate nodes here")


ONE_NODE_OF_FOUR = ["--nproc-per-node", "4", "--gpus-per-node", "4"]
# Two isolated nodes of two: shared memory within each, the leaders' sockets between them, and
# the socket mesh (whose pairs connect at their first transfer) for point-to-point and all_to_all.
TWO_NODES_OF_TWO = ["--isolate-nodes", "--num-nodes", "2", "--nproc-per-node", "2", "--gpus-per-node", "2"]


# Collectives that never copy from a peer's memory, even where P2P is on: PREMUL_SUM is scaled
# in a staging copy, and a root whose tensor is heap memory cannot be read by its peers.
STAGED_ON_ONE_HOST = {"peer_memory_all_reduce PREMUL_SUM", "peer_memory_broadcast_from_heap"}


@pytest.mark.parametrize("transport, init, via, direct", [
    (ONE_NODE_OF_FOUR, "transport shared memory, P2P direct copies)", {"P2P/direct pointer"}, True),
    ([*ONE_NODE_OF_FOUR, "--env", "NCCL_P2P_DISABLE=1"], "transport shared memory)", {"SHM/direct/direct"}, False),
    ([*ONE_NODE_OF_FOUR, *NCCL_ENV], "transport sockets)", {"NET/Socket/0"}, False),
    pytest.param(TWO_NODES_OF_TWO, "transport shared memory within a node, sockets across nodes)",
                 {"P2P/direct pointer", "NET/Socket/0"}, None,
                 marks=needs_isolation),
], ids=["shared-memory", "shared-memory-without-p2p", "sockets", "two-isolated-nodes"])
def test_every_collective_on_device_tensors_equals_gloo_on_cpu(transport, init, via, direct):
    """Each variant is held to the transport it names: NCCL_DEBUG=INFO's init line of the world
    communicator on every rank and the transports of its channel lines, and, on one host, the
    peers' device memory each rank touched in the `peer_memory_*` cases (the workload's
    `peer_memory_kb` lines): some on every rank where P2P copies directly, none without P2P."""
    result = mirage("run", *transport, "--env", "NCCL_DEBUG=INFO", "--", "python", "tests/workloads/collectives.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[0] collectives_ok" in result.stdout
    for name in ("all_reduce AVG", "all_reduce PREMUL_SUM", "all_reduce PRODUCT torch.int64 x 100003",
                 "all_reduce BXOR refused as by NCCL", "all_reduce bool SUM is OR",
                 "all_reduce bitwise equal on every rank", "no shared-memory segment left in /dev/shm",
                 "all_reduce transposed refused as by NCCL", "NCCL's default timeout", "all_to_all_single_uneven",
                 "big_broadcast", "all_gather_into_tensor_in_place", "big_reduce_scatter_tensor_max",
                 "new_group broadcast",
                 "isend_irecv_batch", "new_subgroups all_reduce", "reduce_scatter_tensor", "barrier",
                 "big_send_recv", "big_all_to_all_single", "big_isend_irecv_batch_with_self",
                 "peer_memory_broadcast", "peer_memory_broadcast_from_heap", "peer_memory_broadcast_to_heap",
                 "peer_memory_isend_irecv_both_ways", "peer_memory_all_reduce PRODUCT torch.int64",
                 "peer_memory_all_reduce AVG", "peer_memory_all_reduce PREMUL_SUM", "peer_memory_reduce"):
        assert f"[0] ok {name}" in result.stdout
    lines = result.stderr.splitlines()
    world_inits = [line for line in lines if "nRanks 4" in line and "group 0 - Init COMPLETE" in line]
    assert len(world_inits) == 4 and all(line.endswith(init) for line in world_inits), world_inits
    assert {line.rsplit(" via ", 1)[1] for line in lines if "RCCL INFO Channel" in line} == via
    if direct is None:
        return  # across nodes, which pairs copy directly is the hierarchy's choice
    touched = {line.split(" ", 2)[2].rsplit(" [", 1)[0]: json.loads("[" + line.rsplit(" [", 1)[1])
               for line in result.stdout.splitlines() if line.startswith("[0] peer_memory_kb ")}
    assert len(touched) == 11, touched
    for name, kb in touched.items():
        assert (all(kb) if direct and name not in STAGED_ON_ONE_HOST else not any(kb)), (name, kb)


def test_ddp_across_two_emulated_nodes_without_torchrun():
    """README's two-node line as it is written: default transports, nodes sharing this host."""
    result = mirage("run", "--num-nodes", "2", "--gpus-per-node", "2", "--", "python3", "tests/fixtures/ml/ddp_mlp.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0] ddp_mlp_ok" in result.stdout
    assert "starting node 2/2" in result.stderr


def run_large_collectives_on_two_gpus(tmp_path, *options: str, prologue: str = "") -> subprocess.CompletedProcess:
    """Runs a 4 MB broadcast from rank 1, then an all_reduce, on 2 ranks with NCCL_DEBUG=INFO
    (`prologue` first, before torch is imported); each rank prints `values <min> <max>` (4.0 4.0
    when right) and rank 0 `peer_memory_kb <broadcast|all_reduce> [kB, kB]`: the peers' device
    memory each rank touched (tests/workloads/peer_memory.py)."""
    script = tmp_path / "large_collectives.py"
    script.write_text(
        prologue +
        "import os, sys, torch, torch.distributed as dist\n"
        "sys.path.insert(0, 'tests/workloads')\n"
        "from peer_memory import PeerMemory\n"
        "rank = int(os.environ['RANK']); torch.cuda.set_device(rank)\n"
        "dist.init_process_group('nccl')\n"
        "peer_memory = PeerMemory(torch.device('cuda', rank))\n"
        "t = torch.full((1 << 20,), float(rank + 1), device='cuda')\n"
        "with peer_memory.counting('broadcast'):\n    dist.broadcast(t, 1)\n"
        "with peer_memory.counting('all_reduce'):\n    dist.all_reduce(t)\n"
        "print('values', t.min().item(), t.max().item(), flush=True)\n"
        "peer_memory.report()\n"
        "dist.destroy_process_group()\n")
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--env", "NCCL_DEBUG=INFO", *options,
                    "--", "python", str(script), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0] values 4.0 4.0" in result.stdout and "[1] values 4.0 4.0" in result.stdout
    return result


@pytest.mark.parametrize("p2p", [True, False], ids=["p2p", "NCCL_P2P_DISABLE"])
def test_one_host_copies_between_gpus_memory_unless_p2p_is_disabled(tmp_path, p2p):
    """NCCL's P2P transport: on one host, large messages go straight from one GPU's memory to
    another's; NCCL_P2P_DISABLE=1 leaves the staging through shared memory (the SHM transport).
    Held to its log line (the demo under torchrun) and to what was copied: with P2P every rank
    touches its peer's device memory in a 4 MB broadcast and all_reduce, without it none does."""
    disable = [] if p2p else ["--env", "NCCL_P2P_DISABLE=1"]
    result = mirage("run", "--gpus-per-node", "2", "--env", "NCCL_DEBUG=INFO", *disable, "--", "torchrun",
                    "--standalone", "--nproc_per_node=2", "tests/fixtures/ml/dist_smoke.py")
    assert result.returncode == 0, result.stderr[-3000:]
    init_lines = [line for line in result.stderr.splitlines() if "Init COMPLETE" in line]
    assert len(init_lines) == 2
    assert all(("transport shared memory, P2P direct copies)" in line) == p2p for line in init_lines), init_lines
    copies = run_large_collectives_on_two_gpus(tmp_path, *disable).stdout
    for name in ("broadcast", "all_reduce"):
        touched = json.loads(copies.split(f"[0] peer_memory_kb {name} ", 1)[1].split("\n", 1)[0])
        assert len(touched) == 2 and (all(kb > 0 for kb in touched) if p2p else touched == [0, 0]), (name, touched)


def test_a_rank_without_an_arena_makes_its_communicator_stage_everything(tmp_path):
    """Rank 1 cannot reserve the address space of its shared device memory (ulimit -v): no rank
    may copy from or into it, so every rank of the communicator takes the staged path (none
    touches a peer's device memory), and the large collectives still give the right values."""
    result = run_large_collectives_on_two_gpus(tmp_path, prologue=(
        "import os, resource\n"
        "if os.environ['RANK'] == '1':\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))\n"))
    init_lines = [line for line in result.stderr.splitlines() if "Init COMPLETE" in line]
    assert len(init_lines) == 2 and all(line.endswith("transport shared memory)") for line in init_lines), init_lines
    assert "[0] peer_memory_kb broadcast [0, 0]" in result.stdout
    assert "[0] peer_memory_kb all_reduce [0, 0]" in result.stdout


@needs_isolation
def test_dist_smoke_on_two_isolated_nodes_crosses_eth0():
    """The tutorial's command on isolated nodes, with the interface a cluster's nodes reach each
    other on (its `lo` fails there: tests/test_nodes.py)."""
    result = mirage("run", "--profile", "mi350x", "--num-nodes", "2", "--gpus-per-node", "2", *ISOLATED_NODES_NCCL_ENV,
                    "--env", "NCCL_DEBUG=INFO", "--", "python3", "tests/fixtures/ml/dist_smoke.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[rank 1] current device = 1 (cuda:1)" in result.stdout
    assert "[rank 0] post all_reduce: tensor = 3.0" in result.stdout
    assert "[0] dist_smoke_ok" in result.stdout
    init_lines = [line for line in result.stderr.splitlines() if "RCCL INFO comm" in line]
    assert len(init_lines) == 2 and "nRanks 2" in init_lines[0] and "profile mi350x" in init_lines[0]
    assert any(line.startswith("[0] node0:") and line.endswith("RCCL INFO Channel 00/0 : 0[0] -> 1 via NET/Socket/0")
               for line in result.stderr.splitlines())
    assert "RCCL INFO NET/Socket : Using [0]eth0:10.89.0.2<0>" in result.stderr


def test_torchrun_across_emulated_nodes():
    script = ('torchrun --nnodes=$MIRAGE_NUM_NODES --node-rank=$MIRAGE_NODE_RANK --nproc-per-node=2 '
              '--rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT tests/fixtures/ml/dist_smoke.py')
    result = mirage("run", "--num-nodes", "2", "--gpus-per-node", "2", "--", "sh", "-c", script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all_reduce sum = 10 (expected 10) on 4 ranks" in result.stdout


def test_identity_variables_per_rank_and_node():
    script = ("import os; print(*(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MIRAGE_NODE_RANK', "
              "'NODE_RANK', 'GROUP_RANK', 'LOCAL_WORLD_SIZE', 'NCCL_HOSTID')))")
    result = mirage("run", "--num-nodes", "2", "--nproc-per-node", "2", "--gpus-per-node", "2",
                    "--env", "RANK=99", "--", "python", "-c", script)
    assert result.returncode == 0, result.stderr
    rows = sorted(line.split(" ", 1) for line in result.stdout.splitlines())
    assert [r[0] for r in rows] == ["[0]", "[1]", "[2]", "[3]"]
    fields = [r[1].split() for r in rows]
    assert [f[:7] for f in fields] == [["0", "0", "4", "0", "0", "0", "2"], ["1", "1", "4", "0", "0", "0", "2"],
                                       ["2", "0", "4", "1", "1", "1", "2"], ["3", "1", "4", "1", "1", "1", "2"]]
    assert fields[0][7] == fields[1][7] != fields[2][7]
    assert "--env RANK ignored" in result.stderr


def test_a_one_process_job_has_no_rank_variables_as_on_a_real_box():
    script = ("import os; print(*(os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', "
              "'GROUP_RANK', 'NODE_RANK')), bool(os.environ['MASTER_ADDR']), bool(os.environ['MASTER_PORT']), "
              "bool(os.environ['MIRAGE_SESSION']))")
    caller = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = mirage("run", "--gpus-per-node", "2", "--", "python", "-c", script, env=caller)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None"] * 6 + ["True"] * 3
    chosen = mirage("run", "--env", "WORLD_SIZE=2", "--env", "RANK=1", "--", "python", "-c", script, env=caller)
    assert chosen.stdout.split()[:3] == ["1", "None", "2"] and "ignored" not in chosen.stderr


def test_a_trainer_that_spawns_its_own_workers_trains_ddp_on_every_gpu():
    result = mirage("run", "--gpus-per-node", "2", "--", "python", "tests/workloads/self_spawning_ddp.py", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "worker 0: 2 ranks trained, identical replicas: True" in result.stdout
    assert "launcher: workers exited with [0, 0]" in result.stdout


def test_the_ddp_demo_script_runs_as_one_rank_without_a_launcher():
    result = mirage("run", "--gpus-per-node", "1", "--", "python", "tests/fixtures/ml/ddp_mlp.py", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ddp_mlp_ok" in result.stdout


def test_a_failing_rank_stops_the_job_with_its_exit_code():
    script = "import os, time\nif os.environ['RANK'] == '1': raise SystemExit(3)\ntime.sleep(600)"
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python", "-c", script, timeout=120)
    assert result.returncode == 3
    assert "[1] exited with code 3; stopping the other processes" in result.stderr


def test_run_ddp_mlp_script_with_four_ranks():
    venv = Path(sys.executable).parent.parent
    env = dict(os.environ, NPROC="4", STEPS="100", SKIP_INSTALL="1", VENV=str(venv))
    result = subprocess.run(["./tests/run_ddp_mlp_mi350.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "over 100 steps" in result.stdout
    assert result.stdout.rstrip().endswith("ddp_mlp_ok\n==> PASS: DDP MLP trained on 4 emulated mi350x GPUs via torchrun")


def test_fsdp2_tensor_parallel_dtensor_and_ddp_buckets_on_four_gpus():
    result = mirage("run", "--nproc-per-node", "4", "--gpus-per-node", "4", "--",
                    "python", "tests/workloads/parallelisms.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in ("fsdp2 losses equal single-device training",
                 "tensor parallel on a 2x2 mesh, gradients equal the unsharded module's",
                 "dtensor shard/replicate on a cuda mesh",
                 "ddp 24 params, bucket_cap_mb=1, no_sync, 50 steps, equal to one device on every rank's data"):
        assert f"[0] ok {name}" in result.stdout
    assert "[0] parallelisms_ok" in result.stdout


def test_compiled_ddp_fsdp2_and_a_collective_in_a_compiled_graph_on_two_gpus():
    result = mirage("run", "--gpus-per-node", "2", "--", "torchrun", "--standalone", "--nproc_per_node=2",
                    "tests/workloads/compiled_training.py", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in ("compiled ddp replicas identical", "compiled ddp equals eager ddp",
                 "ddp graph split at bucket boundaries", "fsdp2 + compile equals eager fsdp2",
                 "functional all_reduce in a compiled graph"):
        assert f"[0] ok {name}" in result.stdout and f"[1] ok {name}" in result.stdout
    assert "[1] compiled_training_ok" in result.stdout


def test_ddp_many_buckets_500_steps_on_two_nodes_of_four():
    """The stall the ISA-level emulator hits: DDP's repeated bucketed all-reduces."""
    result = mirage("run", "--num-nodes", "2", "--nproc-per-node", "4", "--gpus-per-node", "4",
                    "--env", "DDP_ONLY=1", "--env", "DDP_STEPS=500", "--",
                    "python", "tests/workloads/parallelisms.py", timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert ("[0] ok ddp 24 params, bucket_cap_mb=1, no_sync, 500 steps, equal to one device on every rank's data"
            in result.stdout)


def test_two_ranks_on_one_gpu_fail_with_rccls_duplicate_gpu_error(tmp_path):
    script = tmp_path / "dup.py"
    script.write_text("import torch, torch.distributed as dist\ndist.init_process_group('nccl')\n"
                      "t = torch.ones(2, device='cuda:0')\ndist.all_reduce(t)\nprint('unreachable')\n")
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python", str(script), timeout=120)
    assert result.returncode == 1
    assert "unreachable" not in result.stdout
    assert "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0" in result.stderr
    assert "ncclInvalidUsage" in result.stderr


def test_one_gpu_per_rank_through_cuda_visible_devices(tmp_path):
    """The launcher pattern `CUDA_VISIBLE_DEVICES=$LOCAL_RANK` + cuda:0: each rank sees one GPU,
    and it is the node's GPU $LOCAL_RANK (memory, identity for NCCL); the same GPU twice is
    still a duplicate."""
    script = tmp_path / "visible.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "assert torch.cuda.device_count() == 1, torch.cuda.device_count()\n"
        "uuid = torch.cuda.get_device_properties(0).uuid\n"
        "dist.init_process_group('nccl')\n"
        "t = torch.full((3 * 2**20,), float(dist.get_rank() + 1), device='cuda:0')\n"
        "dist.all_reduce(t)\n"
        "print('visible', os.environ['CUDA_VISIBLE_DEVICES'], uuid, t[0].item(), flush=True)\n")
    command = f"CUDA_VISIBLE_DEVICES=$(( (LOCAL_RANK + 1) % 2 )) exec python {script}"
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "sh", "-c", command, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"[0] visible 1 {gpu_uuid(1, 0)} 3.0" in result.stdout and f"[1] visible 0 {gpu_uuid(0, 0)} 3.0" in result.stdout
    for gpu in ("0:0", "0:1"):  # each rank's 12 MiB segment (and 512 MiB context) landed on its own node GPU
        assert any(line.split()[:2] == [gpu, "524.00"] for line in result.stderr.splitlines()), result.stderr

    same = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "sh", "-c",
                  f"CUDA_VISIBLE_DEVICES=1 exec python {script}", timeout=120)
    assert same.returncode == 1
    assert "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1" in same.stderr


DIFFERENT_NUMEL = "t = torch.ones(1000 * (rank + 1), device='cuda')\npg.allreduce([t]).wait()"
DIFFERENT_OP = ("t = torch.ones(1000, device='cuda')\n"
                "if rank == 0: pg.broadcast(t, 0).wait()\n"
                "else: pg._allgather_base(torch.empty(2000, device='cuda'), t).wait()")


def run_desync(tmp_path, calls: str, *options: str) -> subprocess.CompletedProcess:
    """Runs `calls` on 2 ranks through the process group's C++ API, as DDP's reducer calls it."""
    script = tmp_path / "mismatch.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "rank = int(os.environ['RANK']); torch.cuda.set_device(rank)\n"
        f"dist.init_process_group('nccl')\npg = dist.group.WORLD\n{calls}\nprint('unreachable')\n")
    result = mirage("run", *options, "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python", str(script),
                    timeout=120)
    assert "unreachable" not in result.stdout
    return result


@pytest.mark.parametrize("calls, expected", [
    (DIFFERENT_NUMEL, ["group rank 0: all_reduce of 1000 x Float, op SUM",
                       "group rank 1: all_reduce of 2000 x Float, op SUM"]),
    (DIFFERENT_OP, ["group rank 0: broadcast of 1000 x Float, root 0", "group rank 1: all_gather of 1000 x Float"]),
], ids=["different-numel", "different-op"])
@pytest.mark.parametrize("mode", [[], ["--timing", "--predict-only"]], ids=["full", "predict-only"])
def test_collectives_that_do_not_match_fail_on_every_rank_naming_each_call(tmp_path, calls, expected, mode):
    """The backend's half of the contract (README: "fails on every rank naming each call"), with
    --in-process so no session service ends the run first: each rank's own DistBackendError
    names both calls. (Checked: with the backend's report cut to the caller's own call, both
    cases fail here while the session's test below still passes.) Under --predict-only, where
    collectives move no payload, the ranks still compare their calls."""
    result = run_desync(tmp_path, calls, "--in-process", *mode)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    for rank in (0, 1):
        error = (f"[{rank}] [rank{rank}]: torch.distributed.DistBackendError: "
                 f"[PG ID 0 PG GUID 0(default_pg) Rank {rank}]")
        assert any(line.startswith(error) and line.endswith("the ranks' calls do not match (a desync: NCCL would "
                                                            "mix or hang here):") for line in lines), result.stderr
        for text in expected:
            assert f"[{rank}] [rank{rank}]:   {text}" in lines, result.stderr[-3000:]


@pytest.mark.parametrize("calls, expected", [
    (DIFFERENT_NUMEL, ["(different numel)", "rank 0: all_reduce(dtype=float32, shapes=[[1000]], op=SUM)",
                       "rank 1: all_reduce(dtype=float32, shapes=[[2000]], op=SUM)"]),
    (DIFFERENT_OP, ["(different op)", "rank 0: broadcast(dtype=float32, shapes=[[1000]])",
                    "rank 1: all_gather_into_tensor(dtype=float32, shapes=[[1000]])"]),
], ids=["different-numel", "different-op"])
def test_collectives_that_do_not_match_end_the_session_naming_each_call(tmp_path, calls, expected):
    """The session's half: the emulated NCCL backend is where every collective passes, so the
    flight recorder sees these too, reports the desync and ends the session with 123."""
    result = run_desync(tmp_path, calls)
    assert result.returncode == 123, result.stderr[-3000:]
    assert "mirage: collective desync in group '0' at sequence number 1" in result.stderr
    for text in expected:
        assert text in result.stderr


@pytest.mark.parametrize("collective, env, code, expected, expected_op", [
    # By default NCCL's watchdog takes the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=3)...
    ("dist.all_reduce(t)", [], 134,
     ["[rank0]:[E", "Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE, "
      "NumelIn=2, NumelOut=2, Timeout(ms)=3000)",
      "group rank(s) 1 never reached it", "Rank 0] To avoid data inconsistency, we are taking the entire process down."],
     "nccl:all_reduce"),
    # ... with TORCH_NCCL_BLOCKING_WAIT=1 the error is raised where the caller waits.
    ("dist.all_to_all_single(torch.empty_like(t), t)", ["--env", "TORCH_NCCL_BLOCKING_WAIT=1"], 1,
     ["torch.distributed.DistBackendError: [PG ID 0 PG GUID 0(default_pg) Rank 0] Watchdog caught collective "
      "operation timeout: WorkNCCL(SeqNum=2, OpType=ALLTOALL_BASE, NumelIn=2, NumelOut=2, Timeout(ms)=3000)"],
     "nccl:all_to_all"),
    # point-to-point: a receive nobody sends to
    ("dist.recv(t, 1) if rank == 0 else dist.send(t, 0)", ["--env", "TORCH_NCCL_BLOCKING_WAIT=1"], 1,
     ["OpType=RECV", "group rank(s) 1 never sent to this receive"], "nccl:recv 0<-1"),
    # TORCH_NCCL_DUMP_ON_TIMEOUT=0: the same timeout, and no trace written
    ("dist.all_reduce(t)", ["--env", "TORCH_NCCL_DUMP_ON_TIMEOUT=0"], 134, ["Watchdog caught collective operation"],
     None),
])
def test_an_operation_no_peer_matches_fails_at_the_timeout_as_with_nccl(tmp_path, collective, env, code, expected,
                                                                        expected_op):
    script = tmp_path / "hang.py"
    script.write_text(
        "import datetime, os, time, torch, torch.distributed as dist\n"
        "rank = int(os.environ['RANK']); torch.cuda.set_device(rank)\n"
        "dist.init_process_group('nccl', timeout=datetime.timedelta(seconds=3))\n"
        f"t = torch.ones(2, device='cuda')\n{collective}\n"
        f"if rank == 0: {collective}\nelse: time.sleep(600)\n")
    dump_prefix = tmp_path / "fr_trace_rank_"
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", *env,
                    "--env", f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={dump_prefix}", "--", "python", str(script),
                    timeout=120)
    assert result.returncode == code, result.stderr[-3000:]
    for text in expected:
        assert text in result.stderr
    # It fired at the timeout, not before; how late a loaded machine lets it fire is not asserted.
    ran = [int(ms) for ms in re.findall(r"Timeout\(ms\)=3000\) ran for (\d+) milliseconds", result.stderr)]
    assert ran and all(ms >= 3000 for ms in ran), ran
    if expected_op is None:
        assert not Path(f"{dump_prefix}0").exists()
        return
    # TORCH_NCCL_DUMP_ON_TIMEOUT is on by default: the flight recorder, as torch's fr_trace reads it
    trace = pickle.loads(Path(f"{dump_prefix}0").read_bytes())
    assert trace["version"] == "2.10"
    assert trace["entries"][-1]["state"] != "completed"
    assert trace["entries"][-1]["profiling_name"] == expected_op


def test_dist_smoke_on_32_emulated_gpus():  # 4 s with the fork server (49 s before it: then `slow`)
    result = mirage("run", "--num-nodes", "4", "--nproc-per-node", "8", "--gpus-per-node", "8", "--",
                    "python", "tests/fixtures/ml/dist_smoke.py", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all_reduce sum = 528 (expected 528) on 32 ranks" in result.stdout


def _two_ranks_on_two_gpus(tmp_path: Path, backend: str, body: str) -> subprocess.CompletedProcess:
    """Runs `body` on two ranks, each on its own GPU (`rank`, `torch`, `dist` in scope), in a
    process group of `backend`."""
    script = tmp_path / "two_ranks.py"
    script.write_text("import os, torch, torch.distributed as dist\n"
                      "rank = int(os.environ['RANK']); torch.cuda.set_device(rank)\n"
                      f"dist.init_process_group({backend!r})\n" + body)
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python", str(script), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_gloo_group_takes_device_tensors_as_a_cuda_build_s_gloo_does(tmp_path):
    """A CPU build's gloo has no CUDA path (it crashed on device tensors); gloo's cuda side is an
    adapter that hands it host aliases of the device memory."""
    result = _two_ranks_on_two_gpus(
        tmp_path, "gloo",
        "t = torch.full((5,), float(rank + 1), device='cuda'); dist.all_reduce(t)\n"
        "parts = [torch.empty(5, device='cuda') for _ in range(2)]; dist.all_gather(parts, t)\n"
        "cpu = torch.ones(2); dist.all_reduce(cpu)\n"
        "assert t.device.type == 'cuda' and t.tolist() == [3.0] * 5 and parts[1].tolist() == [3.0] * 5\n"
        "assert cpu.tolist() == [2.0, 2.0] and dist.get_backend() == 'gloo'\n"
        "print('gloo_cuda_ok')\n")
    assert "[0] gloo_cuda_ok" in result.stdout and "[1] gloo_cuda_ok" in result.stdout


def test_sparse_gradients_reduce_over_gloo_and_nccl_refuses_them_in_its_own_words(tmp_path):
    """ProcessGroupNCCL has no sparse all_reduce and says so in words PyTorch's tests match; a
    CUDA build's gloo reduces sparse device tensors (through host copies), so DDP over gloo trains
    an nn.Embedding(sparse=True)."""
    result = _two_ranks_on_two_gpus(
        tmp_path, "nccl",
        "def mine(): return torch.sparse_coo_tensor([[rank], [0]], [1.0 + rank], (2, 2), device='cuda')\n"
        "try:\n    dist.all_reduce(mine())\nexcept RuntimeError as e:\n    print('nccl:', e)\n"
        "gloo = dist.new_group(backend='gloo')\n"
        "t = mine(); dist.all_reduce(t, group=gloo)\n"
        "assert t.is_sparse and t.device == torch.device('cuda', rank), t\n"
        "print('gloo sum', t.to_dense().tolist())\n"
        "torch.manual_seed(0)\n"
        "ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Embedding(8, 2, sparse=True).cuda(), process_group=gloo)\n"
        "ddp(torch.tensor([rank, 5], device='cuda')).sum().backward()\n"
        "grad = ddp.module.weight.grad.coalesce()\n"
        "print('ddp grad rows', grad.indices().flatten().tolist(), grad.values()[:, 0].tolist(), grad.device)\n"
        "dist.destroy_process_group()\n")
    for rank in (0, 1):
        assert (f"[{rank}] nccl: NCCL does not support all_reduce with sparse tensors. Please use dense tensors "
                "instead.") in result.stdout
        assert f"[{rank}] gloo sum [[1.0, 0.0], [2.0, 0.0]]" in result.stdout
        # each row's gradient is summed over the ranks and divided by the world size, as DDP does
        assert f"[{rank}] ddp grad rows [0, 1, 5] [0.5, 0.5, 1.0] cuda:{rank}" in result.stdout


def test_destroying_a_group_fails_its_pending_point_to_point_operations(tmp_path):
    """As ncclCommAbort does: a receive nobody sends to fails at destroy_process_group instead
    of keeping the process (and its worker thread) waiting forever."""
    script = tmp_path / "pending.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "rank = int(os.environ['RANK']); torch.cuda.set_device(rank)\n"
        "dist.init_process_group('nccl')\n"
        "t = torch.empty(4, device='cuda')\n"
        "pending = dist.irecv(t, 1) if rank == 0 else None\n"
        "dist.barrier(); dist.destroy_process_group()\n"
        "if rank == 0:\n"
        "    try:\n"
        "        pending.wait()\n"
        "    except Exception as e:\n"
        "        print('failed:', e)\n")
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python", str(script), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OpType=RECV" in result.stdout and "destroyed or aborted while it was pending" in result.stdout


def test_nccl_surface_library_code_meets():
    """ProcessGroupNCCL and its Options, torch.cuda.nccl, _dump_nccl_trace, _hash_tensors,
    profiler events, NCCL's refusal of CPU tensors."""
    result = mirage("run", "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python",
                    "tests/workloads/nccl_surface.py", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[0] surface_ok" in result.stdout


def refusals_on_two_gpus(tmp_path, attempt: str, *flags: str) -> subprocess.CompletedProcess:
    """Runs `attempt` (code with `rank`, `torch` and `dist` at hand) on 2 ranks over nccl, under
    `mirage run` with `flags`; a DistBackendError it raises is printed as `refused: <message>`."""
    script = tmp_path / "attempt.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('nccl'); rank = dist.get_rank(); torch.cuda.set_device(rank)\n"
        "try:\n" + "".join(f"    {line}\n" for line in attempt.splitlines()) +
        "except dist.DistBackendError as error:\n    print('refused:', error)\n"
        "dist.destroy_process_group()\n")
    result = mirage("run", *flags, "--nproc-per-node", "2", "--gpus-per-node", "2", "--", "python", str(script),
                    timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_all_to_all_splits_that_disagree_fail_on_every_rank(tmp_path):
    """Rank 0 sends rank 1 three rows where rank 1 expects two: NCCL would corrupt or hang; every
    rank names the pair and both sizes before any data moves."""
    result = refusals_on_two_gpus(tmp_path, (
        "dist.all_to_all_single(torch.zeros(4, 1000, device='cuda'), torch.ones(4, 1000, device='cuda'),\n"
        "                       output_split_sizes=[2, 2], input_split_sizes=[1, 3] if rank == 0 else [2, 2])"))
    for rank in (0, 1):
        assert any(line.startswith(f"[{rank}] refused: ") and line.endswith(
            "group rank 0 sends 12000 bytes to group rank 1, which expects 8000 bytes (a send and its recv must have "
            "the same size, as with NCCL)") for line in result.stdout.splitlines()), result.stdout


@pytest.mark.parametrize("numel", [10, 1_000_000], ids=["small", "larger-than-the-ring"])
def test_a_send_and_receive_of_different_sizes_fail_the_receive_and_a_send_not_handed_over(tmp_path, numel):
    """README's contract (NCCL itself does not check: it hangs or truncates): the receive fails
    naming both sizes; the send fails too unless its whole message was already in the pair's ring
    when the receiver read its length. 40 bytes are; 4 MB (a direct copy from the sender's
    memory, or more than the ring holds) are not."""
    result = refusals_on_two_gpus(tmp_path, (
        f"if rank == 0:\n    dist.send(torch.ones({numel}, device='cuda'), 1); print('sender done')\n"
        f"else:\n    dist.recv(torch.zeros({numel} + 1, device='cuda'), 0)"))
    lines = result.stdout.splitlines()
    assert any(line.startswith("[1] refused: ") and f": a receive of {4 * (numel + 1)} bytes from group rank 0 "
               f"matched a send of {4 * numel} bytes" in line for line in lines), result.stdout
    sender_refused = any(line.startswith("[0] refused: ") and f": the send of {4 * numel} bytes to group rank 1 "
                         "matched a receive of another size there" in line for line in lines)
    handed_over = numel == 10
    assert sender_refused != handed_over and ("[0] sender done" in lines) == handed_over, result.stdout


def test_under_predict_only_a_send_and_receive_of_different_sizes_still_fail_the_receive(tmp_path):
    """--predict-only sends a floating-point message's size instead of its bytes
    (mirage/nccl/no_payload.cpp): the receive still fails naming both sizes; the send, 8 bytes
    long now, is always handed over."""
    result = refusals_on_two_gpus(tmp_path, (
        "if rank == 0:\n    dist.send(torch.ones(1_000_000, device='cuda'), 1); print('sender done')\n"
        "else:\n    dist.recv(torch.zeros(1_000_001, device='cuda'), 0)"), "--timing", "--predict-only")
    lines = result.stdout.splitlines()
    assert any(line.startswith("[1] refused: ") and ": a receive of 4000004 bytes from group rank 0 matched a send of "
               "4000000 bytes (a send and its recv must have the same size, as with NCCL)" in line for line in lines), \
        result.stdout
    assert "[0] sender done" in lines, result.stdout
