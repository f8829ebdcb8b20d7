"""The access policy: which places a run's settings may name, set by the operator through the environment.

`dataset`, `model`, `tokenizer` and `storage_root` may name only presets, hub ids, local paths under the data roots
and `s3://` buckets on the allow-list. Every other scheme (`http://`, ...) and every `..` is refused, so that a user
who may trigger runs cannot make the workers fetch URLs or read files of the host.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from trainer.config.core import ConfigError
from trainer.layout import REPO_ROOT

DATA_ROOTS_ENV = "GPT_FINETUNE_DATA_ROOTS"
S3_BUCKETS_ENV = "GPT_FINETUNE_S3_BUCKETS"
STORAGE_ROOT_ENV = "GPT_FINETUNE_STORAGE_ROOT"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # `gpt2`, `openai-community/gpt2`
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")  # two letters at least: not a drive letter
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class AccessPolicy:
    """What run settings may reach, set by the operator through the environment (never by a run setting).

    data_roots: local directories that `dataset`, `model`, `tokenizer` and `storage_root` may lie under
        ($GPT_FINETUNE_DATA_ROOTS, separated by ':'; default: the repository's data/ and the storage root,
        $GPT_FINETUNE_STORAGE_ROOT or <repo>/storage). Relative entries are taken from the repository.
    s3_buckets: buckets that `s3://` settings may name ($GPT_FINETUNE_S3_BUCKETS, comma-separated; empty: any).
    """

    data_roots: tuple[str, ...]
    s3_buckets: frozenset[str]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AccessPolicy:
        configured = environ.get(DATA_ROOTS_ENV, "").strip()
        entries = configured.split(os.pathsep) if configured else [
            "data", environ.get(STORAGE_ROOT_ENV, "").strip() or "storage"]
        roots = tuple(os.path.realpath(REPO_ROOT / Path(entry.strip()).expanduser())
                      for entry in entries if entry.strip() and "://" not in entry)
        buckets = frozenset(b.strip() for b in environ.get(S3_BUCKETS_ENV, "").split(",") if b.strip())
        return cls(roots, buckets)

    def check_settings(self, cfg: Any) -> None:
        """Refuse a RunConfig whose `dataset`, `storage_root`, `model` or `tokenizer` reaches beyond this policy;
        a model preset or `promoted`, and a `bpe:<n>` tokenizer, reach nothing."""
        self.check("dataset", cfg.dataset, hub_ids=True)
        self.check("storage_root", cfg.storage_root, hub_ids=False)
        if cfg.promoted_source is None and not cfg.is_preset_model:
            self.check("model", cfg.model, hub_ids=True)
        if not cfg.tokenizer.startswith("bpe:"):
            self.check("tokenizer", cfg.tokenizer, hub_ids=True)

    def check(self, name: str, value: str, *, hub_ids: bool) -> None:
        """Refuse `value` of setting `name` unless it is a hub id (when `hub_ids`), an allowed bucket or a path
        under a data root. Presets are the caller's business."""
        if ".." in re.split(r"[/\\]", value):
            raise ConfigError(f"Setting '{name}' = {value!r} contains '..': name the location without it.")
        scheme = _URL_SCHEME.match(value)
        if scheme or "://" in value:
            kind = (scheme.group(1) if scheme else "").lower()
            if kind == "s3":
                return self._check_bucket(name, value)
            if kind == "file" and value.startswith("file:///"):
                return self._check_path(name, value[len("file://"):])
            raise ConfigError(
                f"Setting '{name}' = {value!r} uses the scheme '{kind}', which is not allowed: use a local path under "
                f"{list(self.data_roots)} (or file:///...), an s3:// URL"
                + (", or a hub id" if hub_ids else "") + "."
            )
        if hub_ids and is_hub_id(value):
            return None
        return self._check_path(name, value, from_repo=name == "storage_root")

    def _check_bucket(self, name: str, value: str) -> None:
        bucket = urlparse(value).netloc
        if not bucket:
            raise ConfigError(f"Setting '{name}' = {value!r} names no bucket: write s3://<bucket>/<path>.")
        if self.s3_buckets and bucket not in self.s3_buckets:
            raise ConfigError(
                f"Setting '{name}' = {value!r}: bucket '{bucket}' is not allowed; allowed buckets are "
                f"{sorted(self.s3_buckets)} (${S3_BUCKETS_ENV})."
            )

    def _check_path(self, name: str, value: str, *, from_repo: bool = False) -> None:
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = REPO_ROOT / path if from_repo else _local_candidate(value)
        # A glob is checked by the directory it searches; symlinks are followed, so a link out of a root is refused.
        fixed = Path(*[part for part in path.parts[:next(
            (i for i, part in enumerate(path.parts) if _GLOB_CHARS.search(part)), len(path.parts))]])
        real = os.path.realpath(fixed)
        if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in self.data_roots):
            raise ConfigError(
                f"Setting '{name}' = {value!r} is outside the allowed data roots {list(self.data_roots)}: move it "
                f"under one of them, or have the operator add its directory to ${DATA_ROOTS_ENV} (':'-separated)."
            )


def is_hub_id(value: str) -> bool:
    """A scheme-less setting that names a model or tokenizer on the hub (`gpt2`), not a local path that exists."""
    return bool(_HUB_ID.fullmatch(value)) and not _local_candidate(value).exists()


def _local_candidate(value: str) -> Path:
    """The path a relative setting names, as the stages resolve it: from the cwd when it exists there, else from
    the repository."""
    path = Path(value).expanduser()
    if path.is_absolute() or glob.glob(str(path)):
        return path.absolute()
    return REPO_ROOT / path
