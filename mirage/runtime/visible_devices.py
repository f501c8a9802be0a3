"""Which of its node's emulated GPUs a process sees, from the variables the real runtimes read.

Launchers and job scripts often give each rank one GPU with `CUDA_VISIBLE_DEVICES=$LOCAL_RANK`
and then use `cuda:0` everywhere; the rank must then see one device, and that device must be the
node's GPU $LOCAL_RANK (its memory, its name in `mirage smi`, its identity for NCCL's
duplicate-GPU check). The shim and torch.cuda both work from the list computed here, exported
to the shim as MIRAGE_VISIBLE_GPUS (node GPU indices in visible order); every process computes
it afresh from its own environment, as the driver does.

The rules are CUDA's: a comma-separated list of indices or UUIDs (`GPU-` and a unique prefix of
one); the list ends at the first entry that is invalid, out of range or repeated; an empty value
hides every GPU. ROCm (AMD profiles) first narrows the node's GPUs with ROCR_VISIBLE_DEVICES,
then HIP_VISIBLE_DEVICES (or, if unset, CUDA_VISIBLE_DEVICES) picks among those.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

# GPU UUIDs are drawn from this namespace: random-looking as a board's are, the same for a node's
# GPU in every session (a script may name it in CUDA_VISIBLE_DEVICES), different on every node.
_UUID_NAMESPACE = uuid.UUID("5f0c1d3e-2a8b-4c6d-9e7f-81a2b3c4d5e6")


def variables(amd: bool) -> tuple[str, ...]:
    """The variables that choose visible GPUs on this vendor's runtime."""
    return ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if amd else ("CUDA_VISIBLE_DEVICES",)


def gpu_uuid(node_gpu: int, node: int) -> str:
    """The UUID of a node's GPU, as torch.cuda.get_device_properties(i).uuid and nvidia-smi -L
    report it (without nvidia-smi's "GPU-")."""
    return str(uuid.uuid5(_UUID_NAMESPACE, f"node{node}/gpu{node_gpu}"))


def pci_bus(node_gpu: int) -> int:
    """The PCI bus of a node's GPU: torch's pci_bus_id, nvidia-smi's Bus-Id, amd-smi's BDF."""
    return node_gpu + 1


def _lookup(entry: str, candidates: list[int], node: int) -> int | None:
    """The candidate an entry names (an index into `candidates` or a UUID), else None."""
    entry = entry.strip()
    if entry.isdigit():
        position = int(entry)
        return candidates[position] if position < len(candidates) else None
    if entry.upper().startswith("GPU-") and len(entry) > 4:
        prefix = entry[4:].lower()
        matches = [gpu for gpu in candidates if gpu_uuid(gpu, node).startswith(prefix)]
        return matches[0] if len(matches) == 1 else None
    return None


def select(spec: str | None, candidates: list[int], node: int) -> list[int]:
    """The GPUs a *_VISIBLE_DEVICES value leaves visible, in its order (None: all of them)."""
    if spec is None:
        return list(candidates)
    chosen: list[int] = []
    for entry in spec.split(",") if spec.strip() else []:
        gpu = _lookup(entry, candidates, node)
        if gpu is None or gpu in chosen:
            break
        chosen.append(gpu)
    return chosen


def visible_gpus(node_gpus: int, amd: bool, env: Mapping[str, str]) -> list[int]:
    """This process's GPUs as node GPU indices: position i is what it calls cuda:i."""
    candidates = list(range(node_gpus))
    node = int(env.get("MIRAGE_NODE_RANK", "0"))
    if amd:
        candidates = select(env.get("ROCR_VISIBLE_DEVICES"), candidates, node)
        return select(env.get("HIP_VISIBLE_DEVICES", env.get("CUDA_VISIBLE_DEVICES")), candidates, node)
    return select(env.get("CUDA_VISIBLE_DEVICES"), candidates, node)
