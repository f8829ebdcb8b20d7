"""A published dataset's `manifest.json` as a document (docs/CONTRACTS.md, "Shards"): what `publish` writes last
and what the next preparation of the same fingerprint reads back to reuse the dataset (`tasks.dataset.publish.
complete_manifest`, which refuses one of another shape by its field). The JSON is the dataclasses' `to_xcom()`,
written with sorted keys; the trainer reads the same file with its own checks (`trainer.data.load_manifest`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from core.document import Document, DocumentError
from core.layout import SPLITS
from tasks.dataset.sources import SourceFile


@dataclass(frozen=True)
class PackingSettings(Document):
    """How documents become sequences: part of the fingerprint, in the plan and in the manifest (`settings`).

    Attributes:
        documents: what a document is ("paragraphs", or "rows of 'text'"); text_column: the column read.
        val_fraction, split_rule, seed: the validation split's draws (`tasks.dataset.split`).
        block_size: tokens per sequence; num_shards: training shards; max_validation_shards: at most that many
            validation shards (one per worker); sequences_per_record: sequences in one TFRecord record.
        max_document_bytes: where a longer document is cut (`tasks.dataset.readers`).
    """

    documents: str
    text_column: str
    val_fraction: float
    split_rule: str
    seed: int
    block_size: int
    num_shards: int
    max_validation_shards: int
    sequences_per_record: int
    max_document_bytes: int


@dataclass(frozen=True)
class FileEntry(Document):
    """A file of the dataset's tokenizer directory: its `name` there, `bytes` and `sha256`."""

    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardEntry(Document):
    """A TFRecord shard: its file `name`, `records`, `sequences`, `tokens` (sequences x block_size), `bytes` and
    `sha256`."""

    name: str
    records: int
    sequences: int
    tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SplitEntry(Document):
    """A split: its `documents`, `sequences`, `tokens` and its `shards` in order."""

    documents: int
    sequences: int
    tokens: int
    shards: tuple[ShardEntry, ...]


@dataclass(frozen=True)
class ManifestTokenizer(Document):
    """The dataset's tokenizer: `spec` (the setting), `fingerprint`, `vocab_size`, `eos_token_id`, its directory
    `path` beside the manifest (`tokenizer`) and the `files` in it."""

    spec: str
    fingerprint: str
    vocab_size: int
    eos_token_id: int
    path: str
    files: tuple[FileEntry, ...]


@dataclass(frozen=True)
class PrepareCounts(Document):
    """How the dataset was prepared: `units` tokenized in `lanes` (mapped tasks); not part of the fingerprint."""

    units: int
    lanes: int


@dataclass(frozen=True)
class Manifest(Document):
    """`manifest.json`.

    Attributes:
        format_version: trainer.data.FORMAT_VERSION; fingerprint: the dataset's (names its directory).
        created_at: when it was published (ISO 8601, UTC); dtype: the token ids' (uint16 | uint32).
        block_size, sequences_per_record: the sequences' length and how many a record holds.
        tokenizer: the tokenizer shipped beside the shards; sources: the files it was prepared from.
        settings: the packing settings the fingerprint covers; splits: `train` and `validation`.
        prepare: the units and lanes it took.
    """

    format_version: int
    fingerprint: str
    created_at: str
    dtype: str
    block_size: int
    sequences_per_record: int
    tokenizer: ManifestTokenizer
    sources: tuple[SourceFile, ...]
    settings: PackingSettings
    splits: dict[str, SplitEntry]
    prepare: PrepareCounts

    def __post_init__(self) -> None:
        if sorted(self.splits) != sorted(SPLITS):
            raise DocumentError(f"Manifest.splits: expected the splits {', '.join(SPLITS)}, got "
                                f"{', '.join(map(str, self.splits)) or 'none'}: refusing the document.")

    def to_bytes(self) -> bytes:
        """The file's bytes: indented, keys sorted."""
        return (json.dumps(self.to_xcom(), indent=2, sort_keys=True) + "\n").encode("utf-8")
