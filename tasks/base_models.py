"""Base models from the hub, fetched once, pinned and cached (the prepare task).

A hub name in `model` (`gpt2`, `openai-community/gpt2`) is resolved once, in prepare, to the commit sha of
`model_revision` (default `main`, the current head, recorded), and its checkpoint (config.json, model.safetensors or
its index and shards, generation_config.json) and tokenizer files are checked (trainer.decoders' check_checkpoint:
a supported architecture, every tensor's name, shape and dtype, the block size) and copied once per (name, sha) to
`storage_root/models/base/<name>@<sha>/` (`/` in a name becomes `--`), published like every other directory:
staged, then `base_model.json` last. A directory without that record (a killed prepare), or one fetched before
base models were safetensors checkpoints (its record lists no .safetensors file), is never used: the next prepare
fetches it again. The run's config then names that directory in `model`
(and in `tokenizer` when it named the same hub model) and the sha in `model_revision`, so the workers, the
baseline and evaluate load only from storage, never from the hub; the sha is part of the baseline key and of the
config every report and model card shows.

The hub is reached through huggingface_hub's cache (`HF_HOME`): a machine with `HF_HUB_OFFLINE=1` resolves names
and revisions from the cache alone.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from core.clock import utc_now
from core.config import AccessPolicy, ConfigError, RunConfig
from core.document import Document, DocumentError
from core.layout import BASE_MODEL_RECORD, StorageLayout, local_or_hub
from core.storage import exists, join, publish_directory, read_json, staging_directory
from trainer.model import is_model_location

log = logging.getLogger("gpt_finetune.base_models")

DEFAULT_REVISION = "main"
# A Hugging Face checkpoint in safetensors and its tokenizer (huggingface_hub allow_patterns). Pickled PyTorch,
# TF, Flax and ONNX weights are never fetched.
FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
         "model-*-of-*.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
         "special_tokens_map.json", "added_tokens.json")
_SHA = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class SnapshotFile(Document):
    """One file of a cached base model: its name and size."""

    name: str
    bytes: int


@dataclass(frozen=True)
class BaseModelRecord(Document):
    """`base_model.json`, written last into a cached base model (`publish_snapshot`) and checked where it is read
    back (a cached copy reused, `pinned_base`): a record of another shape is refused, naming the file and the field.

    Attributes:
        format_version: 1; name: the hub name; revision: the `model_revision` it was fetched for; sha: its commit.
        fetched_at: UTC ISO; files: the files copied.
    """

    format_version: int
    name: str
    revision: str
    sha: str
    fetched_at: str
    files: tuple[SnapshotFile, ...]

    @classmethod
    def read(cls, url: str) -> BaseModelRecord:
        try:
            return cls.from_xcom(read_json(url))
        except DocumentError as error:
            raise DocumentError(f"{url}: {error} Remove that directory: the next prepare fetches it again.") from None


@dataclass(frozen=True)
class BasePin(Document):
    """The cached hub model a prepared config trains from (`pinned_base`): what promotion records in version.json
    (`base_model`) and the model card names. `url`: the cached copy (the config's `model`)."""

    name: str
    revision: str
    sha: str
    url: str


def is_hub_name(cfg: RunConfig) -> bool:
    return not (cfg.is_preset_model or cfg.promoted_source is not None
                or is_model_location(local_or_hub(cfg.model)))


def resolve_base_model(cfg: RunConfig,
                       cache_dir: str | Path | None = None) -> tuple[RunConfig, BaseModelRecord | None]:
    """For a hub name in `model`: the config that loads it from its cached copy in storage (`model`), and that copy's
    record (fetched now when no complete copy exists). Other models: unchanged, None. Raises ConfigError naming the
    revision or the model when the revision cannot be resolved or the files are no checkpoint the trainer reads."""
    if not is_hub_name(cfg):
        return _absolute_model_directory(cfg), None
    revision = cfg.model_revision or DEFAULT_REVISION
    with _hub_errors(cfg.model, revision):
        sha = resolve_sha(cfg.model, revision, cache_dir)
        url = StorageLayout(cfg.storage_root).base_model(cfg.model, sha)
        record_url = join(url, BASE_MODEL_RECORD)
        record = BaseModelRecord.read(record_url) if exists(record_url) else None  # complete: its record is last
        if record is not None and holds_safetensors(record):
            log.info("Base model %s@%s (revision %r): reusing %s, nothing fetched", cfg.model, sha, revision, url)
        else:
            snapshot = fetch_snapshot(cfg.model, revision, sha, cache_dir, block_size=cfg.block_size)
            record = publish_snapshot(snapshot, url, cfg.model, revision)
            log.info("Base model %s@%s (revision %r): fetched once to %s", cfg.model, sha, revision, url)
    changes = {"model": url, "model_revision": sha}
    if cfg.tokenizer == cfg.model:
        changes["tokenizer"] = url
    resolved = cfg.replace(**changes)
    AccessPolicy.from_env().check_settings(resolved)
    return resolved, record


def resolve_sha(name: str, revision: str, cache_dir: str | Path | None = None) -> str:
    """The commit `revision` names: itself when it is a sha (no hub access), else the hub's answer (offline: the
    cache's refs)."""
    from huggingface_hub import HfApi, constants, snapshot_download

    if _SHA.fullmatch(revision):
        return revision
    if constants.HF_HUB_OFFLINE:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True)).name
    return HfApi().model_info(name, revision=revision).sha


def holds_safetensors(record: BaseModelRecord) -> bool:
    """Whether a cached copy holds a safetensors checkpoint (copies made for the TF model held tf_model.h5 only)."""
    return any(file.name.endswith(".safetensors") for file in record.files)


def fetch_snapshot(name: str, revision: str, sha: str, cache_dir: str | Path | None = None, *,
                   block_size: int | None = None) -> Path:
    """The files of `name` at commit `sha` (the safetensors checkpoint and the tokenizer only), through the hub
    cache; checked before anything is copied (`check_base_checkpoint`)."""
    from huggingface_hub import constants, snapshot_download

    # Offline, huggingface_hub 1.x would still list the commit's files on the hub: read the cache alone (its snapshot
    # may hold other files; publish_snapshot copies FILES only).
    snapshot = Path(snapshot_download(name, revision=sha, allow_patterns=list(FILES), cache_dir=cache_dir,
                                      local_files_only=constants.HF_HUB_OFFLINE))
    check_base_checkpoint(str(snapshot), block_size, f"Setting 'model' = {name!r} (revision {revision!r}, commit "
                          f"{snapshot.name})")
    return snapshot


@contextlib.contextmanager
def _hub_errors(name: str, revision: str) -> Iterator[None]:
    """The hub's refusals as ConfigErrors naming the setting."""
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except RevisionNotFoundError as error:
        raise ConfigError(f"Setting 'model_revision' = {revision!r}: model {name!r} has no such revision on the hub "
                          "(a branch, tag or commit sha): check it, or leave it empty for the current head.") from error
    except (RepositoryNotFoundError, HFValidationError) as error:
        raise ConfigError(f"Setting 'model' = {name!r} is no model on the hub ({type(error).__name__}): use a "
                          "preset, a hub name such as 'gpt2', or a directory of save_pretrained files.") from error
    except LocalEntryNotFoundError as error:
        raise ConfigError(
            f"Setting 'model_revision' = {revision!r}: revision {revision!r} of model {name!r} cannot be resolved: "
            "it is not in the hub cache and the hub cannot be reached (HF_HUB_OFFLINE=1, or no network). Run "
            "prepare where the hub is reachable once, or check the revision.") from error


def _absolute_model_directory(cfg: RunConfig) -> RunConfig:
    """A relative local `model` directory as an absolute path, from the cwd when it exists there, else from the
    repository (as local_or_hub): the workers run in directories of their own."""
    if cfg.is_preset_model or "://" in cfg.model or Path(cfg.model).is_absolute():
        return cfg
    absolute = local_or_hub(cfg.model)
    if not is_model_location(absolute):
        return cfg
    return cfg.replace(model=absolute, **({"tokenizer": absolute} if cfg.tokenizer == cfg.model else {}))


def check_base_checkpoint(directory: str, block_size: int | None, setting: str) -> None:
    """Refuse, as a ConfigError that starts with `setting`, a checkpoint the workers could not load: another
    architecture (naming the supported ones), a missing, extra or mis-shaped tensor, an index whose shards leave
    the directory, an unsupported dtype, a block size beyond its positions. Reads config.json and the files'
    headers only (trainer/decoders/pretrained.py)."""
    from trainer.decoders.architectures import CheckpointError
    from trainer.decoders.pretrained import check_checkpoint

    try:
        check_checkpoint(directory, block_size=block_size)
    except CheckpointError as error:
        raise ConfigError(f"{setting}: {error}") from None


def check_model_setting(cfg: RunConfig) -> None:
    """The run's model, when it is a checkpoint directory (a path, a URL, a cached hub model or a promoted version),
    checked before any worker starts; presets need no check."""
    from tasks.legacy_models import LEGACY_WEIGHTS, is_legacy_model

    if cfg.is_preset_model:
        return
    setting = f"Setting 'model' = {cfg.model!r}"
    if is_legacy_model(cfg.model):
        raise ConfigError(f"{setting} holds {LEGACY_WEIGHTS} only, transformers 4.57's TF format, which the trainer "
                          "no longer reads: use a Hugging Face checkpoint directory (config.json + model.safetensors), "
                          "or convert this one once with `python -m tasks.legacy_models <its URL>`.")
    check_base_checkpoint(cfg.model, cfg.block_size, setting)


def publish_snapshot(snapshot: Path, url: str, name: str, revision: str) -> BaseModelRecord:
    """Copy the snapshot's files to `url`, the record written last (a stage renamed whole when local)."""
    files = sorted(path for path in snapshot.iterdir()
                   if path.is_file() and any(fnmatch.fnmatchcase(path.name, pattern) for pattern in FILES))
    record = BaseModelRecord(format_version=1, name=name, revision=revision, sha=snapshot.name, fetched_at=utc_now(),
                             files=tuple(SnapshotFile(path.name, path.stat().st_size) for path in files))
    with staging_directory(url) as stage:
        for path in files:
            shutil.copyfile(path, stage / path.name)  # the cache's symlinks resolved to their blobs
        publish_directory(stage, url, last=(BASE_MODEL_RECORD,
                                            (json.dumps(record.to_xcom(), indent=2) + "\n").encode()))
    return record


def pinned_base(cfg: RunConfig) -> BasePin | None:
    """The cached hub model a prepared config trains from, else None."""
    if not cfg.model_revision or not exists(join(cfg.model, BASE_MODEL_RECORD)):
        return None
    record = BaseModelRecord.read(join(cfg.model, BASE_MODEL_RECORD))
    return BasePin(name=record.name, revision=record.revision, sha=record.sha, url=cfg.model)


__all__ = ["DEFAULT_REVISION", "FILES", "BaseModelRecord", "BasePin", "check_base_checkpoint", "check_model_setting",
           "fetch_snapshot", "is_hub_name", "pinned_base", "publish_snapshot", "resolve_base_model", "resolve_sha"]
