"""Every rank's output on its way out of a worker group (launcher/group.py): each line, secrets hidden, to the rank's
log file (every line), to the idle-held watch and the rank's tail, and through a bounded queue to the task log,
handed to `on_line` in the supervising thread (Airflow's task logger is used from there only).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO

from core.protocol import is_ready_marker
from launcher.backend import WorkerHandle
from launcher.idle import IdleWatch
from launcher.log_policy import is_native_noise
from launcher.spec import WorkerOutcome, WorkerSpec, WorkerState

TAIL_LINES = 20
# Worker output is bounded on its way to the task log (the rank's log file keeps every line): a longer line arrives
# in pieces of MAX_LINE_BYTES (as the SSH agent cuts them); at most MAX_QUEUED_LINES wait for the task log, more are
# left out there and counted; one poll hands on at most MAX_LINES_PER_POLL, so a flood never keeps the watch loop
# from its exit, orphan and hang checks.
MAX_LINE_BYTES = 64 << 10
MAX_QUEUED_LINES = 10_000
MAX_LINES_PER_POLL = 2_000

LineSink = Callable[[int, str], None]


@dataclass
class RunningWorker:
    """The mutable runtime record of one rank in one launch attempt."""

    spec: WorkerSpec
    handle: WorkerHandle
    log_file: IO[str]
    state: WorkerState = WorkerState.STARTING
    exit_code: int | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None
    ready_seen: bool = False  # set by the reader thread when the worker printed its ready marker

    def outcome(self) -> WorkerOutcome:
        return WorkerOutcome(self.spec.rank, self.spec.host, self.spec.port, self.handle.pid, self.spec.devices,
                             self.state, self.exit_code, self.handle.record(), self.handle.label(),
                             self.spec.placement.gpu_idle_mb)


def _left_out(rank: int, count: int) -> str:
    return (f"[{count} line(s) of rank {rank} left out of the task log: the workers print faster than it is "
            "written; the rank's log file has them]")


class OutputRelay:
    """The output of one group's ranks, for as long as the group lives (one reader thread per rank calls `pump`)."""

    def __init__(self, on_line: LineSink, secret_env: Mapping[str, str], *, use_gpu: bool,
                 idle: IdleWatch | None) -> None:
        self.on_line, self.use_gpu, self.idle = on_line, use_gpu, idle
        self._lines: queue.Queue[tuple[int, str]] = queue.Queue(MAX_QUEUED_LINES)
        self._unannounced: dict[int, int] = {}  # rank -> lines left out of the task log when its output ended
        self.last_output = time.monotonic()
        # Longest first, so a secret containing another is hidden whole; very short values would mask noise.
        self._secret_values = sorted({v for v in secret_env.values() if len(v) >= 4}, key=len, reverse=True)

    def redact(self, line: str) -> str:
        """Secret values a worker prints never reach the task log or the rank log files kept in storage."""
        for value in self._secret_values:
            line = line.replace(value, "***")
        return line

    def pump(self, worker: RunningWorker) -> None:
        """Copy one rank's output until it ends (the rank's reader thread)."""
        rank, left_out = worker.spec.rank, 0
        for raw in iter(lambda: worker.handle.output.readline(MAX_LINE_BYTES), b""):
            line = self.redact(raw.decode("utf-8", "replace").rstrip("\r\n"))
            if worker.log_file.closed:
                break  # a process that escaped the group still holds the pipe after the attempt ended
            worker.log_file.write(line + "\n")
            worker.log_file.flush()
            if is_ready_marker(line):
                worker.ready_seen = True
            if self.idle:  # here, not in the task log's queue: a line left out of the log is still progress
                self.idle.line(rank, line, ready=worker.ready_seen)
            worker.tail.append(line)
            self.last_output = time.monotonic()
            if not is_native_noise(line, use_gpu=self.use_gpu):  # the log file above keeps it
                left_out = self._queue_line(rank, line, left_out)
        if left_out:  # the output ended while lines were left out: the attempt's last drain says so
            self._unannounced[rank] = left_out
        worker.handle.output.close()

    def _queue_line(self, rank: int, line: str, left_out: int) -> int:
        """Queue the line for the task log unless the queue is full; returns how many lines are left out since the
        last one queued (said in the task log once there is room again)."""
        try:
            if left_out:
                self._lines.put_nowait((rank, _left_out(rank, left_out)))
                left_out = 0
            self._lines.put_nowait((rank, line))
        except queue.Full:
            return left_out + 1
        return 0

    def drain_poll(self) -> None:
        """One poll of the watch loop's share of queued lines."""
        self.drain(MAX_LINES_PER_POLL)

    def drain(self, limit: int | None = None) -> None:
        """Hand queued lines to `on_line`: at most `limit` (a poll of the watch loop), else all of them and then
        how many lines each rank had left out at its output's end."""
        handed = 0
        while limit is None or handed < limit:
            try:
                rank, line = self._lines.get_nowait()
            except queue.Empty:
                break
            self.on_line(rank, line)
            handed += 1
        while limit is None and self._unannounced:
            rank, count = self._unannounced.popitem()
            self.on_line(rank, _left_out(rank, count))
