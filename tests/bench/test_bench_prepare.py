"""bench/bench_prepare.py: the profile printed beside each ratio names the largest steps around the tokenizer, and
the summary takes the medians of every step the stage's log records carried."""

from __future__ import annotations

import logging

from bench import bench_prepare


def test_the_profile_ranks_the_steps_by_their_share_of_the_raw_call():
    steps = {"start-up": 0.05, "tokenizer": 2.04, "reading": 0.02, "splitting": 0.004, "ids": 0.045,
             "hashing": 0.001, "shards and publishing": 0.02}
    assert bench_prepare.profile_items(steps, raw_s=2.0, raw_cpu_s=2.0, top=3) == \
        "start-up 2.5%, ids 2.2%, tokenizer calls +2.0%"
    everything = bench_prepare.profile_items(steps, raw_s=2.0, raw_cpu_s=2.0)
    assert everything.endswith("splitting 0.2%, hashing 0.1%") and everything.count("%") == len(steps)
    assert bench_prepare.profile_items({"tokenizer": 1.9, "ids": 0.01}, raw_s=2.0, raw_cpu_s=2.0) == \
        "ids 0.5%, tokenizer calls -5.0%"


def test_the_tokenizer_calls_are_compared_with_the_raw_calls_cpu_time():
    # 2 cores: the raw call's CPU time is twice its wall time; the stage's calls took 5% more CPU than it.
    steps = {"tokenizer": 4.2, "start-up": 0.09, "ids": 0.11}
    assert bench_prepare.profile_items(steps, raw_s=2.0, raw_cpu_s=4.0) == \
        "ids 5.5%, tokenizer calls +5.0%, start-up 4.5%"


def test_the_summary_takes_each_steps_median_over_the_warm_pairs():
    def pair(raw_s, stage_s, ids_s):
        return {"raw_s": raw_s, "stage_s": stage_s, "raw_cpu_s": raw_s, "stage_cpu_s": stage_s,
                "raw_offsets_s": raw_s * 1.2, "phases": {"start_up_s": 0.1, "tokenize_s": stage_s - 0.2,
                                                         "write_s": 0.1},
                "steps": {"start-up": 0.1, "tokenizer": raw_s, "ids": ids_s}}

    child = {"tokens": 1000, "documents": 10, "cores": 1, "cold": {"raw_s": 2.0, "stage_s": 3.0,
                                                                    "phases": {"start_up_s": 1.0}},
             "warm": [pair(2.0, 2.2, 0.04), pair(2.0, 2.1, 0.06), pair(2.0, 2.4, 0.05)]}
    figures = bench_prepare._summarize([child])
    assert figures["steps"] == {"start-up": 0.1, "tokenizer": 2.0, "ids": 0.05}
    assert figures["ratio"] == 2.0 / 2.2
    assert figures["raw_cpu_s"] == 2.0


def test_the_phase_clock_sums_the_units_step_records():
    clock = bench_prepare._PhaseClock()
    logger = logging.getLogger("bench-prepare-test")
    logger.addHandler(clock)
    logger.setLevel(logging.INFO)
    try:
        logger.info("unit 0", extra={"steps": {"reading": 0.5, "ids": 0.25}})
        logger.info("unit 1", extra={"steps": {"reading": 0.25, "ids": 0.25}})
        logger.info("tokenized")
        assert clock.steps == {"reading": 0.75, "ids": 0.5}
        clock.clear()
        assert (clock.steps, clock.events) == ({}, [])
    finally:
        logger.removeHandler(clock)
