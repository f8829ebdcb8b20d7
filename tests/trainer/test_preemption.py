"""Retries that waste nothing, with the real trainer on 2 tiny CPU workers through the launcher (issue 40, item 7).

- A worker that gets SIGTERM mid-run (a spot reclaim, a node drain, a pod's deletion) saves a checkpoint at once:
  its stop flag travels in the step's all-reduce, so both ranks save the same step and exit EXIT_PREEMPTED, within
  `preemption_checkpoint_s`. The next launch resumes at that step, not at the last periodic checkpoint (there is none:
  the interval is the whole run).
- A rank SIGKILLed in that next launch ends the group at once (the survivor is aborted, not asked for a checkpoint
  it cannot agree on), and the launch after resumes from the last checkpoint.
- A diverged loss exits EXIT_PERMANENT on every rank (the operator then fails the task without retrying).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest

from core.protocol import ABORT_SIGNAL, EXIT_PERMANENT, EXIT_PREEMPTED
from core.storage import exists
from launcher import FailureKind, GroupState
from tests.trainer.long_run import TrainGroup, last_step, read_process, write_tiny_dataset
from tests.trainer.test_long_runs import checkpoint_step, resume_and_finish

pytestmark = pytest.mark.timeout(900)

STEPS = 400
DEADLINE_S = 8
LAUNCH_BOUND_S = 600  # a safety net for a group that never ends, not a performance target


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> str:
    return write_tiny_dataset(tmp_path_factory.mktemp("dataset"))


def test_sigterm_mid_run_checkpoints_the_next_launch_resumes_there_and_a_rank_sigkilled_in_it_ends_it_at_once(
        tmp_path, manifest):
    job = TrainGroup(tmp_path, manifest, max_steps=STEPS, checkpoint_every_steps=STEPS,
                     preemption_checkpoint_s=DEADLINE_S)
    job.start()
    job.wait_for(lambda: last_step(job.metrics_file(1)) >= 20, 300, "step 20 of rank 1")
    os.kill(job.workers[1].pid, signal.SIGTERM)  # one rank only, as a spot reclaim of one node
    sent, step_at_signal = time.monotonic(), last_step(job.metrics_file(1))
    result = job.wait(LAUNCH_BOUND_S)
    ended_after_s = time.monotonic() - sent
    saved = checkpoint_step(job.output)
    print(f"\nSIGTERM to rank 1 at step {step_at_signal}: checkpoint of step {saved}, group ended after "
          f"{ended_after_s:.2f} s")

    assert result.state is GroupState.FAILED, result.error_message()
    # Both ranks agreed through the all-reduced flag: the one signalled and the one that was not.
    assert {w.rank: w.exit_code for w in result.workers} == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}, job.log_text()
    assert saved is not None and step_at_signal <= saved < STEPS, (step_at_signal, saved)
    assert ended_after_s < DEADLINE_S, "the preemption checkpoint missed its deadline"
    logs = job.log_text(last=400)
    assert f"rank 1: SIGTERM with notice; checkpoint of step {saved} saved" in logs, logs
    assert f"rank 0: another rank got SIGTERM with notice; checkpoint of step {saved} saved" in logs, logs
    assert not exists(f"{job.output}/summary.json")

    sigkill_a_rank_of_the_retry(job, saved)
    resume_and_finish(job, saved)  # "resuming at step <saved>", and the summary's resumed_from_step


def sigkill_a_rank_of_the_retry(job: TrainGroup, checkpoint: int) -> None:
    """The next launch resumes at `checkpoint`; rank 1 SIGKILLed there ends the group within 2 s, although rank 0,
    blocked in the step's all-reduce with its dead peer, could never act on SIGTERM: the launcher aborts it
    (core.protocol.ABORT_SIGNAL) instead of waiting out a grace that no checkpoint could use. The last checkpoint
    stays `checkpoint` for the launch after."""
    job.spec = replace(job.spec, grace_period_s=30)
    job.start()
    job.wait_for(lambda: last_step(job.metrics_file(1)) >= checkpoint + 20, 300, f"step {checkpoint + 20} of rank 1")
    os.kill(job.workers[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    result = job.wait(LAUNCH_BOUND_S)
    ended_after_s = time.monotonic() - killed
    print(f"rank 1 SIGKILLed in the retry: the group ended {ended_after_s:.2f} s later")
    assert f"resuming at step {checkpoint} of {STEPS}" in job.log_text(last=10_000)
    assert result.failures[1].kind is FailureKind.SIGNAL and set(result.failures) == {1}, result.error_message()
    assert result.workers[0].exit_code == -ABORT_SIGNAL, job.log_text()
    assert ended_after_s < 2 and all(read_process(w.pid) is None for w in result.workers)
    assert checkpoint_step(job.output) == checkpoint


def test_a_diverged_loss_exits_not_retryable_on_every_rank(tmp_path, manifest):
    # A learning rate of 1 without warm-up: the loss leaves its lowest value by more than 0.5 nats within a few steps.
    job = TrainGroup(tmp_path, manifest, max_steps=200, learning_rate=1.0, warmup_steps=0, max_loss_rise=0.5)
    job.start()
    result = job.wait(LAUNCH_BOUND_S)
    assert result.state is GroupState.FAILED
    assert {w.exit_code for w in result.failures.values()} == {EXIT_PERMANENT}, result.error_message()
    root = min(result.failures.values(), key=lambda f: (f.elapsed_s, f.rank))
    assert any("LossDivergedError: rank" in line and "the training loss diverged" in line
               for line in root.log_tail), "\n".join(root.log_tail)
