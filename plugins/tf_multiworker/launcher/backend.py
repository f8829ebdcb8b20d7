"""The backend interface: everything about *where* workers run. The group runner (`group.py`) only places ranks,
starts them, reads their output and polls them; each backend hides its hosts behind these calls: `local` starts
processes here, `ssh` runs an agent per rank on remote hosts, Kubernetes one pod per rank."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import IO, Any, ClassVar

from tf_multiworker.launcher.spec import GroupSpec, Placement, WorkerSpec


class WorkerHandle(ABC):
    """One started worker. Every method must be safe to call from a signal handler and more than once."""

    rank: int
    host: str
    pid: int | None  # for messages; None where the backend has no process id (a pod)

    @property
    @abstractmethod
    def output(self) -> IO[bytes]:
        """The worker's merged stdout and stderr: `readline()` until b"", then `close()`."""

    @abstractmethod
    def poll(self) -> int | None:
        """Exit status once finished (negative: killed by that signal), else None. Never blocks."""

    @abstractmethod
    def terminate(self) -> None:
        """Ask the worker and everything it started to stop (SIGTERM, wherever it runs). Returns at once."""

    @abstractmethod
    def kill(self) -> None:
        """Stop the worker and everything it started now (SIGKILL, wherever it runs)."""

    @abstractmethod
    def gone(self) -> bool:
        """True once the worker and every process it started have exited."""

    def waiting_reason(self) -> str:
        """Why the worker has not started yet (a pod still Pending: its reason and events); "" once it runs."""
        return ""

    @abstractmethod
    def record(self) -> dict[str, Any]:
        """What the run-state record keeps so that release can find this worker again (JSON values)."""


class Backend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def place(self, group: GroupSpec) -> list[Placement]:
        """Host, port and GPUs of each rank. Raises `LaunchError` before anything starts."""

    @abstractmethod
    def command(self, group: GroupSpec) -> list[str]:
        """The worker's command line, with the interpreter of wherever it runs."""

    @abstractmethod
    def start(self, group: GroupSpec, worker: WorkerSpec, command: list[str], env: Mapping[str, str]) -> WorkerHandle:
        """Start one rank: `command` with `env` (shown in logs) plus `group.secret_env`, which each backend
        delivers its own way and never into an argv, a log or a spec someone else can read."""

    def end_group(self, group: GroupSpec) -> None:
        """Called once every worker of a launch attempt is gone (objects the group shared)."""

    @abstractmethod
    def end_earlier_attempts(self, group: GroupSpec) -> list[dict[str, Any]]:
        """End what an earlier attempt of the same group of the same run left alive, wherever this backend runs
        workers (found by the run key and the group's name, not by records: the attempt that left them may have
        died before writing one). Called before the group launches. Returns one entry per host, as `release` does:
        {"host", "found", "terminated", "killed", "survivors"}, plus "error" for a host that could not be asked."""

    @abstractmethod
    def release(self, run_key: str, records: list[dict[str, Any]]) -> dict[str, Any]:
        """End whatever is left of run `run_key` wherever this backend runs workers; `records` are the `workers`
        entries of this backend's state records. Returns {"backend", "hosts": [{"host", "found", "terminated",
        "killed", "survivors", ...}], "clean"}; a host that cannot be reached is reported, never skipped."""

    def close(self) -> None:
        """Release connections; the backend is not used afterwards."""
