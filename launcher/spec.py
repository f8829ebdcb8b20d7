"""What a worker group is made of: the launch settings, one frozen spec per rank, states and the result.

Shaped like torchelastic's agent: a `WorkerSpec` per rank checked when built, a `WorkerState` per worker, and an
all-or-nothing `RunResult` whose `failures` map rank -> the failure seen. No Airflow import here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class WorkerState(str, Enum):
    """One worker's life: started -> ready (joined the group) -> succeeded / failed / stopped (by us)."""

    STARTING = "starting"
    READY = "ready"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class GroupState(str, Enum):
    """The group as written to the run-state record (docs/CONTRACTS.md)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


class FailureKind(str, Enum):
    EXIT_CODE = "exit_code"
    SIGNAL = "signal"
    STARTUP_TIMEOUT = "startup_timeout"
    HANG = "hang"
    PORT_BIND = "port_bind"


def _freeze_env(env: Mapping[str, str] | None, what: str) -> Mapping[str, str]:
    env = dict(env or {})
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ValueError(f"{what}: {name!r} is not a valid environment variable name")
        if not isinstance(value, str):
            raise TypeError(f"{what}: variable {name} must be a string, got {type(value).__name__}")
    return MappingProxyType(env)


@dataclass(frozen=True)
class GroupSpec:
    """Everything needed to launch and supervise one group; checked once, before anything starts.

    `env` is shown in logs; `secret_env` (storage credentials) reaches the workers' environment only and is
    never printed: only its variable names are.
    """

    name: str
    entrypoint: str
    args: tuple[str, ...] = ()
    num_workers: int = 1
    use_gpu: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    startup_timeout_s: float = 180.0
    hang_timeout_s: float = 600.0
    grace_period_s: float = 10.0
    max_launch_attempts: int = 3
    # The pipeline run the group belongs to: backends mark (local/SSH: TFMW_RUN_KEY) or label (pods) with it.
    run_key: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("group name must not be empty")
        if not _MODULE_NAME.match(self.entrypoint or ""):
            raise ValueError(f"entrypoint {self.entrypoint!r} is not a module name (run as `python -m <module>`)")
        if isinstance(self.args, (str, bytes)) or not all(isinstance(a, str) for a in self.args):
            raise ValueError(f"args must be a list of strings, got {self.args!r}")
        object.__setattr__(self, "args", tuple(self.args))
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {self.num_workers!r}")
        for name in ("startup_timeout_s", "hang_timeout_s", "grace_period_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if not isinstance(self.max_launch_attempts, int) or not 1 <= self.max_launch_attempts <= 10:
            raise ValueError(f"max_launch_attempts must be an integer in 1..10, got {self.max_launch_attempts!r}")
        object.__setattr__(self, "env", _freeze_env(self.env, "env"))
        object.__setattr__(self, "secret_env", _freeze_env(self.secret_env, "secret_env"))
        overlap = set(self.env) & set(self.secret_env)
        if overlap:
            raise ValueError(f"variables {sorted(overlap)} are given both in env and as secrets: give each once")

    def describe(self) -> list[str]:
        """The launch settings as log lines, secrets by name only."""
        return [
            f"group {self.name}: {self.num_workers} worker(s) of `python -m {self.entrypoint} {' '.join(self.args)}`",
            (f"use_gpu={self.use_gpu} startup_timeout_s={self.startup_timeout_s:g} "
             f"hang_timeout_s={self.hang_timeout_s:g} grace_period_s={self.grace_period_s:g} "
             f"max_launch_attempts={self.max_launch_attempts}"),
            "env: " + (", ".join(f"{k}={v}" for k, v in sorted(self.env.items())) or "(none)"),
            "secret env (values hidden): " + (", ".join(sorted(self.secret_env)) or "(none)"),
        ]


def _is_device(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith(("GPU-", "MIG-"))
    return isinstance(device, int) and not isinstance(device, bool) and device >= 0


@dataclass(frozen=True)
class Placement:
    """Where one rank runs, as chosen by a backend.

    `host` is the address the rank's peers reach it at (it goes into TF_CONFIG). `devices`: () runs on the CPU
    (GPUs hidden), ("GPU-<uuid>",) on that GPU of the host (CUDA_VISIBLE_DEVICES takes UUIDs, and NVML does not
    promise that its index is CUDA's), (i,) on GPU index i where no UUID is known, None leaves GPU visibility to
    the backend (a Kubernetes device plugin scopes the pod's GPUs; an empty CUDA_VISIBLE_DEVICES would hide them).
    `where` holds the backend's own details for messages and records (an SSH connection id, a pod name, the GPU's
    NVML index). `gpu_idle_mb`: each placed GPU's idle level (its name in `devices` -> MiB NVML reported in use with
    no process on it, launcher/gpu_memory.py), which release waits for; empty where the backend reads none.
    """

    host: str
    port: int
    devices: tuple[int | str, ...] | None = ()
    where: Mapping[str, str] = field(default_factory=dict)
    gpu_idle_mb: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("placement host must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"placement port {self.port} is outside 1..65535")
        if self.devices is not None and not all(_is_device(d) for d in self.devices):
            raise ValueError(f"devices must be GPU UUIDs (GPU-..., MIG-...) or indices >= 0, got {self.devices!r}")
        if not all(type(level) is int and level >= 0 for level in self.gpu_idle_mb.values()):
            raise ValueError(f"GPU idle levels must be whole MiB >= 0, got {dict(self.gpu_idle_mb)!r}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class WorkerSpec:
    """One rank of one launch attempt: its place, its log file and its working directory on the launcher."""

    rank: int
    num_workers: int
    placement: Placement
    log_file: str
    workdir: str

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.num_workers:
            raise ValueError(f"rank {self.rank} is outside 0..{self.num_workers - 1}")

    @property
    def host(self) -> str:
        return self.placement.host

    @property
    def port(self) -> int:
        return self.placement.port

    @property
    def devices(self) -> tuple[int | str, ...] | None:
        return self.placement.devices

    @property
    def address(self) -> str:
        return self.placement.address


@dataclass(frozen=True)
class WorkerFailure:
    """The first thing that went wrong with one rank; `elapsed_s` is from the attempt's start to detection."""

    rank: int
    host: str
    pid: int | None
    kind: FailureKind
    exit_code: int | None
    elapsed_s: float
    detail: str
    log_tail: tuple[str, ...] = ()

    def headline(self) -> str:
        where = f"rank {self.rank} (host {self.host}, pid {self.pid})"
        return f"{where} {self.detail}"


@dataclass(frozen=True)
class WorkerOutcome:
    """One rank as the run-state record keeps it; `record` is the backend's handle identity (`record()`), `label`
    how log lines name it (`label()`), `gpu_idle_mb` its GPUs' idle levels from its placement."""

    rank: int
    host: str
    port: int
    pid: int | None
    devices: tuple[int | str, ...] | None
    state: WorkerState
    exit_code: int | None
    record: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""
    gpu_idle_mb: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RunResult:
    """All or nothing: the group succeeded only when every rank exited 0 and nothing else went wrong."""

    name: str
    state: GroupState
    workers: tuple[WorkerOutcome, ...]
    failures: Mapping[int, WorkerFailure]
    attempts: int
    wall_time_s: float
    log_files: Mapping[int, str]

    @property
    def succeeded(self) -> bool:
        return self.state is GroupState.SUCCEEDED and not self.failures

    def error_message(self) -> str:
        """One message, root cause first: rank, host, exit code or signal, when, and that rank's last lines."""
        if self.state is GroupState.STOPPED and not self.failures:
            return f"worker group {self.name} was stopped from outside after {self.wall_time_s:.1f} s"
        lines = [f"worker group {self.name} failed (launch attempt {self.attempts}):"]
        for failure in sorted(self.failures.values(), key=lambda f: (f.elapsed_s, f.rank)):
            lines.append(f"  {failure.headline()} [detected {failure.elapsed_s:.1f} s after launch]")
        root = min(self.failures.values(), key=lambda f: (f.elapsed_s, f.rank))
        if root.log_tail:
            lines.append(f"  last lines of rank {root.rank}'s log ({self.log_files.get(root.rank, '?')}):")
            lines.extend(f"    | {line}" for line in root.log_tail)
        others = [w for w in self.workers if w.rank not in self.failures]
        if others:
            lines.append("  other ranks: " + ", ".join(f"rank {w.rank} {w.state.value}" for w in others))
        return "\n".join(lines)
