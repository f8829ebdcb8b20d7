"""release.json's `usage`: the ledger (tasks/ledger/usage.py) in hours, shares and cost, with what release adds (the
attempts, the admission waits, the live idle-held warnings, the advisor's cheapest count and the warnings).

`UsageSummary.to_xcom()` is what release.json keeps (docs/CONTRACTS.md, "GPU-time ledger"); the report's views read
it from there. Cost is null without a price, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.document import Document
from tasks.ledger.pricing import Price
from tasks.ledger.usage import Book, IdleWarning


@dataclass(frozen=True)
class SlotRow(Document):
    """One slot's hours (`per_slot`): held, busy, idle, waited for admission (left out of held), and its longest
    stretch without step progress (seconds) with that stretch's largest cause."""

    slot: str
    held_h: float
    busy_h: float
    idle_h: float
    longest_idle_s: float
    longest_idle_cause: str | None
    waited_h: float


@dataclass(frozen=True)
class SlotCauses(Document):
    """One slot's held hours by cause, `busy` first (`per_slot_by_cause`, the chart's bars)."""

    slot: str
    hours: dict[str, float]


@dataclass(frozen=True)
class UsagePrice(Document):
    """The run's frozen price as it priced the run: the rate for its accelerator, and `note` when the table's
    default stood in for an accelerator it does not name."""

    currency: str
    capacity: str
    unit: str
    source: str
    rate: float
    note: str | None


@dataclass(frozen=True)
class Cost(Document):
    """held x rate, busy x rate, held cost per million tokens trained, and the extra cost of parallelism."""

    held: float
    busy: float
    per_mtoken: float | None
    extra_for_parallelism: float | None


@dataclass(frozen=True)
class AttemptRow(Document):
    """A group attempt of the run: its group, attempt, Airflow try, end state and worker count."""

    group: str
    attempt: int
    try_number: str | None
    state: str
    workers: int


@dataclass(frozen=True)
class AdmissionRow(Document):
    """An admitted try of a GPU task: scheduled -> queued (`waited_s`, not charged), queued -> started."""

    task_id: str
    try_number: int
    map_index: int
    waited_s: float
    queued_s: float | None


@dataclass(frozen=True)
class LiveWarning(Document):
    """A live idle-held warning with the group attempt that raised it (flat in release.json)."""

    group: str
    attempt: int
    warning: IdleWarning

    def to_xcom(self) -> dict[str, Any]:
        return {"group": self.group, "attempt": self.attempt, **self.warning.to_xcom()}


@dataclass(frozen=True)
class UsageSummary(Document):
    """release.json's `usage` (docs/CONTRACTS.md, "GPU-time ledger"). `summarize` fills the ledger's figures; the
    fields from `attempts` on are release's (tasks/ledger/record.py), empty or None until it sets them.

    Attributes:
        unit: gpu_hour, or worker_hour on CPU runs; slots: how many slots the run held.
        held_gpu_h, busy_gpu_h, idle_gpu_h, idle_by_cause_gpu_h: the run's hours (`tasks.ledger.usage.CAUSES`).
        busy_share: busy / held (None when nothing was held); time_to_release_s: last exit to release's proof;
            clock_skew_s: how far release's clock was behind the last exit.
        per_slot, per_slot_by_cause: each slot's hours; waited_gpu_h: slot hours left out of held as admission waits.
        efficiency: the measured scaling efficiency; gpu_h_per_token_vs_one_worker: 1 / efficiency.
        price, cost: None without a price.
        attempts, workers: the run's group attempts and its distributed worker count.
        waited_s, waited_note: the GPU tasks' admission waits (None, with the note saying why, when not read);
            admission: each admitted try.
        idle_warnings: the live idle-held warnings; cheapest_workers: the advisor's cheapest count (priced runs);
            warnings: the run's GPU-time warnings.
        reclaims: the groups stopped for holding their slots idle (`reclaim_idle_after_s`), each with its text;
            reclaimed_gpu_h: the slot-hours those groups had held without step progress when they were stopped.
    """

    unit: str
    slots: int
    held_gpu_h: float
    busy_gpu_h: float
    idle_gpu_h: float
    idle_by_cause_gpu_h: dict[str, float]
    busy_share: float | None
    time_to_release_s: float | None
    clock_skew_s: float
    per_slot: tuple[SlotRow, ...]
    per_slot_by_cause: tuple[SlotCauses, ...]
    waited_gpu_h: float
    efficiency: float | None
    gpu_h_per_token_vs_one_worker: float | None
    price: UsagePrice | None
    cost: Cost | None
    attempts: tuple[AttemptRow, ...] = ()
    workers: int | None = None
    waited_s: float | None = None
    waited_note: str | None = None
    admission: tuple[AdmissionRow, ...] = ()
    idle_warnings: tuple[LiveWarning, ...] = ()
    cheapest_workers: int | None = None
    warnings: tuple[str, ...] = ()
    reclaims: tuple[LiveWarning, ...] = ()
    reclaimed_gpu_h: float = 0.0

    @property
    def unit_name(self) -> str:
        return "GPU" if self.unit == "gpu_hour" else "worker"


def _hours(seconds: float) -> float:
    return round(seconds / 3600.0, 6)


def summarize(book: Book, *, price: Price | None, accelerator: str | None = None,
              tokens: int | None = None, efficiency: float | None = None) -> UsageSummary:
    """The ledger's figures: hours, shares, and the cost when the run has a price (else null, never 0). `tokens`: the
    tokens trained (for the cost per million); `efficiency`: the measured scaling efficiency, whence the extra cost
    of parallelism, busy cost x (1 - E)."""
    held, busy = book.held_s, book.busy_s
    rate, note = price.rate_for(accelerator) if price else (None, None)
    cost = None
    if rate is not None:
        held_cost, busy_cost = held / 3600.0 * rate, busy / 3600.0 * rate
        cost = Cost(held=round(held_cost, 6), busy=round(busy_cost, 6),
                    per_mtoken=round(held_cost / tokens * 1e6, 6) if tokens else None,
                    extra_for_parallelism=round(busy_cost * (1 - efficiency), 6) if efficiency is not None else None)
    return UsageSummary(
        unit=price.unit if price else ("gpu_hour" if any("/gpu" in s for s in book.slots) else "worker_hour"),
        slots=len(book.slots),
        held_gpu_h=_hours(held), busy_gpu_h=_hours(busy), idle_gpu_h=_hours(book.idle_s),
        idle_by_cause_gpu_h={cause: _hours(s) for cause, s in book.idle_by_cause_s.items()},
        busy_share=round(busy / held, 4) if held else None,
        time_to_release_s=round(book.time_to_release_s, 3) if book.time_to_release_s is not None else None,
        clock_skew_s=round(book.clock_skew_s, 3),
        per_slot=tuple(SlotRow(slot=slot, held_h=_hours(s.held_s), busy_h=_hours(s.busy_s), idle_h=_hours(s.idle_s),
                               longest_idle_s=round(s.longest_idle_s, 3), longest_idle_cause=s.longest_idle_cause,
                               waited_h=round(s.waited_s / 3600, 6)) for slot, s in book.slots.items()),
        per_slot_by_cause=tuple(SlotCauses(slot, {"busy": s.busy_s / 3600,
                                                  **{c: v / 3600 for c, v in s.idle_by_cause_s.items()}})
                                for slot, s in book.slots.items()),
        waited_gpu_h=round(book.waited_s / 3600, 6),
        efficiency=efficiency,
        gpu_h_per_token_vs_one_worker=round(1 / efficiency, 3) if efficiency else None,
        price=None if price is None or rate is None else UsagePrice(price.currency, price.capacity, price.unit,
                                                                     price.source, rate, note),
        cost=cost,
    )
