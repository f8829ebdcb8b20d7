"""The live idle-held check (launcher/idle.py) on a fake clock, with utilization sampled through the local backend
from the fake NVML (tests/support/fake_nvml.py): progress alone on CPU runs, every sample below the threshold on GPU
runs, missing samples as busy, one warning per episode."""

from __future__ import annotations

import json

import pytest

from launcher import GroupSpec, LocalBackend, WorkerOutcome, WorkerState
from launcher.idle import MIN_SAMPLES, IdleRules, IdleWatch
from tests.support.fake_nvml import FakeNvml, h200s, install


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def step_of(line: str) -> int | None:
    return json.loads(line[5:])["step"] if line.startswith("STEP ") else None


def watch(clock: Clock, episodes: list, *, util: float | None = None, sample=None, ranks=(0, 1)) -> IdleWatch:
    idle = IdleWatch(IdleRules(60, util_below_pct=util, sample_every_s=3600), step_of, episodes.append, clock=clock,
                     wall=lambda: 1.8e9)
    idle.start("train", 1, ranks, sample)
    return idle


def test_a_cpu_rank_that_talks_but_does_not_step_warns_once_per_episode():
    clock, episodes = Clock(), []
    idle = watch(clock, episodes)
    for rank in (0, 1):
        idle.line(rank, "TFMW_READY", ready=True)
    for second in range(0, 200, 5):
        clock.now = 1000 + second
        idle.line(0, f'STEP {{"step": {second}}}')  # rank 0 trains
        idle.line(1, 'STEP {"step": 3}')  # rank 1 prints, its step frozen at 3
        idle.line(1, "still here")
        idle.poll()
    assert len(episodes) == 1, "one warning per episode, however many polls see it"
    episode = episodes[0]
    assert episode.ranks == (1,) and episode.peak_util_pct is None and episode.at == 1.8e9
    assert 60 < episode.idle_s <= 65 and episode.phase == {1: "after step 3"}
    clock.now += 1
    idle.line(1, 'STEP {"step": 4}')  # progress ends the episode ...
    idle.poll()
    clock.now += 61
    idle.line(0, 'STEP {"step": 999}')
    idle.poll()  # ... and a new stall is a new one
    assert len(episodes) == 2 and episodes[1].ranks == (1,)
    idle.stop()


def test_a_rank_that_never_joined_or_never_stepped_names_its_phase():
    clock, episodes = Clock(), []
    idle = watch(clock, episodes)
    idle.line(1, "TFMW_READY", ready=True)
    clock.now += 61
    idle.poll()
    assert episodes[0].ranks == (0, 1)
    assert episodes[0].phase == {0: "waiting to join the group",
                                 1: "joined, before its first step (tracing and compiling, or a group that takes no "
                                    "steps)"}


@pytest.mark.parametrize(("series", "warned"), [
    ([0, 1, 0, 2], True),  # below 5% for the whole window: one warning
    ([0, 1, 40, 0], False),  # one sample above: activity
    ([0, None, None, 0], False),  # too few samples (a GPU that refused some queries): busy
    ([], False),  # no NVML at all: busy
])
def test_a_gpu_rank_is_idle_only_when_every_sample_in_the_window_is_low(monkeypatch, series, warned):
    """The samples come from the local backend's NVML reading of the placed GPUs (utilization scripted per GPU)."""
    fake = install(monkeypatch, FakeNvml(h200s(2)))
    backend = LocalBackend()
    group = GroupSpec(name="train", entrypoint="x", num_workers=2, use_gpu=True)
    workers = [WorkerOutcome(rank, "localhost", 0, None, (fake.gpus[rank].uuid,), WorkerState.READY, None, {})
               for rank in (0, 1)]
    clock, episodes = Clock(), []
    sample = (lambda: backend.utilization(group, workers)) if series else (dict)
    idle = watch(clock, episodes, util=5, sample=sample)
    fake.gpus[0].utilization_pct = 97  # rank 0's GPU computes (a spinning collective reads busy too)
    for value in series:
        if value is None:
            fake.gpus[1].errors["nvmlDeviceGetUtilizationRates"] = 3  # NOT_SUPPORTED, as on MIG
        else:
            fake.gpus[1].errors.clear()
            fake.gpus[1].utilization_pct = value
        assert idle.take_sample()
        clock.now += 15
    clock.now = 1000 + 61
    idle.poll()
    assert [e.ranks for e in episodes] == ([(1,)] if warned else [])
    if warned:
        assert episodes[0].peak_util_pct == {1: 2.0} and len(series) >= MIN_SAMPLES


def test_samples_older_than_the_window_do_not_count_and_a_cpu_run_is_never_sampled(monkeypatch):
    install(monkeypatch, FakeNvml(h200s(1)))
    clock, episodes = Clock(), []
    idle = watch(clock, episodes, util=5, sample=lambda: {0: 0.0}, ranks=(0,))
    for _ in range(MIN_SAMPLES):
        idle.take_sample()
    clock.now += 200  # the samples are 200 s old: nothing in the last 60 s
    idle.poll()
    assert episodes == []
    assert watch(clock, [], sample=lambda: {0: 0.0}, ranks=(0,)).take_sample() is False
    cpu = GroupSpec(name="train", entrypoint="x", num_workers=1)
    assert LocalBackend().utilization(cpu, []) is None


def test_a_failing_callback_or_sampler_never_reaches_the_group():
    clock = Clock()

    def broken(_episode) -> None:
        raise RuntimeError("mail server on fire")

    idle = IdleWatch(IdleRules(1, util_below_pct=5, sample_every_s=3600), step_of, broken, clock=clock)
    idle.start("train", 1, (0,), lambda: 1 / 0)
    assert idle.take_sample() is False
    idle.util_below_pct = None
    clock.now += 2
    idle.poll()  # logged, not raised
    idle.stop()


@pytest.mark.parametrize("max_idle_s", [0, -1])
def test_a_watch_needs_a_positive_window(max_idle_s):
    with pytest.raises(ValueError, match="max_idle_s > 0"):  # a launch without the warning has no watch at all
        IdleRules(max_idle_s)


def test_a_group_idle_for_the_reclaim_limit_is_reclaimed_once_after_its_warning():
    clock, episodes, reclaims = Clock(), [], []
    idle = IdleWatch(IdleRules(60, reclaim_after_s=120), step_of, episodes.append, on_reclaim=reclaims.append,
                     clock=clock, wall=lambda: 1.8e9)
    idle.start("train", 1, (0, 1))
    for rank in (0, 1):
        idle.line(rank, "TFMW_READY", ready=True)
    for second in range(0, 300, 5):
        clock.now = 1000 + second
        idle.line(0, 'STEP {"step": 3}')
        if second < 100:
            idle.line(1, f'STEP {{"step": {second}}}')  # rank 1 trains for 100 s, then the whole group is stuck
        idle.poll()
    assert [e.ranks for e in episodes] == [(0,)] and len(reclaims) == 1
    reclaim = reclaims[0]
    assert reclaim.ranks == (0, 1) and 120 <= reclaim.idle_s < 125 and reclaim.phase[1] == "after step 95"
    idle.start("train", 2, (0, 1))  # a relaunch is watched afresh
    clock.now += 121
    idle.poll()
    assert len(reclaims) == 2 and reclaims[1].attempt == 2


def test_a_gpu_group_with_a_busy_gpu_is_not_reclaimed():
    clock, reclaims = Clock(), []
    idle = IdleWatch(IdleRules(60, util_below_pct=5, sample_every_s=3600, reclaim_after_s=60), step_of,
                     lambda episode: None, on_reclaim=reclaims.append, clock=clock)
    idle.start("train", 1, (0, 1), lambda: {0: 0.0, 1: 40.0})  # rank 1's GPU computes
    for _ in range(MIN_SAMPLES):
        clock.now += 15
        idle.take_sample()
    clock.now = 1000 + 61  # every sample within the window
    idle.poll()
    assert reclaims == []
    idle.stop()


def test_a_reclaim_limit_below_the_window_is_refused_naming_both():
    with pytest.raises(ValueError, match="reclaim_idle_after_s = 30 .* window max_idle_held_s = 60"):
        IdleRules(60, reclaim_after_s=30)
    with pytest.raises(ValueError, match="reclaim_idle_after_s = 60 needs an on_reclaim"):
        IdleWatch(IdleRules(60, reclaim_after_s=60), step_of, lambda episode: None)


def test_a_gpu_group_whose_gpus_stay_quiet_is_reclaimed_naming_their_peak():
    clock, reclaims = Clock(), []
    idle = IdleWatch(IdleRules(60, util_below_pct=5, sample_every_s=3600, reclaim_after_s=60), step_of,
                     lambda episode: None, on_reclaim=reclaims.append, clock=clock)
    idle.start("train", 1, (0, 1), lambda: {0: 0.0, 1: 3.0})  # a hung collective that does not spin
    for _ in range(MIN_SAMPLES):
        clock.now += 15
        idle.take_sample()
    clock.now = 1000 + 61
    idle.poll()
    assert [r.peak_util_pct for r in reclaims] == [{0: 0.0, 1: 3.0}]
    idle.stop()
