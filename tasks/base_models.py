"""Base models from the hub, fetched once, pinned and cached (the prepare task).

A hub name in `model` (`gpt2`, `openai-community/gpt2`) is resolved once, in prepare, to the commit sha of
`model_revision` (default `main`, the current head, recorded), and its TF weights, config and tokenizer files are
copied once per (name, sha) to `storage_root/models/base/<name>@<sha>/` (`/` in a name becomes `--`), published
like every other directory: staged, then `base_model.json` last. A directory without that record (a killed
prepare) is never used: the next prepare fetches it again. The run's config then names that directory in `model`
(and in `tokenizer` when it named the same hub model) and the sha in `model_revision`, so the workers, the
baseline and evaluate load only from storage, never from the hub; the sha is part of the baseline key and of the
config every report and model card shows.

The hub is reached through huggingface_hub's cache (`HF_HOME`): a machine with `HF_HUB_OFFLINE=1` resolves names
and revisions from the cache alone.
"""

from __future__ import annotations

import contextlib
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
from core.layout import BASE_MODEL_RECORD, StorageLayout
from core.storage import exists, join, publish_directory, read_json, staging_directory
from trainer.model import is_model_location

log = logging.getLogger("gpt_finetune.base_models")

DEFAULT_REVISION = "main"
# What a TF GPT-2 needs: its config, TF weights and tokenizer. PyTorch, Flax and ONNX weights are never fetched.
FILES = ("config.json", "generation_config.json", "tf_model.h5", "tokenizer.json", "tokenizer_config.json",
         "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json")
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
    return not (cfg.is_preset_model or cfg.promoted_source is not None or is_model_location(cfg.model))


def resolve_base_model(cfg: RunConfig,
                       cache_dir: str | Path | None = None) -> tuple[RunConfig, BaseModelRecord | None]:
    """For a hub name in `model`: the config that loads it from its cached copy in storage (`model`), and that copy's
    record (fetched now when no complete copy exists). Other models: unchanged, None. Raises ConfigError naming the
    revision or the model when the revision cannot be resolved or the files are not a TF GPT-2."""
    if not is_hub_name(cfg):
        return cfg, None
    revision = cfg.model_revision or DEFAULT_REVISION
    with _hub_errors(cfg.model, revision):
        sha = resolve_sha(cfg.model, revision, cache_dir)
        url = StorageLayout(cfg.storage_root).base_model(cfg.model, sha)
        record_url = join(url, BASE_MODEL_RECORD)
        if exists(record_url):  # complete: its record is written last
            record = BaseModelRecord.read(record_url)
            log.info("Base model %s@%s (revision %r): reusing %s, nothing fetched", cfg.model, sha, revision, url)
        else:
            record = publish_snapshot(fetch_snapshot(cfg.model, revision, sha, cache_dir), url, cfg.model, revision)
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


def fetch_snapshot(name: str, revision: str, sha: str, cache_dir: str | Path | None = None) -> Path:
    """The files of `name` at commit `sha` (TF weights, config, tokenizer only), through the hub cache; checked to
    be a TF GPT-2."""
    from huggingface_hub import snapshot_download

    snapshot = Path(snapshot_download(name, revision=sha, allow_patterns=list(FILES), cache_dir=cache_dir))
    check_gpt2(name, revision, snapshot)
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


def check_gpt2(name: str, revision: str, snapshot: Path) -> None:
    config_file = snapshot / "config.json"
    model_type = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    problems = [] if model_type == "gpt2" else [f"model_type {model_type!r}, not 'gpt2'"]
    if not (snapshot / "tf_model.h5").is_file():
        problems.append("no tf_model.h5 (TensorFlow weights)")
    if problems:
        raise ConfigError(f"Setting 'model' = {name!r} (revision {revision!r}, commit {snapshot.name}): its files are "
                          f"not a TF GPT-2: {'; '.join(problems)}. Use a GPT-2 model with TensorFlow weights.")


def publish_snapshot(snapshot: Path, url: str, name: str, revision: str) -> BaseModelRecord:
    """Copy the snapshot's files to `url`, the record written last (a stage renamed whole when local)."""
    files = sorted(path for path in snapshot.iterdir() if path.name in FILES and path.is_file())
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


__all__ = ["DEFAULT_REVISION", "FILES", "BaseModelRecord", "BasePin", "fetch_snapshot", "is_hub_name", "pinned_base",
           "publish_snapshot", "resolve_base_model", "resolve_sha"]
