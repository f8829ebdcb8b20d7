"""Held without step progress: the live check behind the idle-held warning (issue 40, item 4).

A running group's rank is idle once it made no step progress for `max_idle_s` (since its launch, or its last new
step) and, on GPU runs, every NVML utilization sample of its GPU over that window is below `util_below_pct` (as
dstack's idle rule: one busy sample is activity; a collective that spins keeps a stalled GPU busy, so this can only
hold a warning back, never raise a false one). Missing or too few samples (no NVML, a backend that cannot sample, a
GPU that refuses the query) count as busy: a warning needs evidence (skypilot#10628, dstack#2384). One episode per
stall of the group: the first poll that finds idle ranks calls `on_idle` once; the episode ends when every rank is
within `max_idle_s` of progress again.

It complements `hang_timeout_s`, which fails a group that prints nothing: this one catches a group that talks but
does not train, and never fails or slows it by itself. With `reclaim_after_s` (at least `max_idle_s`) it also calls
`on_reclaim` once per attempt when every rank has been idle, by the same rule, that long: the caller stops the group.
The launcher only calls these; what a warning or a reclaim does (log, count, record, mail, stop) is the caller's
(tasks/launch.py). Utilization is sampled on a thread of its own, so a slow sampler
(NVML, a remote host) never holds up the group's watch loop.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

MIN_SAMPLES = 3  # fewer utilization samples of a rank within the window: no evidence, the rank counts as busy
MAX_SAMPLE_EVERY_S = 30.0

Sampler = Callable[[], Mapping[int, float | None]]  # rank -> GPU utilization % now (None: not measured)


@dataclass(frozen=True)
class IdleEpisode:
    """What one warning says: the attempt, the ranks idle when it fired, how long the longest went without progress,
    where each stood (`phase`), their highest utilization sample in the window (GPU runs), and when (wall clock, s)."""

    attempt: int
    ranks: tuple[int, ...]
    idle_s: float
    phase: dict[int, str]
    peak_util_pct: dict[int, float] | None
    at: float


@dataclass
class _Rank:
    since: float  # launch or last new step (monotonic)
    ready: bool = False
    step: int | None = None


@dataclass(frozen=True)
class IdleRules:
    """When a group's ranks count as idle-held. `max_idle_s` > 0 (a launch without the warning has no watch);
    `util_below_pct` None: a CPU run, progress alone decides; `sample_every_s` 0: a tenth of `max_idle_s`, within
    [1, MAX_SAMPLE_EVERY_S]; `reclaim_after_s` 0: never reclaim, else at least `max_idle_s`."""

    max_idle_s: float
    util_below_pct: float | None = None
    sample_every_s: float = 0.0
    reclaim_after_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_idle_s <= 0:
            raise ValueError(f"an idle-held watch needs max_idle_s > 0, got {self.max_idle_s}")
        if self.reclaim_after_s and self.reclaim_after_s < self.max_idle_s:
            raise ValueError(f"reclaim_idle_after_s = {self.reclaim_after_s:g} must be at least the watch's window "
                             f"max_idle_held_s = {self.max_idle_s:g}")


class IdleWatch:
    """See the module doc, and `IdleRules`; `step_of(line)`: the step a worker line reports (None for other lines);
    the caller knows the line format, the launcher does not."""

    def __init__(self, rules: IdleRules, step_of: Callable[[str], int | None], on_idle: Callable[[IdleEpisode], None],
                 *, on_reclaim: Callable[[IdleEpisode], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        if rules.reclaim_after_s and on_reclaim is None:
            raise ValueError(f"reclaim_idle_after_s = {rules.reclaim_after_s:g} needs an on_reclaim to stop the group")
        self.max_idle_s, self.step_of, self.on_idle = rules.max_idle_s, step_of, on_idle
        self.reclaim_after_s, self.on_reclaim = rules.reclaim_after_s, on_reclaim
        self.util_below_pct, self.sample_every_s = rules.util_below_pct, rules.sample_every_s
        self.clock, self.wall = clock, wall
        self._reclaimed = False  # on_reclaim was called for this attempt
        self.group, self.attempt = "", 0
        self._ranks: dict[int, _Rank] = {}
        self._samples: collections.deque = collections.deque(maxlen=4096)  # (monotonic time, {rank: util %})
        self._open = False  # an episode is open: no second warning until every rank made progress again
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._sample: Sampler | None = None
        self._sample_failed = False  # said once per watch

    def start(self, group: str, attempt: int, ranks: Iterable[int], sample: Sampler | None = None) -> None:
        """A launch attempt's ranks started now; `sample` reads their GPUs' utilization (GPU runs)."""
        self.stop()
        now = self.clock()
        with self._lock:
            self.group, self.attempt, self._open, self._reclaimed = group, attempt, False, False
            self._ranks = {rank: _Rank(now) for rank in ranks}
            self._samples.clear()
        self._sample = sample if self.util_below_pct is not None else None
        if self._sample is not None:
            self._stop = threading.Event()
            every = self.sample_every_s or min(MAX_SAMPLE_EVERY_S, max(1.0, self.max_idle_s / 10))
            self._sampler = threading.Thread(target=self._sample_loop, args=(every, self._stop), daemon=True,
                                             name=f"{group}-utilization")
            self._sampler.start()

    def stop(self) -> None:
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(1.0)  # a sampler stuck in NVML or SSH is a daemon: never waited for longer
            self._sampler = None

    def line(self, rank: int, line: str, *, ready: bool = False) -> None:
        """A worker line (any thread): a step above the rank's last is progress; `ready`: its ready marker."""
        step = self.step_of(line)
        with self._lock:
            state = self._ranks.get(rank)
            if state is None:
                return
            state.ready = state.ready or ready
            if step is not None and (state.step is None or step > state.step):
                state.step, state.since = step, self.clock()

    def poll(self) -> None:
        """Called by the group's watch loop: fires `on_idle` once per episode, then `on_reclaim` once per attempt
        (when set and due); never raises."""
        with self._lock:
            now = self.clock()
            episode, reclaim = self._new_episode(now), self._reclaim_due(now)
        for callback, due, what in ((self.on_idle, episode, "idle-held warning"),
                                    (self.on_reclaim, reclaim, "reclaim of idle GPUs")):
            if due is None or callback is None:
                continue
            try:
                callback(due)
            except Exception:  # a warning must never end the group it watches; a reclaim ends it by its own call
                log.exception("the %s of %s could not be handled", what, self.group)

    def _reclaim_due(self, now: float) -> IdleEpisode | None:
        """Every rank idle for `reclaim_after_s`, by the warning's rule (under the lock): the one reclaim."""
        if not self.reclaim_after_s or self._reclaimed or not self._ranks:
            return None
        since = {rank: now - state.since for rank, state in self._ranks.items()}
        if min(since.values()) < self.reclaim_after_s:
            return None
        peaks = self._peaks(since, now)
        if peaks is not None and any(peak is None or peak >= self.util_below_pct for peak in peaks.values()):
            return None
        self._reclaimed = True
        ranks = tuple(sorted(since))
        return IdleEpisode(self.attempt, ranks, round(min(since.values()), 3),
                           {rank: self._phase(self._ranks[rank]) for rank in ranks}, peaks, self.wall())

    def _new_episode(self, now: float) -> IdleEpisode | None:
        """The episode that starts now, if one does (under the lock)."""
        since = {rank: now - state.since for rank, state in self._ranks.items()}
        stalled = {rank: seconds for rank, seconds in since.items() if seconds > self.max_idle_s}
        if not stalled:
            self._open = False
            return None
        if self._open:
            return None
        peaks = self._peaks(stalled, now)
        idle = sorted(rank for rank in stalled if peaks is None or (
            peaks.get(rank) is not None and peaks[rank] < self.util_below_pct))
        if not idle:
            return None
        self._open = True
        return IdleEpisode(self.attempt, tuple(idle), round(max(stalled[rank] for rank in idle), 3),
                           {rank: self._phase(self._ranks[rank]) for rank in idle},
                           None if peaks is None else {rank: peaks[rank] for rank in idle}, self.wall())

    def _peaks(self, ranks: Iterable[int], now: float) -> dict[int, float | None] | None:
        """Each rank's highest utilization sample in the window (None: too few samples); None on a CPU run."""
        if self.util_below_pct is None:
            return None
        peaks: dict[int, float | None] = {}
        for rank in ranks:
            values = [values[rank] for at, values in self._samples
                      if at >= now - self.max_idle_s and values.get(rank) is not None]
            peaks[rank] = max(values) if len(values) >= MIN_SAMPLES else None
        return peaks

    @staticmethod
    def _phase(state: _Rank) -> str:
        if not state.ready:
            return "waiting to join the group"
        if state.step is None:
            return "joined, before its first step (tracing and compiling, or a group that takes no steps)"
        return f"after step {state.step}"

    def take_sample(self) -> bool:
        """One utilization sample of the ranks' GPUs (the sampler thread's step); False when none was taken."""
        if self._sample is None:
            return False
        try:
            values = dict(self._sample())
        except Exception as error:  # noqa: BLE001 - no sample is "busy", never a failure
            if not self._sample_failed:
                log.info("no GPU utilization samples for %s (%s: %s): its ranks count as busy", self.group,
                         type(error).__name__, error)
            self._sample_failed = True
            return False
        with self._lock:
            self._samples.append((self.clock(), values))
        return True

    def _sample_loop(self, every_s: float, stop: threading.Event) -> None:
        while not stop.wait(every_s):
            self.take_sample()
