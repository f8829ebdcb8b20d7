"""trainer.checkpoint without TensorFlow: the newest step, read from TF's index file on disk or object storage."""

from __future__ import annotations

from trainer.checkpoint import latest_step
from trainer.storage import write_bytes_atomic

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
