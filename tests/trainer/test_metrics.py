"""What a training run reports: the chief's TensorBoard file (read back with TensorFlow's own event reader), the
live metrics lines, and the loss watch that fails a diverging run."""

from __future__ import annotations

import json
import math

import pytest

from trainer.metrics import LIVE_INTERVAL_ENV, LIVE_PREFIX, LiveMetrics, LossDivergedError, LossWatch, TensorBoardLog


def _record(step: int, loss: float = 4.0) -> dict:
    return {"step": step, "loss": loss, "learning_rate": 1e-3, "tokens_per_s": 900.0, "step_time_s": 0.5,
            "input_wait_s": 0.1, "tokens_seen": 64 * step, "time": 0.0, "grad_norm": 1.5}


def _live_lines(output: str) -> list[dict]:
    return [json.loads(line[len(LIVE_PREFIX):]) for line in output.splitlines() if line.startswith(LIVE_PREFIX)]


def test_live_lines_first_step_then_at_most_one_per_interval_and_the_last(capsys, monkeypatch):
    clock = iter([0.0, 0.5, 1.0, 2.5, 2.6, 2.7])
    monkeypatch.setattr("trainer.metrics.time.monotonic", lambda: next(clock))
    live = LiveMetrics(total_steps=6, environ={LIVE_INTERVAL_ENV: "2"})
    for step in range(1, 7):
        live.maybe_print(_record(step))
    lines = _live_lines(capsys.readouterr().out)
    assert [line["values"]["step"] for line in lines] == [1, 4, 6]
    assert lines[0] == {"scope": "worker", "values": {
        "step": 1, "loss": 4.0, "learning_rate": 1e-3, "tokens_per_s": 900.0, "step_time_s": 0.5,
        "input_wait_s": 0.1, "grad_norm": 1.5, "compute_s": pytest.approx(0.4)}}


def test_no_live_lines_unless_the_operator_asks(capsys):
    live = LiveMetrics(total_steps=2, environ={})
    live.maybe_print(_record(1))
    live.maybe_print(_record(2))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_loss_that_is_not_finite_fails_naming_rank_step_and_the_lowest_loss(bad):
    watch = LossWatch(rank=1, max_rise=0.0)
    watch.check(1, 5.0)
    watch.check(2, 4.5)
    with pytest.raises(LossDivergedError, match=rf"rank 1: the training loss is {bad} at step 3 \(lowest so far "
                                                 r"4.5000 at step 2\): lower 'learning_rate'"):
        watch.check(3, bad)


def test_a_loss_far_above_its_running_minimum_fails_with_both_values():
    watch = LossWatch(rank=0, max_rise=3.0)
    for step, loss in enumerate([7.6, 6.0, 4.0, 6.9, 5.0], start=1):  # 6.9 is 2.9 above the lowest: still fine
        watch.check(step, loss)
    with pytest.raises(LossDivergedError, match=r"rank 0: the training loss diverged at step 6: 7.1000 is 3.10 nats "
                                                r"above its lowest so far \(4.0000 at step 3; the limit "
                                                r"'max_loss_rise' is 3\)"):
        watch.check(6, 7.1)


def test_the_divergence_check_is_off_at_zero():
    watch = LossWatch(rank=0, max_rise=0.0)
    for step, loss in enumerate([5.0, 1.0, 70.0], start=1):
        watch.check(step, loss)


def test_tensorboard_events_are_what_tf_summary_scalar_writes(tmp_path):
    tf = pytest.importorskip("tensorflow")
    log = TensorBoardLog(tmp_path / "tensorboard")
    for step in (1, 2, 3):
        log.write(step, {"loss": 5.0 - step, "learning_rate": 1e-3 * step})
    log.close()

    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*.v2"))
    assert len(files) == 1
    events = list(tf.compat.v1.train.summary_iterator(str(files[0])))
    assert events[0].file_version == "brain.Event:2"
    scalars = {}
    for event in events[1:]:
        for value in event.summary.value:
            assert value.metadata.plugin_data.plugin_name == "scalars"
            scalars[(event.step, value.tag)] = float(tf.make_ndarray(value.tensor))
    assert scalars == pytest.approx({(s, tag): v for s in (1, 2, 3)
                                     for tag, v in (("loss", 5.0 - s), ("learning_rate", 1e-3 * s))})

    # Exactly the record tf.summary.scalar's op writes for the same value: same tensor, same metadata.
    with tf.summary.create_file_writer(str(tmp_path / "reference")).as_default(step=1):
        tf.summary.write("loss", tf.constant(4.0, tf.float32), metadata=events[1].summary.value[0].metadata
                         .SerializeToString())
    reference = next(e for f in (tmp_path / "reference").glob("events.out.tfevents.*")
                     for e in tf.compat.v1.train.summary_iterator(str(f)) if e.summary.value).summary.value[0]
    assert reference.tensor == events[1].summary.value[0].tensor
    assert reference.metadata == events[1].summary.value[0].metadata
