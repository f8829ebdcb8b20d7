"""The GPU-time ledger of a run: the launch path's events as documents, and pure functions over them (no I/O;
`tasks/ledger/record.py` reads and writes).

A slot is what a run holds: a GPU (host, device), or on a CPU run a worker place (host, rank). An attempt of a
group (`kind` train, baseline, preflight, evaluate) has per rank the events `launch`, `ready` and `exit`
(`AttemptEvents`, its file), to which release adds `first_step_end`, `last_step_end` and `redone_after`
(`Timeline`), all seconds on the launcher's clock (a group's events share one clock).

- held(g) = from the first launch on g to `released_at` (release's proof that it is free);
- busy(g) = the timed training steps on g (first step end -> last step end of train and baseline attempts), less
  the steps an attempt trained past the next attempt's resume point (`redone_after` -> last step end: redone);
- idle(g) = held(g) - busy(g), split into exactly one cause per second: each second of the held window takes the
  highest-ranked label of the segments covering it (`PRIORITY`); a second no segment covers is `between_tasks`
  before the slot's last exit and `release` after it.

When `released_at` comes before a worker's exit (release ran on another host whose clock is behind), the window
ends at the last exit instead and `clock_skew_s` says by how much.

Time a GPU task of the run waited for admission (`not_held`: Airflow's scheduled -> queued of each try,
tasks/ledger/airflow_api.py) is not held: no slot was the run's then. A second of a slot's window that no segment
covers, before its last exit (between tasks), and that lies in such a wait, is `waited`: left out of held (and so of
idle and every cause) and counted apart, costing nothing. Waits outside the window (before the first launch) are
outside held anyway; a second is never both waited and held.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from core.document import Document

CAUSES = ("between_tasks", "startup", "stragglers", "preflight", "compile", "redone", "evaluation", "export",
          "release", "other")
# Where segments overlap (groups of different launcher clocks, a rank's events out of order), the first listed wins.
PRIORITY = ("busy", "redone", "compile", "export", "preflight", "evaluation", "stragglers", "startup", "other")
AFTER_READY = {"preflight": "preflight", "evaluate": "evaluation"}  # kinds without steps: what follows the join
STEP_KINDS = ("train", "baseline")


def task_of(group: str) -> str:
    """The Airflow task that launched a group, which is also its kind here: its own name, or evaluate for each
    `evaluate-<model>` group."""
    return "evaluate" if group.startswith("evaluate") else group


def slots_of(host: str | None, rank: int, gpus: Sequence[int | str]) -> list[str]:
    """The slots a rank held: its GPUs on its host, or (host, rank) when it had none."""
    host = host or "localhost"
    return [f"{host}/gpu{g}" for g in gpus] if gpus else [f"{host}/rank{rank}"]


@dataclass(frozen=True)
class RankEvents(Document):
    """One rank of a group attempt, seconds on the launcher's clock (an attempt file's `ranks`).

    Attributes:
        rank, host, gpus: which rank ran where, on which devices (none on CPU).
        launch: its start; exit: its end (the group's, when the launcher saw it end); exit_code: None when unknown.
        ready: when its READY marker was seen; None (absent in the file) when it never joined.
    """

    rank: int
    host: str | None
    gpus: tuple[int | str, ...]
    launch: float
    exit: float
    exit_code: int | None
    ready: float | None = None

    @property
    def slots(self) -> list[str]:
        return slots_of(self.host, self.rank, self.gpus)

    def to_xcom(self) -> dict[str, Any]:
        plain = super().to_xcom()
        return plain if self.ready is not None else {k: v for k, v in plain.items() if k != "ready"}


def last_join(ranks: Iterable[RankEvents]) -> float | None:
    """When the last of these ranks joined (READY); None when one never did."""
    readies = [rank.ready for rank in ranks]
    return None if not readies or None in readies else max(ready for ready in readies if ready is not None)


@dataclass(frozen=True)
class IdleWarning(Document):
    """A live idle-held warning, or the reclaim of a group held idle (tasks/launch.py, launcher/idle.py), as its
    attempt file keeps it.

    Attributes:
        at: when it was raised (UTC ISO); ranks, slots: the ranks past the limit and the slots they held.
        idle_s: how long they had made no step progress; phase: each one's phase by rank (`"after step 2"`).
        peak_util_pct: each one's highest GPU utilization in the window by rank; None on a CPU run.
        text: the warning as logged and mailed.
    """

    at: str
    ranks: tuple[int, ...]
    slots: tuple[str, ...]
    idle_s: float
    phase: dict[str, str]
    peak_util_pct: dict[str, float] | None
    text: str


@dataclass(frozen=True)
class AttemptEvents(Document):
    """One group attempt as the launch path recorded it: `runs/<key>/usage/<group>-<launch time>-a<attempt>.json`
    (tasks/launch.py writes it once, tasks/ledger/record.py reads it back).

    Attributes:
        group: the group's name (a task id, or `evaluate-<model>`); backend: the backend that ran it.
        attempt: the launch attempt within the task (a relaunch on new ports is the next); try_number: Airflow's
            try of the task (`AIRFLOW_CTX_TRY_NUMBER`), None outside Airflow.
        state: succeeded, failed, stopped or relaunched; ranks: each rank's events.
        idle_warnings: the live idle-held warnings of the attempt (none: absent in files before them).
        reclaimed: the reclaim that stopped the attempt as idle (`reclaim_idle_after_s`), or None (absent then).
    """

    group: str
    backend: str
    attempt: int
    try_number: str | None
    state: str
    ranks: tuple[RankEvents, ...]
    idle_warnings: tuple[IdleWarning, ...] = ()
    reclaimed: IdleWarning | None = None

    @property
    def kind(self) -> str:
        return task_of(self.group)

    @property
    def joined(self) -> float | None:
        return last_join(self.ranks)

    def to_xcom(self) -> dict[str, Any]:
        plain = super().to_xcom()
        absent = {name for name in ("idle_warnings", "reclaimed") if not getattr(self, name)}
        return {k: v for k, v in plain.items() if k not in absent}


@dataclass(frozen=True)
class RankTimeline:
    """What the ledger splits of one rank: its events and, for train and baseline, its steps (tasks/ledger/record.py
    `add_steps`): first and last step end, and `redone_after`, from where its steps were redone by the next attempt."""

    events: RankEvents
    first_step_end: float | None = None
    last_step_end: float | None = None
    redone_after: float | None = None


@dataclass(frozen=True)
class Timeline:
    """One attempt for the ledger: its kind (train, baseline, preflight, evaluate) and its ranks."""

    kind: str
    ranks: tuple[RankTimeline, ...]

    @classmethod
    def of(cls, attempt: AttemptEvents) -> Timeline:
        """An attempt without steps (preflight, evaluate; a train attempt before its steps are placed)."""
        return cls(attempt.kind, tuple(RankTimeline(rank) for rank in attempt.ranks))


def _segments_of_rank(kind: str, timeline: RankTimeline,
                      group_ready: float | None) -> list[tuple[float, float, str]]:
    """(start, end, label) of one rank of one attempt."""
    rank = timeline.events
    launch, ready, end = rank.launch, rank.ready, rank.exit
    if ready is None:  # never joined: all of it was start-up
        return [(launch, end, "startup")]
    joined = group_ready if group_ready is not None else end  # a peer that never joined kept this one waiting
    out = [(launch, ready, "startup"), (ready, joined, "stragglers")]
    if kind in AFTER_READY:
        return [*out, (joined, end, AFTER_READY[kind])]
    if kind not in STEP_KINDS:
        return [*out, (joined, end, "other")]
    first, last = timeline.first_step_end, timeline.last_step_end
    if first is None or last is None:  # ended before its first step
        return [*out, (joined, end, "compile")]
    redone = timeline.redone_after
    kept_until = last if redone is None else max(first, min(redone, last))
    return [*out, (joined, first, "compile"), (first, kept_until, "busy"), (kept_until, last, "redone"),
            (last, end, "export")]


def segments_by_slot(timelines: Iterable[Timeline]) -> dict[str, list[tuple[float, float, str]]]:
    by_slot: dict[str, list[tuple[float, float, str]]] = {}
    for timeline in timelines:
        group_ready = last_join(rank.events for rank in timeline.ranks)
        for rank in timeline.ranks:
            for slot in rank.events.slots:
                by_slot.setdefault(slot, []).extend(_segments_of_rank(timeline.kind, rank, group_ready))
    return by_slot


def _label_at(segments: Sequence[tuple[float, float, str]], a: float, b: float) -> str | None:
    covering = {label for start, end, label in segments if start <= a and end >= b and end > start}
    return next((label for label in PRIORITY if label in covering), None)


def _waiting(not_held: Sequence[tuple[float, float]], a: float, b: float) -> bool:
    return any(start <= a and end >= b for start, end in not_held)


@dataclass(frozen=True)
class SlotBook:
    """One slot's ledger, in seconds: held = busy + idle, idle split by cause (`CAUSES`, each second once);
    `waited_s`: seconds between tasks that lay in an admission wait, left out of held; `held_from` its first launch,
    `last_exit` its last; `longest_idle_s` the longest stretch without step progress and its largest cause."""

    held_s: float
    busy_s: float
    idle_s: float
    idle_by_cause_s: dict[str, float]
    waited_s: float
    held_from: float
    last_exit: float
    time_to_release_s: float
    longest_idle_s: float
    longest_idle_cause: str | None


@dataclass(frozen=True)
class Book:
    """The run's ledger: its slots' sums (seconds), each slot's own, time to release (last exit of any worker to
    release's proof; None without a slot) and the clock skew when release's clock is behind the last exit."""

    held_s: float
    busy_s: float
    idle_s: float
    idle_by_cause_s: dict[str, float]
    waited_s: float
    slots: dict[str, SlotBook]
    time_to_release_s: float | None
    clock_skew_s: float


def slot_ledger(segments: Sequence[tuple[float, float, str]], released_at: float,
                not_held: Sequence[tuple[float, float]] = ()) -> SlotBook:
    """held, busy, idle and idle by cause (seconds) of one slot, from its segments and the release time; `waited_s`:
    the seconds between tasks that lay in an admission wait (`not_held`), left out of held."""
    held_from = min(start for start, _, _ in segments)
    last_exit = max(end for _, end, _ in segments)
    held_until = max(released_at, last_exit)
    edges = [p for s in segments for p in s[:2]] + [p for w in not_held for p in w]
    points = sorted({held_from, held_until, *(p for p in edges if held_from < p < held_until)})
    seconds = dict.fromkeys(("busy", *CAUSES, "waited"), 0.0)
    stretch: dict[str, float] = {}  # the current stretch without step progress, by cause
    longest: dict[str, float] = {}
    for a, b in itertools.pairwise(points):
        label = _label_at(segments, a, b) or ("release" if b > last_exit else
                                              "waited" if _waiting(not_held, a, b) else "between_tasks")
        seconds[label] += b - a
        if label == "waited":
            continue
        stretch = {} if label == "busy" else {**stretch, label: stretch.get(label, 0.0) + b - a}
        if sum(stretch.values()) > sum(longest.values()):
            longest = dict(stretch)
    waited = seconds.pop("waited")
    held = held_until - held_from - waited
    busy = seconds.pop("busy")
    return SlotBook(held_s=held, busy_s=busy, idle_s=held - busy, idle_by_cause_s=seconds, waited_s=waited,
                    held_from=held_from, last_exit=last_exit, time_to_release_s=max(0.0, released_at - last_exit),
                    longest_idle_s=sum(longest.values()),
                    longest_idle_cause=max(longest, key=longest.__getitem__) if longest else None)


def ledger(timelines: Sequence[Timeline], released_at: float,
           not_held: Sequence[tuple[float, float]] = ()) -> Book:
    """The run's ledger (`Book`). `not_held`: the run's admission waits (start, end), see the module doc."""
    slots = {slot: slot_ledger(segments, released_at, not_held)
             for slot, segments in sorted(segments_by_slot(timelines).items())}
    if not slots:
        return Book(held_s=0.0, busy_s=0.0, idle_s=0.0, idle_by_cause_s=dict.fromkeys(CAUSES, 0.0), waited_s=0.0,
                    slots={}, time_to_release_s=None, clock_skew_s=0.0)
    last_exit = max(s.last_exit for s in slots.values())
    return Book(
        held_s=sum(s.held_s for s in slots.values()),
        busy_s=sum(s.busy_s for s in slots.values()),
        idle_s=sum(s.idle_s for s in slots.values()),
        idle_by_cause_s={c: sum(s.idle_by_cause_s[c] for s in slots.values()) for c in CAUSES},
        waited_s=sum(s.waited_s for s in slots.values()),
        slots=slots,
        time_to_release_s=max(0.0, released_at - last_exit),
        clock_skew_s=max(0.0, last_exit - released_at),
    )
