"""What a dataset is (its fingerprint), whether a complete one exists (the cache), and publishing it: the manifest
last, so that a stage killed anywhere leaves no manifest and readers, who trust only the manifest, see nothing.

Layout under `storage_root/datasets/`: `<fingerprint>/` holds the shards, `tokenizer/` and `manifest.json`;
`.work/<fingerprint>/` the plan's tokenizer and the units' streams while the stage runs (removed once the dataset
is published, and by the next plan of the same fingerprint when a stage died). Local roots build the dataset in
`.<fingerprint>.partial-*` next to its place and rename it there; object stores get the files uploaded first and
`manifest.json` (one PUT) after them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from core import storage
from core.document import DocumentError
from core.layout import TOKENIZER_DIR, StorageLayout
from tasks.dataset.errors import PrepareError
from tasks.dataset.manifest import FileEntry, Manifest, PackingSettings
from tasks.dataset.sources import Sources
from tasks.dataset.tokenizer import TokenizerPlan
from trainer.data import FORMAT_VERSION

log = logging.getLogger("gpt_finetune.prepare")

MANIFEST = "manifest.json"
WORK_DIR = ".work"


def dataset_fingerprint(sources: Sources, plan: TokenizerPlan, settings: PackingSettings) -> str:
    identity = {
        "format_version": FORMAT_VERSION,
        "kind": sources.kind,
        "sources": [f.to_xcom() for f in sources.files],
        "tokenizer": {"spec": plan.spec, "fingerprint": plan.fingerprint,
                      "sample": plan.sample.to_xcom() if plan.sample else None},
        "settings": settings.to_xcom(),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()[:20]


def work_url(layout: StorageLayout, fingerprint: str) -> str:
    return storage.join(layout.root, "datasets", WORK_DIR, fingerprint)


def complete_manifest(manifest_url: str, fingerprint: str) -> Manifest | None:
    """The manifest when it is one of this fingerprint and every file it lists exists with the listed size; None
    otherwise (the dataset is prepared again, replacing it). A manifest of another shape is refused by its field."""
    try:
        written = storage.read_json(manifest_url)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deep
        log.warning("%s is not readable JSON (%s); preparing again", manifest_url, type(error).__name__)
        return None
    if not isinstance(written, dict) or written.get("fingerprint") != fingerprint or \
            written.get("format_version") != FORMAT_VERSION:
        log.warning("%s belongs to another fingerprint or format; preparing again", manifest_url)
        return None
    try:
        manifest = Manifest.from_xcom(written)
    except DocumentError as error:
        log.warning("%s is refused (%s); preparing again", manifest_url, error)
        return None
    fs, directory = storage.filesystem(manifest_url.rsplit("/", 1)[0])
    present = {
        os.path.relpath(info["name"], directory): int(info["size"])
        for info in fs.find(directory, detail=True).values()
    }
    expected = {shard.name: shard.bytes for split in manifest.splits.values() for shard in split.shards}
    expected |= {f"{TOKENIZER_DIR}/{f.name}": f.bytes for f in manifest.tokenizer.files}
    damaged = sorted(name for name, size in expected.items() if present.get(name) != size)
    if damaged:
        log.warning("%s lists files that are missing or resized (%s); preparing again", manifest_url, damaged[:5])
        return None
    return manifest


def check_writable(root: str) -> None:
    probe = storage.join(root, "datasets", f".write-probe-{uuid.uuid4().hex}")
    try:
        storage.write_bytes_atomic(probe, b"")
        fs, path = storage.filesystem(probe)
        fs.rm(path)
    except Exception as error:
        raise PrepareError(
            f"Setting 'storage_root' = {root!r} cannot be written ({type(error).__name__}: {error}). Fix its "
            "permissions or credentials, or point 'storage_root' elsewhere. Nothing was tokenized."
        ) from error


LEFTOVER_AGE_S = 24 * 3600  # a plan's work directory that nothing wrote to for this long belongs to a dead stage


def remove_leftovers(url: str, *, older_than_s: float | None = None) -> None:
    """What unfinished stages of this fingerprint left in its work directory: each plan's directory (`<plan_id>/`)
    that nothing wrote to for `older_than_s` (LEFTOVER_AGE_S). A younger one may belong to another run preparing
    the same dataset right now: only its owner removes it (its finish), so two preparations never destroy each
    other's work."""
    age = LEFTOVER_AGE_S if older_than_s is None else older_than_s
    fs, path = storage.filesystem(url)
    if not fs.exists(path):
        return
    now = time.time()
    for entry in fs.ls(path, detail=True):
        written = [_modified(info) for info in fs.find(entry["name"], detail=True, withdirs=True).values()]
        if max(written + [_modified(entry)], default=0.0) < now - age:
            log.info("removing %s, left by an unfinished run of this dataset (nothing written for %.0f h)",
                     entry["name"], age / 3600)
            fs.rm(entry["name"], recursive=True)


def _modified(info: dict[str, Any]) -> float:
    """A file's modification time from fsspec's info: `mtime` (local), `LastModified` (S3); 0 when it has none."""
    value = info.get("mtime", info.get("LastModified"))
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return float(value) if isinstance(value, (int, float)) else 0.0


def publish(stage: Path, dataset_url: str, manifest: Manifest) -> None:
    try:
        storage.publish_directory(stage, dataset_url, last=(MANIFEST, manifest.to_bytes()))
    except Exception as error:
        raise PrepareError(
            f"Writing the dataset to {dataset_url} failed ({type(error).__name__}: {error}). No manifest was "
            "written, so nothing is published; the next run uploads it again from the start."
        ) from error


def file_entries(directory: Path) -> tuple[FileEntry, ...]:
    return tuple(FileEntry(name=path.relative_to(directory).as_posix(), bytes=path.stat().st_size,
                           sha256=storage.sha256_file(path))
                 for path in sorted(directory.rglob("*")) if path.is_file())
