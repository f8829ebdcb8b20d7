"""What TensorFlow needs to make a process rank r of a multi-worker group; the group runner itself is generic.

As in Ray Train's TensorFlow backend: the launcher places and starts processes, and this one module turns the
placements into each rank's variables.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from launcher.spec import Placement


def build_tf_config(addresses: Sequence[str], rank: int) -> dict:
    """The `TF_CONFIG` of worker `rank` in a cluster of `addresses` ("host:port", index = rank)."""
    if not addresses:
        raise ValueError("TF_CONFIG needs at least one worker address")
    if not 0 <= rank < len(addresses):
        raise ValueError(f"rank {rank} is outside the cluster of {len(addresses)} workers (0..{len(addresses) - 1})")
    return {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": rank}}


def tensorflow_env(placements: Sequence[Placement], rank: int) -> dict[str, str]:
    """The variables that make a process rank `rank` (docs/CONTRACTS.md, launcher <-> worker)."""
    env = {
        "TF_CONFIG": json.dumps(build_tf_config([p.address for p in placements], rank)),
        "PYTHONUNBUFFERED": "1",
    }
    devices = placements[rank].devices
    if devices is not None:  # None: the backend scopes GPUs (device plugin); an empty list would hide them
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # for an index (no UUID known): NVML numbers GPUs in PCI bus order
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    return env
