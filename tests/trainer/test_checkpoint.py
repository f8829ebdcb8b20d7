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
