"""What a worker process knows about its place in the group, and how it tells the launcher it is up.

Contract with the launcher (`launcher`, whose `protocol.py` defines the names below):
- `TF_CONFIG` (absent: a single worker) gives the cluster and this worker's index.
- `TFMW_RUN_KEY` names the pipeline run the worker belongs to (see tasks/release.py), `TFMW_GROUP` its worker
  group (the task).
- `TMPDIR` is the worker's own, inside its working directory, and `TFMW_HOST_TMPDIR` the host's
  (`worker_temp_environment`).
- Once the worker has joined the group (strategy created, i.e. the collective rendezvous passed) it prints the
  line `TFMW_READY rank=<r>` on stdout, which the launcher reads from the output stream of every backend (local
  pipe, SSH channel, pod log). The launcher's start-up timeout names the ranks whose line never came.
- Its exit status says what a retry can do (`protocol.py`: EXIT_PEER_LOST, EXIT_PERMANENT, EXIT_PREEMPTED).
Never imports TensorFlow or Airflow.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from core.protocol import ABORT_SIGNAL, HOST_TMPDIR_ENV, READY_MARKER
from launcher.process import code_to_exit_status


def host_temp_dir() -> str:
    """This host's temporary directory (not the worker's own): for caches shared by the workers of this user."""
    return os.environ.get(HOST_TMPDIR_ENV) or tempfile.gettempdir()


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
    the signal, so a worker asked to stop trained on until the launcher's SIGKILL. Outside the training loop SIGTERM
    ends the worker, by that signal, as soon as Python runs again; inside `writing_checkpoint()` it waits for the end
    of the block: when a peer dies, the survivors are stopped while the chief may still be writing the checkpoint the
    retry must resume from. Inside `preemption_notices()` (the training loop) it is a notice instead: the loop saves a
    checkpoint at the next step that every rank agrees on and the worker exits EXIT_PREEMPTED. A worker blocked in a
    collective never returns to Python: the launcher's SIGKILL after the grace period ends it.

    The launcher's ABORT_SIGNAL (another rank failed: no checkpoint can be agreed without it) keeps its default
    action, which ends the worker even inside a collective, except inside `writing_checkpoint()`, where it too
    waits for the end of the block.
    """
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(ABORT_SIGNAL, signal.SIG_DFL)


_checkpoint_writing = False
_stop_requested = False
_abort_requested = False  # the launcher's ABORT_SIGNAL came while a checkpoint was being written
_notice_deadline_s = 0.0  # > 0 inside preemption_notices(): SIGTERM is a notice with this deadline
_notice_at: float | None = None  # when (time.monotonic()) the notice came
_notice_taken = False  # the loop saved the checkpoint a notice asked for


def preemption_notice() -> float | None:
    """When (time.monotonic()) this worker got a SIGTERM taken as a preemption notice; None without one."""
    return _notice_at


@contextlib.contextmanager
def preemption_notices(deadline_s: float) -> Iterator[None]:
    """A block (the training loop) in which SIGTERM is a preemption notice: it is recorded for the loop to save a
    checkpoint and stop, and if the worker is still alive `deadline_s` later (a save that hangs, a step that never
    ends) it exits with code 128 + SIGTERM without one. `deadline_s` 0: SIGTERM ends the worker as outside. Leaving
    the block with a notice the loop did not act on (it came during the last step) ends the worker by SIGTERM."""
    global _notice_deadline_s
    _notice_deadline_s = deadline_s
    try:
        yield
    finally:
        _notice_deadline_s = 0.0
    if _notice_at is not None and not _notice_taken:
        _end_by(signal.SIGTERM)


def preemption_checkpointed() -> None:
    """The loop saved the checkpoint a notice asked for (this rank's or another's): leaving `preemption_notices()`
    ends nothing, and a SIGTERM from now on (the launcher stopping the rest of the group) is ignored."""
    global _notice_taken
    _notice_taken = True
    # Ignored by the kernel, not only by the Python handler: Python resets its handlers to SIG_DFL while the
    # interpreter shuts down, and a SIGTERM then (the launcher stopping the group once the first rank exited)
    # would end this rank by the signal instead of with EXIT_PREEMPTED.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(ABORT_SIGNAL, signal.SIG_IGN)


def _deadline_passed(deadline_s: float) -> None:
    if _notice_taken:
        return
    sys.stderr.write(f"rank {worker_identity().rank}: no preemption checkpoint within preemption_checkpoint_s="
                     f"{deadline_s:g} s of SIGTERM: exiting without it (the retry resumes from the last one)\n")
    sys.stderr.flush()
    os._exit(code_to_exit_status(-signal.SIGTERM))


def _take_notice() -> None:
    global _notice_at
    if _notice_at is not None:
        return
    _notice_at = time.monotonic()
    timer = threading.Timer(_notice_deadline_s, _deadline_passed, args=(_notice_deadline_s,))
    timer.daemon = True
    timer.start()


def _on_sigterm(signum: int, frame) -> None:
    global _stop_requested
    if _notice_taken:
        return  # the preemption checkpoint is saved and the worker is on its way out with EXIT_PREEMPTED
    if _notice_deadline_s > 0:
        _take_notice()
        return
    if _checkpoint_writing:
        _stop_requested = True
        return
    _end_by(signum)


def _end_by(signum: int) -> None:
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextlib.contextmanager
def writing_checkpoint() -> Iterator[None]:
    """A block that a SIGTERM or the launcher's ABORT_SIGNAL (see `end_on_sigterm`) lets finish before it ends the
    worker: the retry resumes from the checkpoint written here. Called from the main thread."""
    global _checkpoint_writing
    _checkpoint_writing = True
    abort_action = signal.signal(ABORT_SIGNAL, _defer_abort) or signal.SIG_DFL  # None: not set from Python
    try:
        yield
    finally:
        _checkpoint_writing = False
        signal.signal(ABORT_SIGNAL, abort_action)
        if _abort_requested and abort_action is not signal.SIG_IGN:
            _end_by(ABORT_SIGNAL)
        if _stop_requested:
            _end_by(signal.SIGTERM)


def _defer_abort(signum: int, frame) -> None:
    global _abort_requested
    _abort_requested = True
