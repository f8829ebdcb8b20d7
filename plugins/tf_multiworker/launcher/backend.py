"""The backend interface: where workers run. `local` starts processes here; SSH and Kubernetes fit the same two
calls (place the ranks, start one rank) and the same handle (pid/group, output stream, poll, terminate, kill)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import IO

from tf_multiworker.launcher.spec import Placement, WorkerSpec


class WorkerHandle(ABC):
    """One started worker. Every method must be safe to call from a signal handler and more than once."""

    rank: int
    host: str
    pid: int | None
    pgid: int | None

    @property
    @abstractmethod
    def output(self) -> IO[bytes]:
        """The worker's merged stdout and stderr."""

    @abstractmethod
    def poll(self) -> int | None:
        """Exit status once finished (negative: killed by that signal), else None. Never blocks."""

    @abstractmethod
    def terminate(self) -> None:
        """Ask the worker and everything it started to stop (SIGTERM to its process group)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop the worker and everything it started now (SIGKILL to its process group)."""

    @abstractmethod
    def gone(self) -> bool:
        """True once the worker and every process it started have exited and been reaped."""


class Backend(ABC):
    name: str

    @abstractmethod
    def place(self, num_workers: int, use_gpu: bool) -> list[Placement]:
        """Host, a fresh port and the GPUs of each rank. Raises `LaunchError` before anything starts."""

    @abstractmethod
    def start(self, spec: WorkerSpec, command: list[str], env: Mapping[str, str]) -> WorkerHandle:
        """Start one rank: `command` with the task's environment plus `env`, in `spec.workdir`."""
