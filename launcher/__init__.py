"""Launch a group of TensorFlow workers and supervise it as one unit. Importable without Airflow."""

from launcher.backend import Backend, WorkerHandle
from launcher.errors import (
    InsufficientGPUsError,
    LaunchError,
    PortBindError,
    WorkerFailedError,
    WorkerGroupError,
    WorkerGroupStoppedError,
    WorkerHangError,
    WorkerStartupTimeoutError,
)
from launcher.gpus import probe_gpus
from launcher.group import WorkerGroup
from launcher.local import LocalBackend, PortAllocator
from launcher.spec import (
    FailureKind,
    GroupSpec,
    GroupState,
    Placement,
    RunResult,
    WorkerFailure,
    WorkerOutcome,
    WorkerSpec,
    WorkerState,
)
from launcher.tf_env import build_tf_config, tensorflow_env

__all__ = [
    "Backend", "FailureKind", "GroupSpec", "GroupState", "InsufficientGPUsError", "LaunchError", "LocalBackend",
    "Placement", "PortAllocator", "PortBindError", "RunResult", "WorkerFailedError", "WorkerFailure", "WorkerGroup",
    "WorkerGroupError", "WorkerGroupStoppedError", "WorkerHandle", "WorkerHangError", "WorkerOutcome", "WorkerSpec",
    "WorkerStartupTimeoutError", "WorkerState", "build_tf_config", "error_for", "probe_gpus", "tensorflow_env",
]


def error_for(result: RunResult) -> WorkerGroupError:
    """The exception for a result that did not succeed, chosen by its root cause."""
    if not result.failures:
        return WorkerGroupStoppedError(result)
    root = min(result.failures.values(), key=lambda f: (f.elapsed_s, f.rank))
    return {
        FailureKind.STARTUP_TIMEOUT: WorkerStartupTimeoutError,
        FailureKind.HANG: WorkerHangError,
        FailureKind.PORT_BIND: PortBindError,
    }.get(root.kind, WorkerFailedError)(result)
