"""What TensorFlow needs to make a process rank r of a multi-worker group; the group runner itself is generic.

As in Ray Train's TensorFlow backend: the launcher places and starts processes, and this one module turns the
placements into each rank's variables.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from core.protocol import HOST_TMPDIR_ENV
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
        "TF_USE_LEGACY_KERAS": "1",  # Keras 3 with MultiWorkerMirroredStrategy is broken (keras-team/keras#20585)
        "PYTHONUNBUFFERED": "1",
    }
    devices = placements[rank].devices
    if devices is not None:  # None: the backend scopes GPUs (device plugin); an empty list would hide them
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # for an index (no UUID known): NVML numbers GPUs in PCI bus order
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    return env


def worker_temp_environment(workdir: str | Path) -> dict[str, str]:
    """`TMPDIR` for a worker started in `workdir`: `<workdir>/tmp`, created empty, and the host's own temporary
    directory as `TFMW_HOST_TMPDIR`.

    What a worker writes to its temporary directory (TensorFlow's autograph modules, the trainer's work directory
    with downloaded checkpoints and staged model files, non-chief saves) then goes when the launcher removes the
    working directory, however the worker ended: one ended by a signal runs no cleanup, so every stopped attempt
    left a checkpoint's size behind in /tmp. Emptied at each start: an earlier attempt's rank left it there."""
    temp = Path(workdir) / "tmp"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(mode=0o700, parents=True)
    return {"TMPDIR": str(temp), HOST_TMPDIR_ENV: tempfile.gettempdir()}
