"""The documents the prepare stage hands on by XCom: the dataset plan (`prepare` -> the mapped `tokenize` tasks and
`publish`) and the prepared dataset it carries when `prepare` prepared the dataset itself.

The whole plan (its job, sources and units, `tasks.dataset.records.WorkPlan`) is not one of them: it lies in the run's
own storage, and whoever reads it finds it from the plan's ids and checks it there (tasks/dataset/checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.document import Document
from tasks.ledger.pricing import Price
from tasks.registry import PromotedVersion


@dataclass(frozen=True)
class PreparedDataset(Document):
    """A published (or reused) dataset: what `finish_dataset` and `prepare_dataset` return.

    Attributes:
        manifest_url: its manifest.json; fingerprint: its fingerprint (names its directory).
        cache_hit: it was complete already, nothing was tokenized.
        train_sequences, validation_sequences, train_tokens: its size.
        tokenized_tokens: tokens produced by this stage (0 on a cache hit), EOS and dropped remainders included.
        elapsed_s: the stage's seconds; timings: seconds per step (plan, units: the longest unit, shards, manifest).
        source_bytes_read: what the units fetched from storage (about the sources' size: no whole-file copies).
    """

    manifest_url: str
    fingerprint: str
    cache_hit: bool
    train_sequences: int
    validation_sequences: int
    train_tokens: int
    tokenized_tokens: int
    elapsed_s: float
    timings: dict[str, float]
    source_bytes_read: int


@dataclass(frozen=True)
class DatasetPlan(Document):
    """What `prepare` (`tasks.prepare.plan_run`) pushes under the XCom key `plan` for `tokenize` and `publish`:
    ids and a few numbers, never the plan's files or units.

    Attributes:
        fingerprint: the dataset's fingerprint; manifest_url: where its manifest is (or will be) published.
        cache_hit: the dataset was complete already: nothing to tokenize.
        config: the run's validated configuration (`RunConfig.to_dict()`), the one copy in flight; each task holds
            it to the access policy again.
        continued_from: the promoted version the run continues from (`model: promoted`), else None.
        price: the rate prepare froze (tasks/ledger/pricing.py), else None.
        plan_id: the plan's id (12 hex digits) when it tokenizes; with the fingerprint it names where the whole
            plan lies under the storage root. None for a cache hit.
        plan_url: that plan.json, when mapped tasks tokenize (None when prepare did it all, or for a cache hit).
        units, lanes: how many units, dealt into how many lanes (one mapped task each); None for a cache hit.
        dataset: the prepared dataset when `prepare` prepared it itself (one lane, or a cache hit), else None.
    """

    fingerprint: str
    manifest_url: str
    cache_hit: bool
    config: dict[str, Any]
    continued_from: PromotedVersion | None = None
    price: Price | None = None
    plan_id: str | None = None
    plan_url: str | None = None
    units: int | None = None
    lanes: int | None = None
    dataset: PreparedDataset | None = None
