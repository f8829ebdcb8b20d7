"""The backend interface: everything about *where* workers run. The group runner (`group.py`) only places ranks,
starts them, reads their output and polls them; each backend hides its hosts behind these calls: `local` starts
processes here, `ssh` runs an agent per rank on remote hosts, Kubernetes one pod per rank."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import IO, Any, ClassVar

from core.document import Document
from launcher.spec import GroupSpec, Placement, WorkerOutcome, WorkerSpec
from launcher.state_record import StateRecord

# How long release gives a run's workers between SIGTERM (or a pod's deletion) and SIGKILL.
RELEASE_GRACE_S = 10.0


@dataclass(frozen=True)
class Capacity:
    """What a backend can place now for a group: at most `workers`, with `reasons` saying why fewer than asked.

    `settings` are the run settings a smaller launch on what is usable needs (the SSH hosts that answered:
    `{"ssh_conn_ids": [...]}`), `hosts` where that is, for the launch record; both empty when nothing narrowed."""

    workers: int
    reasons: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostRelease(Document):
    """What ending a run's workers on one host found and did: each host of a backend's `release` and of its sweep
    of earlier attempts (`end_earlier_attempts`), and, flattened (`entry`), each of release.json's `hosts`.

    Attributes:
        host: where: an address or hostname; "namespace <ns> (connection <id>)" on Kubernetes.
        found: what of the run was there: {"pid", "cmdline"} per process (local, ssh), "<kind>/<name>" per object
            (kubernetes).
        terminated: what ended within the grace (pids after SIGTERM; objects after a graceful delete).
        killed: pids ended by SIGKILL after the grace.
        survivors: what is still there afterwards: pids, or "<kind>/<name>". Any survivor makes a release unclean.
        error: why the host could not be asked (unreachable, refused); None when it answered.
        gpu_check: the bounded check that the run's GPUs are free (launcher/gpus.py), where the backend makes one.
        evidence: the backend's own further fields, JSON values: local and ssh "removed_dirs"; ssh "conn_id",
            "hostname" and the agent's "clean"; kubernetes "selector", "kept", "pods", "checked", "problems".
    """

    host: str
    found: tuple[Any, ...] = ()
    terminated: tuple[Any, ...] = ()
    killed: tuple[Any, ...] = ()
    survivors: tuple[Any, ...] = ()
    error: str | None = None
    gpu_check: dict[str, Any] | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, host: str, answer: Mapping[str, Any]) -> HostRelease:
        """The entry for `host` from a flat answer (an SSH agent's JSON line, a sweep's dict), its named fields
        checked as `from_xcom` checks them (an answer from a host is untrusted input too), the rest kept as
        `evidence`; the answer's own "host" (a remote hostname) gives way to `host`."""
        named = {f.name for f in fields(cls)} - {"host", "evidence"}
        return cls.from_xcom({"host": host, **{k: v for k, v in answer.items() if k in named},
                              "evidence": {k: v for k, v in answer.items() if k not in named and k != "host"}})

    def entry(self) -> dict[str, Any]:
        """The flat host entry of release.json: the named fields with the evidence beside them."""
        named = {name: value for name, value in self.to_xcom().items() if name != "evidence"}
        return {**self.evidence, **named}


@dataclass(frozen=True)
class ReleaseResult(Document):
    """A backend's release of a run (`Backend.release`): every host it runs workers on, and whether all of them
    are proven released (no survivor, no host left unasked, the GPUs checked free)."""

    backend: str
    hosts: tuple[HostRelease, ...]
    clean: bool


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

    def abort(self) -> None:
        """Stop the worker because another rank failed (protocol.ABORT_SIGNAL, wherever it runs): it ends at once
        unless it is writing a checkpoint. Returns at once. A backend that cannot send that signal terminates."""
        self.terminate()

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

    def label(self) -> str:
        """How log lines name this worker: "rank 2" here, "rank 2 host h" or "rank 2 pod p" elsewhere."""
        return f"rank {self.rank}"


class Backend(ABC):
    """Where a group's workers run: places ranks, builds their command, starts them, and ends what a run left."""

    name: ClassVar[str]

    def capacity(self, group: GroupSpec) -> Capacity:
        """How many of `group`'s workers could be placed now (asked before an elastic launch, which then places
        at most that many); the default, for a backend that places or fails by itself, is all of them."""
        return Capacity(group.num_workers)

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

    def check_slots_free(self, group: GroupSpec, workers: Sequence[WorkerOutcome]) -> dict[str, Any]:
        """Right after `group` exited (every rank ended, `end_group` done): evidence, bounded in time, that the slots
        its `workers` held (GPUs; on CPU a slot is a host and a rank) are free, so they are known released as soon as
        training ends and not only at the run's release. Returns {"checked", "free", "free_after_s" (seconds the
        check took to prove it; None when not proven), ...}. This default checks nothing: the run's release checks
        this backend's hosts."""
        return {"checked": False, "free": None, "free_after_s": None,
                "note": f"the {self.name} backend proves its slots free at the run's release only"}

    def utilization(self, group: GroupSpec, workers: Sequence[WorkerOutcome]) -> dict[int, float | None] | None:
        """Each rank's GPU utilization (%) now, for the idle-held warning (launcher/idle.py); None where this backend
        cannot sample it (the default): missing samples count as busy."""
        return None

    @abstractmethod
    def end_earlier_attempts(self, group: GroupSpec) -> list[HostRelease]:
        """End what an earlier attempt of the same group of the same run left alive, wherever this backend runs
        workers (found by the run key and the group's name, not by records: the attempt that left them may have
        died before writing one). Called before the group launches. Returns one entry per host, as `release` does
        (`error` set for a host that could not be asked)."""

    @abstractmethod
    def release(self, run_key: str, records: Sequence[StateRecord], grace_s: float = RELEASE_GRACE_S) -> ReleaseResult:
        """End whatever is left of run `run_key` wherever this backend runs workers (SIGTERM, `grace_s`, SIGKILL);
        `records` are all the run's state records (read and checked), each backend uses what is its own. A host
        that cannot be reached is reported (`HostRelease.error`), never skipped, and makes the release unclean."""

    def close(self) -> None:
        """Release connections; the backend is not used afterwards."""


# What builds a backend from the run's `core.config.RunConfig` (its own, or the one named by the optional second
# argument). The Airflow side owns the one implementation (`tf_multiworker.backends.make_backend`: it resolves
# connections); a DAG task hands it to the task logic that launches or releases workers, so nothing below the glue
# imports the glue.
BackendFactory = Callable[..., Backend]
