"""A worker group's run-state record, `runs/<key>/state/<group>.json` (docs/CONTRACTS.md): what every launch writes
from the moment its ranks start to the end, and what release reads back to find them. Storage is untrusted input
(docs/security.md), so a record is read as the typed document below: a record that is not one is refused, naming
the file and the field, and acted on nowhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.document import OpenDocument


@dataclass(frozen=True)
class SlotsCheck(OpenDocument):
    """A record's `after_exit`: the backend's proof, right after the group exited, that the slots it held are free
    (`Backend.check_slots_free`), and `release_after_train_s`, seconds from the exit to that proof (None when not
    proven then). `evidence`: the backend's own keys beside them (`slots`, `hosts`, `gpu_check`, `note`...,
    docs/CONTRACTS.md), kept as it answered them."""

    checked: bool
    free: bool | None = None
    free_after_s: float | None = None
    release_after_train_s: float | None = None

    @classmethod
    def failed(cls, note: str) -> SlotsCheck:
        """A check that could not be made, and why."""
        return cls(False, extra={"note": note})

    @property
    def evidence(self) -> Mapping[str, Any]:
        return self.extra

    @property
    def proven(self) -> bool:
        return self.free is True and self.free_after_s is not None


@dataclass(frozen=True)
class RecordedWorker(OpenDocument):
    """One rank of a record: `rank`, `host`, `port`, `gpus` (the devices it was placed on; empty on CPU, None in a
    record that does not say), `gpu_idle_mb` (each of those GPUs' idle level at placement: its name -> MiB in use
    with no process on it, which release waits for; None or a GPU missing: release judges it as never seen idle) and,
    beside them, the backend's handle record (`WorkerHandle.record()`: `pid` and `pgid` locally, `conn_id`,
    `remote_pid` and `remote_pgid` over SSH, `namespace`, `pod` and `node` on Kubernetes)."""

    rank: int
    host: str
    port: int | None
    gpus: tuple[int | str, ...] | None = None
    gpu_idle_mb: dict[str, int] | None = None

    def handle_id(self, name: str) -> int | None:
        """The handle record's integer `name` (a pid or a process group); None when it holds none."""
        value = self.extra.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class StateRecord(OpenDocument):
    """A group's run-state record: written by every launch (`to_json()`) and pushed to XCom by the operator.

    Attributes:
        task_id: the group's name; backend: the backend running it; state: running, succeeded, failed or stopped.
        updated_at: UTC ISO; workdir: the launcher's work directory on its host (removed at the end; release removes
            it when the task died first); launcher: that host's identity (launcher/host_identity.py; empty in a
            record that names none, which release reports unverified).
        workers: the ranks, each with its backend's handle record.
        after_exit: the slots' check once the group exited; None while it runs, and for a killed task.
    """

    task_id: str
    backend: str
    state: str
    updated_at: str
    workdir: str
    launcher: dict[str, str] = field(default_factory=dict)
    workers: tuple[RecordedWorker, ...] = ()
    after_exit: SlotsCheck | None = None
