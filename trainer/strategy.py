"""The distribution strategy, created one way for training and for the preflight's collectives.

TensorFlow's trap: with TF_CONFIG, `MultiWorkerMirroredStrategy` must be the first TF object of the process (an
earlier op starts TF's runtime without the cluster, and the strategy then fails or runs alone), so callers check
everything else without TensorFlow first. Workers run tf-keras, Keras 2 (TF_USE_LEGACY_KERAS=1, set by the
launcher's `tf_env`): Keras 3 with this strategy is broken (keras-team/keras#20585).
"""

from __future__ import annotations

import os
import re

from core.config import RunConfig
from trainer import runtime
from trainer.allreduce import communication_options


def create_strategy(cfg: RunConfig, multi_worker: bool, collective_timeout_s: int | None = None):
    """The devices `cfg` asks for, then the strategy: MWMS with TF_CONFIG (`multi_worker`), else the default one.

    `collective_timeout_s` bounds each collective (the preflight's). Training passes none: TF 2.21 parks one
    sleeping thread per collective for the whole timeout (tensorflow#62466), +2 threads per step until
    pthread_create fails. Training hangs are bounded without it: a peer that exits or stops misses the coordination
    service's heartbeats and the others' collectives abort (exit 3); a peer alive but stuck leaves the group silent
    and the launcher's hang watchdog ends it. The retry resumes from the last checkpoint.
    """
    import tensorflow as tf

    if not cfg.use_gpu:
        tf.config.set_visible_devices([], "GPU")
    elif not tf.config.list_physical_devices("GPU"):
        raise RuntimeError(
            f"'use_gpu' is true but TensorFlow sees no GPU on {runtime.worker_identity().host} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): set 'use_gpu' false or fix the driver."
        )
    if not multi_worker:
        return tf.distribute.get_strategy()
    options = communication_options(cfg, timeout_s=collective_timeout_s)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    runtime.end_on_sigterm()
    return strategy


def collective_error_reason(error: Exception) -> str:
    """The lines of a TF collective error that name the cause (`str(error)` opens with a node traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if "aborted by" in line or "unhealthy" in line or line.startswith("RPC:"):
            reason = line
            if line.endswith(":") and index + 1 < len(lines):  # "... unhealthy (stopped sending heartbeats):" + task
                reason += " " + lines[index + 1]
            return reason
    return lines[0] if lines else type(error).__name__


_TASK = re.compile(r"/job:worker/replica:\d+/task:(\d+)")


def lost_peers(error: Exception, identity: runtime.WorkerIdentity) -> str:
    """The peers a collective error reports unhealthy, named by rank, host and port from TF_CONFIG ("" if none):
    what the operator needs when a host's link or power went away and that host can no longer say so itself."""
    text = str(error)
    if "unhealthy" not in text:
        return ""
    ranks = sorted({int(index) for index in _TASK.findall(text[text.index("unhealthy"):])} - {identity.rank})
    named = []
    for rank in ranks:
        host, _, port = (identity.addresses[rank] if rank < len(identity.addresses) else "?").rpartition(":")
        named.append(f"rank {rank} (host {host}, port {port})")
    return ", ".join(named)
