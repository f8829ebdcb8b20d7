"""Redone steps before and after preemption checkpoints (issue 40, item 7): the ledger counts a failed train attempt's
time after its join as redone, unless its ranks exited EXIT_PREEMPTED (checkpoint of their last step saved on SIGTERM,
where the next attempt resumed): then nothing is redone."""

from __future__ import annotations

import pytest

from core.protocol import EXIT_PREEMPTED
from tasks.ledger import usage
from tasks.ledger.record import add_steps
from tasks.ledger.usage import AttemptEvents, Book, RankEvents
from tasks.report.document import Runs
from tests.tasks.report.test_comparison import figures


def _attempt(state: str, launch: float, ready: float, end: float, exit_code: int | None) -> AttemptEvents:
    return AttemptEvents(group="train", backend="local", attempt=1, try_number="1", state=state,
                         ranks=tuple(RankEvents(rank=r, host="h", gpus=(), launch=launch, ready=ready, exit=end,
                                                exit_code=exit_code) for r in range(2)))


def _book(first_exit_code: int) -> Book:
    """A train attempt that fails at t=60 after joining at 10, then a retry from 70 to 130 that succeeds."""
    attempts = [_attempt("failed", 0, 10, 60, first_exit_code), _attempt("succeeded", 70, 80, 130, 0)]
    run = figures(train_time_s=40, summary_url="/nowhere/s.json", finished_at="2026-12-04T22:00:00+00:00")
    timelines = add_steps(attempts, Runs(distributed=run, baseline=None))
    return usage.ledger(timelines, released_at=130)


@pytest.mark.parametrize("lost", [1, -9, 3])
def test_a_failed_attempt_without_a_preemption_checkpoint_is_redone(lost):
    book = _book(lost)
    assert book.idle_by_cause_s["redone"] == pytest.approx(2 * 50)  # both ranks, from the join to the exit
    assert book.busy_s == pytest.approx(2 * 40)


def test_a_preempted_attempt_redoes_nothing_and_its_steps_are_kept():
    book = _book(EXIT_PREEMPTED)
    assert book.idle_by_cause_s["redone"] == 0
    assert book.busy_s == pytest.approx(2 * (50 + 40))
    assert sum(book.idle_by_cause_s.values()) == pytest.approx(book.idle_s)
