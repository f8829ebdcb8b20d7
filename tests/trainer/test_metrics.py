"""The chief's TensorBoard file, read back with TensorFlow's own event reader."""

from __future__ import annotations

import pytest

from trainer.metrics import TensorBoardLog

tf = pytest.importorskip("tensorflow")


def test_tensorboard_events_are_what_tf_summary_scalar_writes(tmp_path):
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
