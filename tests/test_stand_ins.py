"""--stand-ins K (docs/stand-in-replicas.md): a clocked, predict-only job runs 1/K of its nodes,
each running rank standing for K data-parallel replicas (and with --stand-ins-in-node T for the
T ranks of its tensor-parallel group). Checked against the full job: the same
world as the program sees it, the same answers to integer collectives, the same FSDP shards, and
the same predicted step time and peak memory."""

import json

import pytest

from conftest import mirage

WORKLOAD = "tests/workloads/stand_ins.py"
TORCHRUN = ("torchrun --nnodes=$MIRAGE_NUM_NODES --node-rank=$MIRAGE_NODE_RANK --nproc-per-node=2 "
            f"--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT {WORKLOAD}")


def predicted(tmp_path, name: str, nodes: int, *flags: str, mesh: str = "") -> tuple[list[str], dict]:
    """The rank-0 lines the workload prints and the session's summary."""
    summary = tmp_path / f"{name}.json"
    result = mirage("run", "--timing", "--predict-only", "--num-nodes", str(nodes), "--gpus-per-node", "2",
                    "--summary-json", str(summary), *flags, "--", "bash", "-c", f"{TORCHRUN} {mesh}", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line.split("] ", 1)[-1] for line in result.stdout.splitlines() if "world " in line or "shard rows" in line]
    return lines, json.loads(summary.read_text())


def test_stand_ins_predict_what_the_full_job_predicts(tmp_path):
    full_lines, full = predicted(tmp_path, "full", 2)
    lines, stood_in = predicted(tmp_path, "stand_ins", 2, "--stand-ins", "2")
    # What the program sees: a world of 4, an all_reduce of ones counting 4, every rank's object,
    # parameters sharded 4 ways
    assert full_lines == ["world 4 WORLD_SIZE 4 ones 4 local ranks [0, 1, 0, 1]", "shard rows 256 of 1024"]
    assert lines == full_lines
    # Half the processes ran, and predicted what all of them did
    assert len(stood_in["processes"]) * 2 == len(full["processes"])
    assert stood_in["timing"]["job"] == full["timing"]["job"]
    # The comparison can tell: one node's job of 2 ranks, without stand-ins, predicts otherwise
    _, one_node = predicted(tmp_path, "one_node", 1)
    assert one_node["timing"]["job"]["step_ms"] != full["timing"]["job"]["step_ms"]
    assert one_node["timing"]["job"]["peak_allocated"] > full["timing"]["job"]["peak_allocated"]


def test_stand_ins_with_the_data_parallel_dimension_inside_pipeline_stages(tmp_path):
    """torchtitan's layout with pipeline parallelism: stages outermost, then data, then tensor
    parallelism (rank = stage x 4 + dp x 2 + tp on 4 nodes of 2). --stand-ins-stride 2: the
    data-parallel index changes every 2 ranks, so nodes 0 and 2 run (stage 0 and 1 of replica 0),
    sending activations between stages and all-reducing over TP, and stand for nodes 1 and 3."""
    full_lines, full = predicted(tmp_path, "full", 4, mesh="2 2 2")
    lines, stood_in = predicted(tmp_path, "stand_ins", 4, "--stand-ins", "2", "--stand-ins-stride", "2",
                                mesh="2 2 2")
    assert full_lines == ["world 8 WORLD_SIZE 8 ones 8 local ranks [0, 1, 0, 1, 0, 1, 0, 1]", "shard rows 512 of 1024"]
    assert lines == full_lines
    assert len(stood_in["processes"]) * 2 == len(full["processes"])
    assert stood_in["timing"]["job"] == full["timing"]["job"]


def test_stand_ins_in_node_stand_for_the_tensor_parallel_group_too(tmp_path):
    """--stand-ins-in-node 2 on the same layout: of each node's 2 ranks (a TP group) only local
    rank 0 goes on past start-up, so 2 of the job's 8 ranks run (stage 0 and 1 of replica 0),
    each standing for 4: the same world, the same integer sums, the same shards and the same
    predicted step and memory as all 8 ranks."""
    full_lines, full = predicted(tmp_path, "full", 4, mesh="2 2 2")
    lines, stood_in = predicted(tmp_path, "stand_ins", 4, "--stand-ins", "2", "--stand-ins-stride", "2",
                                "--stand-ins-in-node", "2", mesh="2 2 2")
    # all_gather_object: a stood-in rank's object is its stand-in's (local rank 0's); the rest as the full job
    assert lines == [full_lines[0].replace("[0, 1, 0, 1, 0, 1, 0, 1]", "[0, 0, 0, 0, 0, 0, 0, 0]"), full_lines[1]]
    # 2 ranks ran collectives (each node's local rank 0 of the 2 running nodes), for the full job's 8
    assert [entry["rank"] for entry in stood_in["collectives"]] == [0, 4]
    assert len(full["collectives"]) == 8
    assert stood_in["timing"]["job"] == full["timing"]["job"]


@pytest.mark.parametrize("flags, message", [
    (["--timing", "--predict-only", "--gpus-per-node", "4", "--stand-ins-in-node", "3"],
     "--stand-ins-in-node 3 must divide --gpus-per-node 4"),
    (["--timing", "--gpus-per-node", "2", "--stand-ins-in-node", "2"],
     "--stand-ins-in-node needs --timing --predict-only"),
])
def test_stand_ins_in_node_refused_where_they_cannot_stand(flags: list[str], message: str):
    result = mirage("run", *flags, "--", "python", "-c", "print('ran')")
    assert result.returncode == 2 and message in result.stderr and "ran" not in result.stdout


@pytest.mark.parametrize("flags, message", [
    (["--timing", "--num-nodes", "2"], "--stand-ins needs --timing --predict-only"),
    (["--timing", "--predict-only", "--num-nodes", "3"], "--stand-ins 2 does not divide --num-nodes 3"),
    (["--timing", "--predict-only", "--num-nodes", "2", "--nproc-per-node", "2"], "--stand-ins needs the ranks "
                                                                                   "launched by torchrun"),
    (["--timing", "--predict-only", "--num-nodes", "4", "--gpus-per-node", "2", "--stand-ins-stride", "3"],
     "--stand-ins-stride 3 must be a whole number of nodes' ranks"),
])
def test_stand_ins_refused_where_they_cannot_stand(flags: list[str], message: str):
    result = mirage("run", *flags, "--stand-ins", "2", "--", "python", "-c", "print('ran')")
    assert result.returncode == 2 and message in result.stderr and "ran" not in result.stdout
