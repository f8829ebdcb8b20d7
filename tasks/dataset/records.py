"""The records the prepare stage's tasks hand each other while it runs, as documents (core/document.py):

- the lanes `prepare` returns and each mapped `tokenize` takes (XCom): lists of `Unit`;
- the whole plan, `plan.json` in the plan's work directory (`WorkPlan`, read back checked by
  `tasks.dataset.checks.checked_plan`), with what every unit shares (`UnitJob`);
- a unit's result, `NNNNN.json` beside its streams, the mark that it is complete (`UnitResult`);
- what a `tokenize` task returns (XCom): `LaneResult`.

Each is read where it is used and refused, naming its file or the lane and the field, when it has another shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from core import storage
from core.document import Document, DocumentError
from core.layout import SPLITS
from tasks.dataset.manifest import PackingSettings
from tasks.dataset.sources import SourceFile


@dataclass(frozen=True)
class Part(Document):
    """A piece of a unit: `file` (index into the plan's sources), `start` and `end` (exclusive) in bytes, or in
    row groups for Parquet, and the text `bytes` it holds (row groups: their uncompressed text column)."""

    file: int
    start: int
    end: int
    bytes: int


@dataclass(frozen=True)
class Unit(Document):
    """A work unit: its `index` (the order of its streams in the dataset's) and its `parts`, in source order."""

    index: int
    parts: tuple[Part, ...]

    @property
    def bytes(self) -> int:
        return sum(part.bytes for part in self.parts)


@dataclass(frozen=True)
class UnitJob(Document):
    """What every unit of one plan shares (the plan's `job`).

    Attributes:
        plan_id: the plan's id; work_url: its work directory, where the units' outputs go.
        tokenizer_dir: the saved tokenizer (`tokenizer.json`), locally or in storage.
        kind (text | jsonl | parquet), text_column, max_document_bytes: how documents are read.
        seed, val_fraction: the split's draws; dtype, eos_token, eos_id: the token ids written.
        joined: documents are joined at the EOS into one tokenizer input (tasks.dataset.encode.joins_at_eos).
        sources: the plan's files.
    """

    plan_id: str
    work_url: str
    tokenizer_dir: str
    kind: str
    text_column: str
    seed: int
    val_fraction: float
    dtype: str
    eos_token: str
    eos_id: int
    joined: bool
    sources: tuple[SourceFile, ...]
    max_document_bytes: int

    def result_url(self, unit: int) -> str:
        return storage.join(self.work_url, f"{unit:05d}.json")

    def stream_url(self, unit: int, split: str) -> str:
        return storage.join(self.work_url, f"{unit:05d}.{split}.bin")


@dataclass(frozen=True)
class TokenizerEntry(Document):
    """The plan's tokenizer: `spec` (the setting), `fingerprint`, `vocab_size`, `eos_token_id`."""

    spec: str
    fingerprint: str
    vocab_size: int
    eos_token_id: int


@dataclass(frozen=True)
class WorkPlan(Document):
    """The whole plan of a dataset to tokenize (`plan.json` when mapped tasks tokenize it).

    Attributes:
        fingerprint, manifest_url: the dataset's, and where its manifest is published.
        job: what its units share; units, lanes: how many units, in how many lanes.
        settings: the packing settings (the manifest's); tokenizer: the tokenizer the units load.
        temporary_work: its work directory is local to the process that planned (one lane: no plan.json).
        plan_s: the seconds planning took (the manifest step's timing `plan`).
    """

    fingerprint: str
    manifest_url: str
    job: UnitJob
    units: int
    lanes: int
    settings: PackingSettings
    tokenizer: TokenizerEntry
    temporary_work: bool
    plan_s: float


@dataclass(frozen=True)
class Extreme(Document):
    """One split's document with the lowest (train) or highest (validation) draw in a unit: the one the "at least
    one validation document, never all" rule may move, with its span in the unit's stream of that split (`offset`:
    tokens before it)."""

    draw: float
    offset: int
    tokens: int


@dataclass(frozen=True)
class SplitStream(Document):
    """A unit's stream of one split: its `documents`, `tokens`, `bytes` and `sha256`, and its `extreme` document
    (None when it holds none)."""

    documents: int
    tokens: int
    bytes: int
    sha256: str
    extreme: Extreme | None


@dataclass(frozen=True)
class UnitResult(Document):
    """A unit's result (`NNNNN.json`, written after its streams): the `plan_id` it belongs to, the `unit` index,
    its streams per split (`splits`), its text `bytes`, the `fetched_bytes` it read from storage, `wall_s` and
    `cpu_s`."""

    plan_id: str
    unit: int
    splits: dict[str, SplitStream]
    bytes: int
    fetched_bytes: int
    wall_s: float
    cpu_s: float

    def __post_init__(self) -> None:
        if sorted(self.splits) != sorted(SPLITS):
            raise DocumentError(f"UnitResult.splits: expected the splits {', '.join(SPLITS)}, got "
                                f"{', '.join(map(str, self.splits)) or 'none'}: refusing the document.")

    @property
    def documents(self) -> int:
        return sum(stream.documents for stream in self.splits.values())

    @property
    def tokens(self) -> int:
        return sum(stream.tokens for stream in self.splits.values())


@dataclass(frozen=True)
class LaneResult(Document):
    """What a `tokenize` task returns (XCom): the `units` of its lane, the `tokens` they hold, their `wall_s`."""

    units: tuple[int, ...]
    tokens: int
    wall_s: float
