"""One exception type per failure family, so callers (and people reading a task log) can tell them apart."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.spec import RunResult


class LaunchError(RuntimeError):
    """The group could not be launched at all: bad settings or missing resources (nothing was started)."""


class InsufficientGPUsError(LaunchError):
    """`use_gpu` asks for more GPUs than are free on the machine."""


class WorkerGroupError(RuntimeError):
    """The group ran and did not succeed; `result` holds every rank's outcome."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result.error_message())
        self.result = result


class WorkerFailedError(WorkerGroupError):
    """A worker exited non-zero or was killed by a signal."""


class WorkerStartupTimeoutError(WorkerGroupError):
    """Some ranks never signalled that they joined the group within `startup_timeout_s`."""


class WorkerHangError(WorkerGroupError):
    """Workers were alive but the whole group printed nothing for `hang_timeout_s` (a hung collective)."""


class PortBindError(WorkerGroupError):
    """A worker could not bind its port on every launch attempt."""


class WorkerGroupStoppedError(WorkerGroupError):
    """The group was stopped from outside (task killed, marked failed, timed out)."""


class MissingOutputError(RuntimeError):
    """Every worker exited 0 but the artifact that marks a complete job is absent."""
