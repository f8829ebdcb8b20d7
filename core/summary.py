"""The chief's training summary (summary.json, trainer/outputs.py writes it last) as its readers take it.

summary.json comes back from storage, which whoever may write the run's storage could edit: reading one checks
every field it models (core/document.py's `read_fields`) and refuses a missing or mistyped one, naming the file and
the field. Keys it does not model (the scaling advisor's parameter counts, the config) are left to their own
readers; fields added after the first summaries default to what those summaries meant (absent: unknown).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from core.document import DocumentError, OpenDocument, read_fields


class SummaryError(ValueError):
    """A summary.json that is not one: not an object, or a missing or mistyped field."""


@dataclasses.dataclass(frozen=True)
class MemoryFigures(OpenDocument):
    """One worker's memory: the forecast by kind (trainer/memory_forecast.py, MiB: weights, gradients, optimizer,
    activations, logits, total) beside what rank 0 measured: TensorFlow's peak on its GPU, or without one the
    process's peak resident memory (which also holds TensorFlow itself)."""

    forecast_mb: dict[str, float]
    gpu_mem_peak_mb: float | None = None
    peak_rss_mb: float | None = None


@dataclasses.dataclass(frozen=True)
class TrainSummary:
    """What a training job reports of itself (docs/CONTRACTS.md, "Worker entry points").

    Attributes:
        num_workers, global_batch_size, steps, tokens_seen: the work done (`steps`: the last step reached).
        wall_time_s: the job's wall time; train_time_s: its timed steps' time (no start-up, no first step).
        tokens_per_s, final_loss: None when no step was timed, or no loss logged.
        mfu: model FLOPs utilisation; None without a known peak (CPU).
        resumed_from_step: the checkpoint's step it resumed from; steps_timed: the steps `train_time_s` timed
            (None in summaries before it: then `steps` - `resumed_from_step`).
        gpu_mem_reserved_mb, gpu_mem_peak_mb: rank 0's GPU memory at its last step; None on CPU.
        hardware, versions: where and with what it ran; allreduce: what the gradients' all-reduce became.
        memory: the memory forecast beside the measured peak (None in summaries before it).
        started_at, finished_at: UTC timestamps.
    """

    num_workers: int
    global_batch_size: int
    steps: int
    tokens_seen: int
    wall_time_s: float
    train_time_s: float
    tokens_per_s: float | None
    final_loss: float | None
    mfu: float | None = None
    resumed_from_step: int | None = None
    steps_timed: int | None = None
    allreduce: dict[str, Any] | None = None
    gpu_mem_reserved_mb: float | None = None
    gpu_mem_peak_mb: float | None = None
    memory: MemoryFigures | None = None
    hardware: dict[str, Any] | None = dataclasses.field(default_factory=dict)
    versions: dict[str, Any] | None = dataclasses.field(default_factory=dict)
    started_at: str | None = None
    finished_at: str | None = None

    @classmethod
    def from_json(cls, value: Any, source: str) -> TrainSummary:
        """The summary `value` (read from `source`) holds; SummaryError naming the file and the field otherwise."""
        try:
            fields, _others = read_fields(cls, value)  # the keys it does not model: their own readers check them
        except DocumentError as error:
            raise SummaryError(f"{source}: {error.brief}{error.shown}: not a training summary; train the run again "
                               "(trigger with baseline='run' for a baseline).") from error
        return cls(**fields)

    @property
    def seconds_per_step(self) -> float | None:
        """Training seconds per timed step; None when the job timed no step (it resumed at its last step)."""
        timed = self.steps_timed if self.steps_timed is not None else self.steps - (self.resumed_from_step or 0)
        return self.train_time_s / timed if timed and self.train_time_s > 0 else None
