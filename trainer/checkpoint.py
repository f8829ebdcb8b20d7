"""Step checkpoints in a local directory kept in sync with `TrainOutput.checkpoints`, restored on start.

Every worker calls `save` (saving a distributed checkpoint runs collectives), but only the chief writes the real
one; the others write to a temporary directory that is removed right after (TF's multi-worker pattern). When
the output is on object storage the chief uploads the new checkpoint's files first and the small `checkpoint`
index last, so a reader never sees an index pointing at missing data (`core.storage.local_copy` and
`publish_files`: a local output is written in place).
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path

from core import storage

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
        self.read_dir = storage.local_copy(remote_url, work_dir)  # a copy is <work_dir>/<the URL's last name>
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
        self._publish(step)
        log.info("checkpoint step %d saved to %s", step, storage.join(self.remote_url, Path(path).name))

    def _publish(self, step: int) -> None:
        """The new checkpoint's files, then the index (a copy's reader never sees it point at missing data), then
        what max_to_keep rotated out of the local directory goes from storage too (nothing left when it is local)."""
        local_files = {f.name for f in self.write_dir.iterdir() if f.is_file()}
        new = [name for name in sorted(local_files) if (match := _STEP.match(name)) and int(match.group(1)) == step]
        storage.publish_files(self.write_dir, self.remote_url, [*new, INDEX_FILE])
        for name in storage.list_dir(self.remote_url):
            if _STEP.match(name) and name not in local_files:
                storage.remove_tree(storage.join(self.remote_url, name))

    def close(self) -> None:
        if not self.is_chief:
            shutil.rmtree(self.write_dir, ignore_errors=True)
