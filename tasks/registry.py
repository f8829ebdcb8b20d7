"""The model registry: promoted versions of a named model under `<root>/models/<name>/` and its `latest` pointer.

    latest.json            the pointer, the one record readers trust: the current version and the history
    claims/v<N>.json       created exclusively: version number N belongs to one promotion
    v<N>/model/            save_pretrained model and tokenizer
    v<N>/report.json, v<N>/model_card.md
    v<N>/version.json      written last in the version: every file with its size

Concurrent promotions (runs of other DAGs or deployments on the same storage) need no lock server: a version
number is claimed by an exclusive create, and the pointer moves only by compare-and-swap from the pointer the
promotion decided against (S3: a conditional PUT with If-Match / If-None-Match; local disk: an atomic rename under
an flock, which the kernel releases when the holder dies). The pointer is written after the version is complete,
so a promotion killed at any point leaves `latest` on a complete version; its half-written `v<N>/` is in no
history and is never read. The exclusive create and the compare-and-swap are `core.storage.conditional`'s. Importable
without Airflow and TensorFlow (the UI plugin reads it).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Self, TypeVar

from core.clock import utc_now
from core.document import Document, DocumentError
from core.layout import ADAPTER_CONFIG, ModelLayout, StorageLayout, VersionLayout
from core.storage import copy_tree as storage_copy_tree
from core.storage import (
    exists,
    filesystem,
    join,
    list_dir,
    read_bytes,
    read_json,
)
from core.storage.conditional import compare_and_swap, create_exclusive, read_with_token
from tasks.base_models import BasePin

POINTER_FORMAT_VERSION = 1
MAX_CLAIM_ATTEMPTS = 1000


class RegistryError(RuntimeError):
    """The registry cannot be read or written as promised (a malformed pointer, a swap that keeps losing)."""


def model_layout(storage_root: str, name: str) -> ModelLayout:
    return StorageLayout(storage_root).model(name)


# ---------------------------------------------------------------------------------------------------------------
# the documents (docs/CONTRACTS.md, "Model registry"). The pointer and version.json come back from storage, which
# whoever may write it could edit: reading checks every field (core/document.py). Fields added after the first
# promotions default to what those files meant (absent: unknown).


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry(Document):
    """A promoted version as the pointer records it: latest.json's top level (the current version) and each entry of
    its `history`.

    Attributes:
        version: `v<N>`; number: N. url: the version's directory `models/<name>/v<N>/`; model_url: its `model/`.
        run_id, run_key: the run promoted; promoted_at: when (`core.clock.utc_now`).
        eval_loss, perplexity: the run's, on its evaluation sample; eval_loss_se: that loss's standard error (0 for
            the whole split; None before samples); eval_sample: the sample's id (None before samples).
        dataset_fingerprint: the dataset it was trained and scored on; run_report_url: the run's report.json.
    """

    version: str
    number: int
    url: str
    model_url: str
    run_id: str
    run_key: str
    promoted_at: str
    eval_loss: float
    perplexity: float
    eval_loss_se: float | None = None
    eval_sample: str | None = None
    dataset_fingerprint: str
    run_report_url: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pointer(Entry):
    """latest.json, the one record readers trust: the current version's `Entry` at the top level, with the model's
    `name`, `format_version` (POINTER_FORMAT_VERSION) and `history`, every promoted version in order (the current
    one last)."""

    format_version: int
    name: str
    history: tuple[Entry, ...]

    @classmethod
    def moved_to(cls, entry: Entry, name: str, before: Pointer | None) -> Self:
        """The pointer after `entry` was promoted under `name` (`before`: the pointer it replaces, None: the first)."""
        fields = {field.name: getattr(entry, field.name) for field in dataclasses.fields(Entry)}
        return cls(**fields, format_version=POINTER_FORMAT_VERSION, name=name,
                   history=(*(before.history if before else ()), entry))


@dataclasses.dataclass(frozen=True)
class Claim(Document):
    """claims/v<N>.json, created exclusively: version N belongs to `run_id` since `claimed_at` (never read back; its
    name alone counts)."""

    run_id: str
    claimed_at: str
    version: str


@dataclasses.dataclass(frozen=True)
class VersionFile(Document):
    """A file of a version: its path under `v<N>/` and its size, which a complete version's file has."""

    name: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class AdapterBase(Document):
    """The exact base model a LoRA version's `adapter/` applies to (its adapter_config.json's fields,
    trainer/adapter_export.py): a hub name and commit sha, a local path and content sha256, or a preset and seed."""

    base_model_name_or_path: str
    revision: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionRecord(Document):
    """v<N>/version.json, written last in a version: the promoted run's figures (as its `Entry`), when the version
    was made (`created_at`), the pinned hub model it was fine-tuned from (`base_model`, tasks/base_models.py; None
    for a preset, a promoted or a local model, and before it was recorded), a LoRA version's `adapter_base` (what its
    adapter/ needs; None without one) and every file with its size (`files`)."""

    format_version: int
    name: str
    version: str
    run_id: str
    run_key: str
    created_at: str
    eval_loss: float
    perplexity: float
    eval_loss_se: float | None = None
    eval_sample: str | None = None
    dataset_fingerprint: str
    base_model: BasePin | None = None
    adapter_base: AdapterBase | None = None
    files: tuple[VersionFile, ...]


@dataclasses.dataclass(frozen=True)
class PromotedVersion(Document):
    """The promoted version a run continues from (`model: promoted[:<name>]`; the prepared run's `continued_from`,
    and report.json's): the model `name`, and its entry's `version`, `url`, `model_url`, `run_id` and `eval_loss`."""

    name: str
    version: str
    url: str
    model_url: str
    run_id: str
    eval_loss: float

    @classmethod
    def of(cls, name: str, entry: Entry) -> Self:
        return cls(name=name, version=entry.version, url=entry.url, model_url=entry.model_url, run_id=entry.run_id,
                   eval_loss=entry.eval_loss)


D = TypeVar("D", bound=Document)


def _checked(kind: type[D], url: str, value: Any, fix: str) -> D:
    """`value` (read from `url`) as a `kind`; RegistryError naming the file, the field and `fix` otherwise."""
    try:
        return kind.from_xcom(value)
    except DocumentError as error:
        raise RegistryError(f"{url}: {error} {fix}") from error


# ---------------------------------------------------------------------------------------------------------------
# the pointer


def read_latest(layout: ModelLayout) -> Pointer | None:
    """The pointer of a registered model, or None when nothing was promoted under that name."""
    return read_pointer(layout)[0]


def read_pointer(layout: ModelLayout) -> tuple[Pointer | None, str | None]:
    """The pointer of `layout` and the token a swap from it needs (`core.storage.conditional.read_with_token`)."""
    data, token = read_with_token(layout.latest)
    return (None, None) if data is None else (_parse_pointer(layout, data), token)


_DAMAGED = ("The registry pointer is damaged: restore it (each version's version.json holds its entry's figures), "
            "or promote under another 'model_name'.")


def _parse_pointer(layout: ModelLayout, data: bytes) -> Pointer:
    url = layout.latest
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise RegistryError(f"{url} is not valid JSON ({error}): the registry pointer is damaged.") from error
    pointer = _checked(Pointer, url, value, _DAMAGED)
    for where, entry in (("Pointer", pointer), *((f"Pointer.history[{index}]", entry)
                                                 for index, entry in enumerate(pointer.history))):
        _check_place(layout, url, where, entry)
    return pointer


def _check_place(layout: ModelLayout, url: str, where: str, entry: Entry) -> None:
    """An entry names its own version's folder and model only: whoever writes storage could otherwise make evaluate
    fetch, or `model: promoted` train from, any URL (another bucket, an internal service, a local directory)."""
    if entry.number < 1:
        raise RegistryError(f"{url}: {where}.number = {entry.number!r} is no version number (1 or more). {_DAMAGED}")
    version = layout.version(entry.number)
    expected = {"version": f"v{entry.number}", "url": version.url, "model_url": version.model}
    wrong = [f"{where}.{name} = {getattr(entry, name)!r} (it must be {value!r})" for name, value in expected.items()
             if getattr(entry, name) != value]
    if wrong:
        raise RegistryError(f"{url}: {'; '.join(wrong)}: a pointer names only its version's folder "
                            f"{layout.url}/v<number>/. {_DAMAGED}")


def swap_pointer(url: str, expected_token: str | None, pointer: Pointer) -> bool:
    """Write `pointer` only if the stored one is still the one `expected_token` names (None: still absent).

    True when written; False when another promotion moved it first (read it again and decide again)."""
    return compare_and_swap(url, expected_token, _json_bytes(pointer))


def _json_bytes(document: Document) -> bytes:
    return (json.dumps(document.to_xcom(), indent=2, sort_keys=True) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------------------------
# versions


def claim_version(layout: ModelLayout, above: int, run_id: str) -> int:
    """The lowest free version number above `above` and every claimed one, now owned by run `run_id`."""
    claimed = [int(name[1:-5]) for name in list_dir(layout.claims)
               if name.startswith("v") and name.endswith(".json") and name[1:-5].isdigit()]
    number = max([above, *claimed]) + 1
    for _ in range(MAX_CLAIM_ATTEMPTS):
        if create_exclusive(layout.claim(number), _json_bytes(Claim(run_id, utc_now(), f"v{number}"))):
            return number
        number += 1
    raise RegistryError(f"No free version number under {layout.claims} after {MAX_CLAIM_ATTEMPTS} attempts.")


def copy_into(version: VersionLayout, folder: str, source_url: str) -> list[VersionFile]:
    """Copy a run's saved model (or one of its exports) into the version's `folder` within one storage (S3:
    server-side); the files, named from the version's directory, with their sizes."""
    try:
        copied = storage_copy_tree(source_url, join(version.url, folder))
    except FileNotFoundError:
        raise FileNotFoundError(f"{source_url} has no files: the run saved no model there.") from None
    return [VersionFile(f"{folder}/{file['name']}", file["bytes"]) for file in copied]


def adapter_base(adapter_url: str) -> AdapterBase:
    """The base a run's adapter (its adapter_config.json) names, checked."""
    url = join(adapter_url, ADAPTER_CONFIG)
    value = read_json(url)
    keys = [field.name for field in dataclasses.fields(AdapterBase)]
    fields = {key: value.get(key) for key in keys} if isinstance(value, dict) else value
    return _checked(AdapterBase, url, fields, "The adapter was not written by this project's trainer: train again.")


def same_tokenizer(model_url: str, tokenizer_dir_url: str) -> bool:
    """Whether two save_pretrained directories hold the same fast tokenizer (vocabulary, merges, special tokens),
    so that one's token ids mean the same to the other."""
    def identity(url: str) -> Any:
        spec = read_json(join(url, "tokenizer.json"))
        model = dict(spec.get("model") or {})
        # A tokenizer loaded and saved again by transformers 5 writes "" where the trained file held null (the BPE's
        # affixes) and merges as pairs where it held "a b" strings: the same tokenizer either way.
        for affix in ("continuing_subword_prefix", "end_of_word_suffix"):
            model[affix] = model.get(affix) or ""
        model["merges"] = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
        return model, spec.get("added_tokens")

    try:
        return identity(model_url) == identity(tokenizer_dir_url)
    except (FileNotFoundError, ValueError):
        return False


def complete_version(version: VersionLayout) -> VersionRecord | None:
    """version.json when the version and every file it lists exist, else None; RegistryError naming the file and
    the field when version.json is not one."""
    if not exists(version.record):
        return None
    try:
        value = json.loads(read_bytes(version.record).decode("utf-8"))
    except (ValueError, RecursionError) as error:
        raise RegistryError(f"{version.record} is not valid JSON ({error}): the version is damaged.") from error
    record = _checked(VersionRecord, version.record, value, "The version is damaged: restore it, or promote "
                      "another run.")
    fs, root = filesystem(version.url)
    for file in record.files:
        path = f"{root.rstrip('/')}/{file.name}"
        if not fs.exists(path) or fs.size(path) != file.bytes:
            return None
    return record


__all__ = ["Claim", "Entry", "Pointer", "PromotedVersion", "RegistryError", "VersionFile", "VersionRecord",
           "claim_version", "complete_version", "copy_into", "model_layout", "read_latest", "read_pointer",
           "swap_pointer"]
