"""What a worker process knows about its place in the group, and how it tells the launcher it is up.

Contract with the launcher (`plugins/tf_multiworker/launcher`):
- `TF_CONFIG` (absent: a single worker) gives the cluster and this worker's index.
- `TFMW_RUN_KEY` names the pipeline run the worker belongs to (see tasks/release.py), `TFMW_GROUP` its worker
  group (the task).
- `TMPDIR` is the worker's own, inside its working directory, and `TFMW_HOST_TMPDIR` the host's
  (`worker_temp_environment`).
- Once the worker has joined the group (strategy created, i.e. the collective rendezvous passed) it prints the
  line `TFMW_READY rank=<r>` on stdout, which the launcher reads from the output stream of every backend (local
  pipe, SSH channel, pod log). The launcher's start-up timeout names the ranks whose line never came.
Never imports TensorFlow or Airflow.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

# The in-band readiness marker: a line of its own on stdout, so it travels wherever the worker's output does.
READY_MARKER = "TFMW_READY"
# Set on every worker of a pipeline run: the release task finds all of the run's processes by it.
RUN_KEY_ENV = "TFMW_RUN_KEY"
# Set next to it: the worker group's name (the task id), so a task's next attempt finds what an earlier one left.
GROUP_ENV = "TFMW_GROUP"
# The launcher's per-task temporary directories start with this; release deletes only such directories.
LAUNCHER_WORKDIR_PREFIX = "tfmw-"

# The host's temporary directory, for what should outlive one worker (the shard cache); see worker_temp_environment.
HOST_TMPDIR_ENV = "TFMW_HOST_TMPDIR"


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


def host_temp_dir() -> str:
    """This host's temporary directory (not the worker's own): for caches shared by the workers of this user."""
    return os.environ.get(HOST_TMPDIR_ENV) or tempfile.gettempdir()


# What a worker inherits from the process that launches it (an Airflow task holds its database URL, Fernet key,
# JWT secret and other connections in its environment: none of that may reach a worker). AWS_* are the storage
# credentials when the run names no connection; GPT_FINETUNE_* hold the operator's limits that RunConfig applies
# again in every worker (data roots, allowed buckets).
INHERITED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "http_proxy", "https_proxy", "no_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
})
INHERITED_PREFIXES = ("LC_", "PYTHON", "TF_", "CUDA_", "NCCL_", "NVIDIA_", "XLA_", "HF_", "TRANSFORMERS_",
                      "TOKENIZERS_", "OMP_", "MKL_", "OPENBLAS_", "AWS_", "TFMW_", "GPT_FINETUNE_")


def inherited_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed part of `environ` that a worker (or evaluation) process starts with."""
    return {name: value for name, value in environ.items()
            if name in INHERITED_NAMES or name.startswith(INHERITED_PREFIXES)}


@dataclass(frozen=True)
class WorkerIdentity:
    rank: int
    num_workers: int
    host: str
    addresses: tuple[str, ...]

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


def worker_identity(environ: dict[str, str] | None = None) -> WorkerIdentity:
    """Rank and group size from TF_CONFIG; no TF_CONFIG means rank 0 of 1."""
    env = os.environ if environ is None else environ
    raw = env.get("TF_CONFIG")
    if not raw:
        return WorkerIdentity(0, 1, socket.gethostname(), ())
    tf_config = json.loads(raw)
    workers = tuple(tf_config["cluster"]["worker"])
    task = tf_config["task"]
    if task.get("type") != "worker":
        raise ValueError(f"TF_CONFIG task type {task.get('type')!r} is not supported: only 'worker'")
    return WorkerIdentity(int(task["index"]), len(workers), socket.gethostname(), workers)


def signal_ready() -> None:
    """Tell the launcher this worker has joined the group (a harmless line when run by hand)."""
    rank = worker_identity().rank
    # One write of a whole line, flushed: it must not interleave with log lines of other threads.
    sys.stdout.write(f"{READY_MARKER} rank={rank}\n")
    sys.stdout.flush()


def end_on_sigterm() -> None:
    """Make SIGTERM end this worker again; call right after creating MultiWorkerMirroredStrategy.

    Creating the strategy installs TensorFlow's preemption notifier: a C-level SIGTERM handler that only records
    the signal, so a worker asked to stop trained on until the launcher's SIGKILL. This project takes no preemption
    notices (a retry resumes from the last checkpoint), so SIGTERM ends the worker, by that signal, as soon as
    Python runs again; inside `writing_checkpoint()` it waits for the end of the block: when a peer dies, the
    survivors are stopped while the chief may still be writing the checkpoint the retry must resume from. A worker
    blocked in a collective never returns to Python: the launcher's SIGKILL after the grace period ends it.
    """
    signal.signal(signal.SIGTERM, _on_sigterm)


_checkpoint_writing = False
_stop_requested = False


def _on_sigterm(signum: int, frame) -> None:
    global _stop_requested
    if _checkpoint_writing:
        _stop_requested = True
        return
    _end_by(signum)


def _end_by(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def writing_checkpoint() -> Iterator[None]:
    """A block that a SIGTERM (see `end_on_sigterm`) lets finish before it ends the worker."""
    global _checkpoint_writing
    _checkpoint_writing = True
    try:
        yield
    finally:
        _checkpoint_writing = False
        if _stop_requested:
            _end_by(signal.SIGTERM)


def is_ready_marker(line: str) -> bool:
    return line.startswith(READY_MARKER + " rank=")
