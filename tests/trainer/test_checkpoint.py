"""trainer.checkpoint: the newest step, read from TF's index file on disk or object storage without TensorFlow, and
the store each worker saves through (one variable, no training)."""

from __future__ import annotations

from core.storage import list_dir, write_bytes_atomic
from trainer.checkpoint import CheckpointStore, latest_step

INDEX = (b'model_checkpoint_path: "ckpt-20"\n'
         b'all_model_checkpoint_paths: "ckpt-10"\nall_model_checkpoint_paths: "ckpt-20"\n')


def test_latest_step_reads_the_trainers_index(tmp_path):
    assert latest_step(str(tmp_path)) == 0  # no index: no checkpoint
    (tmp_path / "checkpoint").write_bytes(INDEX)
    assert latest_step(str(tmp_path)) == 20
    (tmp_path / "checkpoint").write_bytes(b"garbage\n")
    assert latest_step(str(tmp_path)) == 0


def test_latest_step_on_object_storage(s3_bucket):
    url = f"{s3_bucket}/runs/r/train/checkpoints"
    assert latest_step(url) == 0
    write_bytes_atomic(f"{url}/checkpoint", INDEX.replace(b"ckpt-20", b"ckpt-40"))
    assert latest_step(url) == 40


def test_the_chief_publishes_each_step_to_object_storage_and_a_restart_restores_the_newest(s3_bucket, tmp_path):
    import tensorflow as tf

    url = f"{s3_bucket}/runs/r/train/checkpoints"
    weight = tf.Variable(0.0)
    chief = CheckpointStore(tf.train.Checkpoint(weight=weight), url, tmp_path / "chief", rank=0, is_chief=True)
    assert chief.restore_latest() is None
    for step in (1, 2, 3):
        weight.assign(float(step))
        chief.save(step)
    chief.close()
    assert latest_step(url) == 3
    kept = {name.split(".")[0] for name in list_dir(url) if name.startswith("ckpt-")}
    assert kept == {"ckpt-2", "ckpt-3"}, "step 1, rotated out by max_to_keep, leaves object storage too"

    restored = tf.Variable(0.0)
    restart = CheckpointStore(tf.train.Checkpoint(weight=restored), url, tmp_path / "retry", rank=0, is_chief=True)
    assert restart.restore_latest().endswith("ckpt-3")
    assert restored.numpy() == 3.0


def test_a_non_chief_saves_into_a_temporary_directory_that_it_removes(tmp_path):
    """Every worker saves (saving runs collectives); only the chief's checkpoint is kept."""
    import tensorflow as tf

    url = str(tmp_path / "checkpoints")
    worker = CheckpointStore(tf.train.Checkpoint(weight=tf.Variable(1.0)), url, tmp_path / "work", rank=1,
                             is_chief=False)
    temporary = worker.write_dir
    worker.save(1)
    assert temporary.is_dir() and list(temporary.iterdir()) == []
    worker.close()
    assert not temporary.exists()
    assert latest_step(url) == 0


def test_a_checkpoint_of_other_objects_is_refused_with_what_to_do(tmp_path):
    """As one written by the tf-keras trainer (TFGPT2LMHeadModel, tf_keras' AdamW) before trainer/decoders/."""
    import pytest
    import tensorflow as tf

    from trainer.checkpoint import IncompatibleCheckpointError

    url = str(tmp_path / "output" / "checkpoints")
    old = CheckpointStore(tf.train.Checkpoint(keras_model=tf.Module(), step=tf.Variable(7, dtype=tf.int64)), url,
                          tmp_path / "old", rank=0, is_chief=True)
    old.checkpoint.keras_model.kernel = tf.Variable(tf.ones([2, 2]))
    old.save(7)
    old.close()
    model = tf.Module()
    model.weight = tf.Variable(tf.zeros([3]))
    new = CheckpointStore(tf.train.Checkpoint(model=model, step=tf.Variable(0, dtype=tf.int64)), url,
                          tmp_path / "new", rank=1, is_chief=False)
    with pytest.raises(IncompatibleCheckpointError, match=r"rank 1: the checkpoint .*ckpt-7 .* give the run a new "
                                                          r"--output, or set 'model'"):
        new.restore_latest()
    new.close()
