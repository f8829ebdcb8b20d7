"""Step checkpoints in a local directory kept in sync with `TrainOutput.checkpoints`, restored on start.

Every worker calls `save` (saving a distributed checkpoint runs collectives), but only the chief writes the real
one; the others write to a temporary directory that is removed right after (TF's multi-worker pattern). When
the output is on object storage the chief uploads the new checkpoint's files first and the small `checkpoint`
index last, so a reader never sees an index pointing at missing data.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path

from trainer import storage

log = logging.getLogger("trainer.checkpoint")

INDEX_FILE = "checkpoint"
_STEP = re.compile(r"^ckpt-(\d+)\.")
_INDEX_LATEST = re.compile(rb'model_checkpoint_path:\s*"[^"]*ckpt-(\d+)"')
MAX_TO_KEEP = 2


def latest_step(checkpoints_url: str) -> int:
    """The step of the newest checkpoint under `checkpoints_url` (local or object storage), from TF's small index
    file alone (no TensorFlow import); 0 when there is none."""
    index = storage.join(checkpoints_url, INDEX_FILE)
    if not storage.exists(index):
        return 0
    found = _INDEX_LATEST.search(storage.read_bytes(index))
    return int(found.group(1)) if found else 0


class CheckpointStore:
    def __init__(self, checkpoint, remote_url: str, work_dir: Path, *, rank: int, is_chief: bool) -> None:
        import tensorflow as tf

        self._tf = tf
        self.checkpoint = checkpoint
        self.remote_url = remote_url
        self.rank = rank
        self.is_chief = is_chief
        fs, path = storage.filesystem(remote_url)
        self.remote_is_local = storage.is_local(fs)
        if self.remote_is_local:
            self.read_dir = Path(path)
        else:
            self.read_dir = work_dir / "checkpoints"
            storage.download_tree(remote_url, self.read_dir)
        self.write_dir = self.read_dir if is_chief else Path(tempfile.mkdtemp(prefix=f"workertemp_{rank}_"))
        self.write_dir.mkdir(parents=True, exist_ok=True)
        self.manager = tf.train.CheckpointManager(checkpoint, str(self.write_dir), max_to_keep=MAX_TO_KEEP)

    def restore_latest(self) -> str | None:
        """Restore the newest checkpoint of this output (all ranks read the chief's); None when there is none."""
        latest = self._tf.train.latest_checkpoint(str(self.read_dir))
        if latest is None:
            return None
        self.checkpoint.restore(latest).assert_existing_objects_matched()
        log.info("rank %d restored checkpoint %s", self.rank, latest)
        return latest

    def save(self, step: int) -> None:
        path = self.manager.save(checkpoint_number=step)
        if not self.is_chief:
            shutil.rmtree(self.write_dir, ignore_errors=True)
            self.write_dir.mkdir(parents=True)
            return
        if not self.remote_is_local:
            self._upload(step)
        log.info("checkpoint step %d saved to %s", step, path if self.remote_is_local else self.remote_url)

    def _upload(self, step: int) -> None:
        local_files = {f.name for f in self.write_dir.iterdir() if f.is_file()}
        for name in sorted(local_files):
            match = _STEP.match(name)
            if match and int(match.group(1)) == step:
                storage.upload_file(self.write_dir / name, storage.join(self.remote_url, name))
        storage.upload_file(self.write_dir / INDEX_FILE, storage.join(self.remote_url, INDEX_FILE))
        for name in storage.list_dir(self.remote_url):
            if _STEP.match(name) and name not in local_files:  # rotated out by max_to_keep
                storage.remove_tree(storage.join(self.remote_url, name))

    def close(self) -> None:
        if not self.is_chief:
            shutil.rmtree(self.write_dir, ignore_errors=True)
