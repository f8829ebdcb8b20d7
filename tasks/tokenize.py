"""The prepare stage: tokenize a dataset into verified TFRecord shards under `storage_root/datasets/<fingerprint>/`.

Order of work, cheapest checks first: resolve the source files, check the model's positions and the tokenizer,
compute the fingerprint, return at once when a complete manifest with that fingerprint exists, check that
`storage_root` is writable, and only then load, tokenize, pack and write. Everything is staged first (locally)
and published with the manifest last, so a run that dies leaves no manifest and the next run starts clean:
local roots get the whole staged directory renamed into place, object stores get the shards uploaded first and
`manifest.json` written after them.

Tokenizing, at the tokenizer's own speed: `encode_batch_fast` (no character offsets) spreads each batch over every
core with the tokenizer's thread pool while one writer thread appends the previous batch's ids to one flat file
per split (EOS after every document). Consecutive documents of a split go into one tokenizer input joined by the
EOS text where that provably gives the same ids, which saves a Python object per document. Then the streams are
cut into `block_size` sequences and equal shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from tasks.sources import SourceError, Sources, load_documents, resolve_sources
from tasks.tfrecord import write_sequence_records
from trainer import storage
from trainer.config import RunConfig
from trainer.data import FORMAT_VERSION
from trainer.layout import StorageLayout

log = logging.getLogger("gpt_finetune.prepare")

BPE_RECIPE = "bytelevel-bpe/v1"  # bump when the BPE training recipe changes: it is part of the fingerprint
EOS_TOKEN = "<|endoftext|>"
RECORD_TARGET_BYTES = 64 << 10  # many sequences per record keeps TFRecord framing far below 1% of the bytes
TOKENIZER_DIR = "tokenizer"
MANIFEST = "manifest.json"
REPO_ROOT = Path(__file__).resolve().parents[1]


class PrepareError(RuntimeError):
    """The dataset cannot be prepared as configured; the message names the file, key or setting to change."""


@dataclass(frozen=True)
class PreparedDataset:
    manifest_url: str
    fingerprint: str
    cache_hit: bool
    train_sequences: int
    validation_sequences: int
    train_tokens: int
    tokenized_tokens: int  # tokens produced by this call (0 on a cache hit), EOS and dropped remainders included
    elapsed_s: float


@dataclass(frozen=True)
class TokenizerPlan:
    spec: str
    fingerprint: str
    dtype: str
    pretrained: Any | None  # a loaded PreTrainedTokenizerFast, or None when a BPE is trained here


@dataclass(frozen=True)
class DatasetIdentity:
    """Everything the fingerprint covers, resolved from a RunConfig without tokenizing anything."""

    sources: Sources
    tokenizer: TokenizerPlan
    settings: dict[str, Any]
    fingerprint: str


def identify_dataset(cfg: RunConfig) -> DatasetIdentity:
    """Resolve sources, check the model's positions and the tokenizer, and compute the fingerprint."""
    sources = _resolve(cfg)
    check_block_size(cfg)
    plan = plan_tokenizer(cfg)
    settings = packing_settings(cfg, sources, plan)
    return DatasetIdentity(sources, plan, settings, dataset_fingerprint(sources, plan, settings))


def prepare_dataset(
    cfg: RunConfig, *, progress_interval_s: float = 5.0, started: float | None = None,
) -> PreparedDataset:
    """Tokenize `cfg.dataset` into shards + manifest under `cfg.storage_root`, or reuse a complete earlier result.

    `started` is the `time.perf_counter()` at which the calling task began (default: this call), so that the rate
    logged counts the stage's start-up too: imports on first use, loading the tokenizer, reading the sources.
    Raises `PrepareError` naming the file, key or setting at fault; on any failure no manifest is published.
    """
    started = time.perf_counter() if started is None else started
    layout = StorageLayout(cfg.storage_root)
    identity = identify_dataset(cfg)
    sources, plan, settings, fingerprint = identity.sources, identity.tokenizer, identity.settings, identity.fingerprint
    manifest_url = layout.manifest(fingerprint)
    log.info(
        "dataset %s: %d file(s), %s; tokenizer %s; block_size %d; fingerprint %s",
        cfg.dataset, len(sources.files), _human_bytes(sum(f.size for f in sources.files)), cfg.tokenizer,
        cfg.block_size, fingerprint,
    )

    cached = complete_manifest(manifest_url, fingerprint)
    if cached is not None:
        log.info("cache hit: %s is complete, reusing it without tokenizing", manifest_url)
        return _result(manifest_url, cached, cache_hit=True, tokenized=0, started=started)

    _check_writable(cfg.storage_root)
    with tempfile.TemporaryDirectory(prefix=f"prepare-{fingerprint}-") as workdir, _staging(layout, fingerprint) as stage:
        manifest, stats = _build(cfg, sources, plan, settings, fingerprint, stage, Path(workdir), progress_interval_s)
        _publish(stage, layout.dataset(fingerprint), manifest)
    elapsed = time.perf_counter() - started
    start_up = stats.began - started
    log.info(
        "published %s: %d train / %d validation sequences", manifest_url, manifest["splits"]["train"]["sequences"],
        manifest["splits"]["validation"]["sequences"],
    )
    log.info(
        "prepare: %d tokens in %.2fs = %s tokens/s end to end on %d core(s): start-up %.2fs (imports, tokenizer, "
        "reading), tokenizing %.2fs at %s tokens/s with %.1f cores busy, shards and publishing %.2fs; end to end "
        "ran at %.2fx the tokenizing rate",
        stats.tokens, elapsed, _human_rate(stats.tokens / elapsed), stats.cores, start_up, stats.wall_s,
        _human_rate(stats.tokens / max(stats.wall_s, 1e-9)), stats.cpu_s / max(stats.wall_s, 1e-9),
        elapsed - start_up - stats.wall_s, stats.wall_s / elapsed,
    )
    return _result(manifest_url, manifest, cache_hit=False, tokenized=stats.tokens, started=started)


# ---------------------------------------------------------------------------------------------------------------
# checks and fingerprint (cheap, before any tokenizing)


def _resolve(cfg: RunConfig) -> Sources:
    try:
        return resolve_sources(cfg.dataset, REPO_ROOT)
    except SourceError as error:
        raise PrepareError(str(error)) from error


def check_block_size(cfg: RunConfig) -> None:
    """Refuse a block size the model cannot embed; presets are already checked by RunConfig."""
    if cfg.is_preset_model:
        return
    config = _model_config(cfg.model)
    positions = config.get("n_positions") or config.get("max_position_embeddings")
    if positions is None:
        raise PrepareError(
            f"Model {cfg.model!r}: its config.json has neither n_positions nor max_position_embeddings, so "
            "'block_size' cannot be checked. Use a GPT-2 style model."
        )
    if cfg.block_size > positions:
        raise PrepareError(
            f"Setting 'block_size' = {cfg.block_size} exceeds what model {cfg.model!r} allows ({positions} "
            "positions): lower 'block_size'."
        )


def _model_config(model: str) -> dict[str, Any]:
    if model.startswith("s3://"):
        url = storage.join(model, "config.json")
        try:
            return storage.read_json(url)
        except FileNotFoundError as error:
            raise PrepareError(f"Setting 'model' = {model!r}: {url} does not exist.") from error
    from transformers import AutoConfig

    location = _local_or_hub(model.removeprefix("file://"))
    try:
        return AutoConfig.from_pretrained(location).to_dict()
    except (OSError, ValueError) as error:
        raise PrepareError(
            f"Setting 'model' = {model!r} is no preset, no readable save_pretrained directory and no hub model "
            f"reachable from here: {error}"
        ) from error


def _local_or_hub(name: str) -> str:
    """A relative local path is taken from the repository root when it does not exist from the cwd."""
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser().resolve())
    if (REPO_ROOT / name).exists():
        return str(REPO_ROOT / name)
    return name


def plan_tokenizer(cfg: RunConfig) -> TokenizerPlan:
    vocab = cfg.bpe_vocab_size
    if vocab is not None:
        # Trained on the training split, so sources and settings (in the fingerprint too) determine it fully.
        return TokenizerPlan(cfg.tokenizer, _sha256_text(f"{BPE_RECIPE}:{vocab}:{EOS_TOKEN}"), _dtype_for(vocab), None)
    tokenizer = load_pretrained_tokenizer(cfg.tokenizer)
    # The serialized tokenizer as it is: deterministic for a tokenizers version (vocabularies in id order), and
    # hashing it directly saves parsing and re-sorting megabytes of JSON on every run, cache hits included.
    identity = f"eos={tokenizer.eos_token!r}\n{tokenizer.backend_tokenizer.to_str()}"
    return TokenizerPlan(cfg.tokenizer, _sha256_text(identity), _dtype_for(len(tokenizer)), tokenizer)


def load_pretrained_tokenizer(spec: str):
    """A fast tokenizer with an EOS token from a hub name, a local directory or an object-storage URL."""
    from transformers import AutoTokenizer

    try:
        if spec.startswith("s3://"):
            with tempfile.TemporaryDirectory(prefix="tokenizer-") as local:
                if not storage.download_tree(spec, local):
                    raise PrepareError(f"Setting 'tokenizer' = {spec!r}: nothing found at that URL.")
                tokenizer = AutoTokenizer.from_pretrained(local, use_fast=True)
        else:
            tokenizer = AutoTokenizer.from_pretrained(_local_or_hub(spec.removeprefix("file://")), use_fast=True)
    except (OSError, ValueError) as error:
        raise PrepareError(
            f"Setting 'tokenizer' = {spec!r} is no readable tokenizer directory and no hub tokenizer reachable "
            f"from here: {error}. Use bpe:<vocab size> to train one offline."
        ) from error
    if not tokenizer.is_fast:
        raise PrepareError(f"Setting 'tokenizer' = {spec!r} has no fast (Rust) implementation; use one that does.")
    if tokenizer.eos_token_id is None:
        raise PrepareError(
            f"Setting 'tokenizer' = {spec!r} defines no EOS token, which separates packed documents: "
            "use a tokenizer with eos_token set."
        )
    return tokenizer


def _dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def packing_settings(cfg: RunConfig, sources: Sources, plan: TokenizerPlan) -> dict[str, Any]:
    itemsize = np.dtype(plan.dtype).itemsize
    return {
        "documents": "paragraphs" if sources.builder == "text" else f"rows of {cfg.text_column!r}",
        "text_column": cfg.text_column,
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        "block_size": cfg.block_size,
        "num_shards": cfg.effective_num_shards,
        "max_validation_shards": cfg.num_workers,
        "sequences_per_record": max(1, RECORD_TARGET_BYTES // (cfg.block_size * itemsize)),
    }


def dataset_fingerprint(sources: Sources, plan: TokenizerPlan, settings: dict[str, Any]) -> str:
    identity = {
        "format_version": FORMAT_VERSION,
        "builder": sources.builder,
        "sources": [f.to_dict() for f in sources.files],
        "tokenizer": {"spec": plan.spec, "fingerprint": plan.fingerprint},
        "settings": settings,
    }
    return _sha256_text(json.dumps(identity, sort_keys=True))[:20]


def complete_manifest(manifest_url: str, fingerprint: str) -> dict[str, Any] | None:
    """The manifest when it and every file it lists exist with the listed sizes; None otherwise."""
    try:
        manifest = storage.read_json(manifest_url)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if manifest.get("fingerprint") != fingerprint or manifest.get("format_version") != FORMAT_VERSION:
        log.warning("%s belongs to another fingerprint or format; preparing again", manifest_url)
        return None
    fs, directory = storage.filesystem(manifest_url.rsplit("/", 1)[0])
    present = {
        os.path.relpath(info["name"], directory): int(info["size"])
        for info in fs.find(directory, detail=True).values()
    }
    expected = {shard["name"]: shard["bytes"] for split in manifest["splits"].values() for shard in split["shards"]}
    expected |= {f"{TOKENIZER_DIR}/{f['name']}": f["bytes"] for f in manifest["tokenizer"]["files"]}
    damaged = sorted(name for name, size in expected.items() if present.get(name) != size)
    if damaged:
        log.warning("%s lists files that are missing or resized (%s); preparing again", manifest_url, damaged[:5])
        return None
    return manifest


def _check_writable(root: str) -> None:
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


# ---------------------------------------------------------------------------------------------------------------
# building


def _build(
    cfg: RunConfig, sources: Sources, plan: TokenizerPlan, settings: dict[str, Any], fingerprint: str,
    stage: Path, workdir: Path, progress_interval_s: float,
) -> tuple[dict[str, Any], TokenizeStats]:
    try:
        documents = load_documents(sources, cfg.text_column, workdir / "hf-cache")
    except SourceError as error:
        raise PrepareError(str(error)) from error
    count = len(documents)
    if count == 0:
        raise PrepareError(f"Dataset {cfg.dataset!r} has no documents: {_file_list(sources)} are empty.")
    if count < 2:
        raise PrepareError(
            f"Dataset {cfg.dataset!r} has a single document, but the validation split needs one of its own: "
            "add data, or separate documents by blank lines in .txt files."
        )
    is_validation = validation_mask(count, cfg.val_fraction, cfg.seed)
    log.info("loaded %d documents: %d for training, %d for validation", count, count - is_validation.sum(),
             is_validation.sum())

    tokenizer = plan.pretrained or train_bpe(documents, is_validation, cfg.bpe_vocab_size, progress_interval_s)
    tokenizer.save_pretrained(str(stage / TOKENIZER_DIR))
    eos = tokenizer.eos_token_id
    streams, stats = tokenize_to_streams(
        documents, tokenizer.backend_tokenizer, tokenizer.eos_token, eos, np.dtype(plan.dtype), is_validation,
        workdir, progress_interval_s,
    )
    if stats.tokens == count:  # nothing but the EOS after every document
        raise PrepareError(f"Dataset {cfg.dataset!r} contains no text: {_file_list(sources)} yield no tokens.")

    block, per_record = cfg.block_size, settings["sequences_per_record"]
    train_sequences = streams["train"].stat().st_size // np.dtype(plan.dtype).itemsize // block
    validation_sequences = streams["validation"].stat().st_size // np.dtype(plan.dtype).itemsize // block
    if train_sequences < cfg.effective_num_shards:
        raise PrepareError(
            f"Dataset {cfg.dataset!r} gives {train_sequences} training sequences of {block} tokens, fewer than the "
            f"{cfg.effective_num_shards} shards to write: add data, lower 'block_size' or 'num_shards'."
        )
    if validation_sequences == 0:
        raise PrepareError(
            f"Dataset {cfg.dataset!r}: the validation split (val_fraction={cfg.val_fraction}) has fewer than "
            f"{block} tokens: raise 'val_fraction' or lower 'block_size'."
        )
    splits = {
        "train": write_split(streams["train"], "train", cfg.effective_num_shards, block, per_record, plan.dtype, stage),
        "validation": write_split(streams["validation"], "validation",
                                  min(settings["max_validation_shards"], validation_sequences),
                                  block, per_record, plan.dtype, stage),
    }
    for name, split in splits.items():
        split["documents"] = int(is_validation.sum() if name == "validation" else count - is_validation.sum())

    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "dtype": plan.dtype,
        "block_size": block,
        "sequences_per_record": per_record,
        "tokenizer": {
            "spec": plan.spec,
            "fingerprint": plan.fingerprint,
            "vocab_size": len(tokenizer),
            "eos_token_id": eos,
            "path": TOKENIZER_DIR,
            "files": _file_entries(stage / TOKENIZER_DIR),
        },
        "sources": [f.to_dict() for f in sources.files],
        "settings": settings,
        "splits": splits,
    }
    return manifest, stats


def validation_mask(count: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which documents go to validation: a seeded draw per document, at least one, never all."""
    draws = np.random.default_rng(seed).random(count)
    mask = draws < val_fraction
    if not mask.any():
        mask[np.argmin(draws)] = True
    if mask.all():
        mask[np.argmax(draws)] = False
    return mask


def train_bpe(documents: list[str], is_validation: np.ndarray, vocab_size: int, progress_interval_s: float = 5.0):
    """A byte-level BPE (GPT-2 style) trained on the training documents, as a transformers fast tokenizer."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import GPT2TokenizerFast

    started = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    train_count = int(len(documents) - is_validation.sum())
    log.info("training a byte-level BPE with %d tokens on %d training documents", vocab_size, train_count)
    texts = _training_texts(documents, is_validation, progress_interval_s)
    tokenizer.train_from_iterator(texts, trainer, length=train_count)
    log.info("trained the BPE (%d tokens) in %.1fs", tokenizer.get_vocab_size(), time.perf_counter() - started)
    return GPT2TokenizerFast(tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN)


def _training_texts(
    documents: list[str], is_validation: np.ndarray, progress_interval_s: float, batch: int = 4096,
) -> Iterator[list[str]]:
    """The training documents in batches, logging how far the BPE trainer has read (merges come after)."""
    last = time.perf_counter()
    for start in range(0, len(documents), batch):
        texts = documents[start:start + batch]
        yield [text for text, held_out in zip(texts, is_validation[start:start + batch]) if text and not held_out]
        if time.perf_counter() - last >= progress_interval_s:
            last = time.perf_counter()
            log.info("BPE training: counted %d/%d documents", min(start + batch, len(documents)), len(documents))
    log.info("BPE training: all documents counted, computing merges")


UNIT_CHARS = 8 << 10  # documents joined into one tokenizer input of about this many characters
INPUTS_PER_CORE = 32  # tokenizer inputs per encode call and core: work for the whole pool, small steps to overlap


@dataclass(frozen=True)
class TokenizeStats:
    """What the tokenizing step did and where its time went (for the task log and the benchmark)."""

    tokens: int  # written to the streams, EOS separators included
    documents: int
    began: float  # time.perf_counter() at the start of the step
    cores: int  # the cores this process may run on, which size the tokenizer's thread pool
    wall_s: float
    cpu_s: float  # CPU time of all this process's threads over the step
    joined: bool  # documents were encoded joined by the EOS text (see `_joins_at_eos`)


@dataclass(frozen=True)
class _Batch:
    """Tokenizer inputs for one encode call, each holding documents of one split only."""

    texts: list[str]
    held_out: list[bool]  # per input
    documents: int
    chars: int


def _batches(documents: list[str], lengths: np.ndarray, is_validation: np.ndarray, eos_token: str, joined: bool,
             inputs_per_batch: int) -> Iterator[_Batch]:
    """Tokenizer inputs: the training documents in order, then the validation documents in order (each split has
    its own stream), cut about every `UNIT_CHARS` characters and joined by the EOS text (each input ending with
    it); single documents when not `joined`."""
    order = np.argsort(is_validation, kind="stable")
    documents, lengths, is_validation = [documents[i] for i in order.tolist()], lengths[order], is_validation[order]
    if joined:
        split_runs = np.cumsum(np.diff(is_validation.astype(np.int8), prepend=is_validation[:1]) != 0)
        chars_before = np.cumsum(lengths) - lengths
        unit = split_runs * (int(lengths.sum()) // UNIT_CHARS + 1) + chars_before // UNIT_CHARS
        starts = np.flatnonzero(np.diff(unit, prepend=-1)).tolist() + [len(documents)]
    else:
        starts = list(range(len(documents) + 1))
    char_ends = np.cumsum(lengths)
    for first in range(0, len(starts) - 1, inputs_per_batch):
        bounds = starts[first:first + inputs_per_batch + 1]
        texts = [eos_token.join(documents[a:b]) + eos_token if joined else documents[a]
                 for a, b in itertools.pairwise(bounds)]
        begin, end = bounds[0], bounds[-1]
        yield _Batch(texts=texts, held_out=is_validation[bounds[:-1]].tolist(), documents=end - begin,
                     chars=int(char_ends[end - 1] - (char_ends[begin - 1] if begin else 0)))


def _joins_at_eos(tokenizer, eos_token: str, sample: list[str]) -> bool:
    """Whether documents joined by the EOS text encode to exactly each document's ids followed by the EOS id.

    It holds when the EOS is an added token matched on the raw text with nothing stripped around it (the tokenizer
    then cuts its input at every EOS before normalizing and pre-tokenizing, so the pieces are encoded as if alone)
    and no other added token can match across a document boundary. A sample is also encoded both ways, which
    catches what the token flags cannot show: a pre-tokenizer that treats only the start of the input specially
    (Metaspace with prepend_scheme "first"), or special tokens not matched in text (encode_special_tokens).
    """
    added = tokenizer.get_added_tokens_decoder()
    eos_ids = [index for index, token in added.items() if token.content == eos_token]
    if len(eos_ids) != 1:
        return False
    eos = added[eos_ids[0]]
    if eos.normalized or eos.lstrip or eos.rstrip or eos.single_word:
        return False
    for token in added.values():
        other = token.content
        if other != eos_token and (eos_token in other or any(
            other.endswith(eos_token[:k]) or other.startswith(eos_token[k:]) for k in range(1, len(eos_token))
        )):
            return False
    probe = [*sample, "", " leading space", "trailing newline\n"]
    separate = [encoding.ids for encoding in tokenizer.encode_batch_fast(probe, add_special_tokens=False)]
    together = tokenizer.encode(eos_token.join(probe) + eos_token, add_special_tokens=False).ids
    return together == [token for ids in separate for token in (*ids, eos_ids[0])]


def _without_truncation(tokenizer):
    """The tokenizer, or a copy that neither truncates nor pads: every token of a document is packed."""
    if tokenizer.truncation is None and tokenizer.padding is None:
        return tokenizer
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def tokenize_to_streams(
    documents: list[str], tokenizer, eos_token: str, eos: int, dtype: np.dtype, is_validation: np.ndarray,
    workdir: Path, progress_interval_s: float,
) -> tuple[dict[str, Path], TokenizeStats]:
    """Append every document's ids + EOS to `train.bin` / `validation.bin` in document order.

    This thread calls `encode_batch_fast` (no character offsets, which packing never needs), which spreads each
    batch over every core with the tokenizer's own thread pool and releases the GIL meanwhile; one writer thread
    turns the previous batch into ids and appends them, so writing overlaps tokenizing.
    """
    tokenizer = _without_truncation(tokenizer)
    joined = _joins_at_eos(tokenizer, eos_token, documents[:64])
    cores = len(os.sched_getaffinity(0))
    lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
    progress = _Progress(len(documents), int(lengths.sum()), progress_interval_s)
    streams = {"train": workdir / "train.bin", "validation": workdir / "validation.bin"}
    log.info("tokenizing %d documents (%s characters) on %d core(s)%s", len(documents),
             _human_count(progress.total_chars), cores,
             "" if joined else "; one document per tokenizer input (joining them at the EOS would change the ids)")

    def append(batch: _Batch, encodings, outputs) -> None:
        if joined:  # every input ends with the EOS already
            ids = [np.fromiter(e.ids, dtype=dtype, count=len(e)) for e in encodings]
        else:
            ids = [np.fromiter(itertools.chain(e.ids, (eos,)), dtype=dtype, count=len(e) + 1) for e in encodings]
        for held_out, output in zip((False, True), outputs, strict=True):
            chunks = [chunk for chunk, held in zip(ids, batch.held_out, strict=True) if held == held_out]
            if chunks:
                output.write(np.concatenate(chunks).tobytes())
        progress.advance(batch.documents, batch.chars, sum(map(len, ids)))

    began, cpu_began = time.perf_counter(), time.process_time()
    with _tokenizer_threads(), open(streams["train"], "wb") as train, open(streams["validation"], "wb") as validation, \
            ThreadPoolExecutor(1, thread_name_prefix="prepare-writer") as writer:
        pending = None
        for batch in _batches(documents, lengths, is_validation, eos_token, joined, INPUTS_PER_CORE * cores):
            encodings = tokenizer.encode_batch_fast(batch.texts, add_special_tokens=False)
            if pending is not None:
                pending.result()
            pending = writer.submit(append, batch, encodings, (train, validation))
        if pending is not None:
            pending.result()
    progress.finish()
    stats = TokenizeStats(tokens=progress.tokens, documents=len(documents), began=began, cores=cores,
                          wall_s=time.perf_counter() - began, cpu_s=time.process_time() - cpu_began, joined=joined)
    return streams, stats


@contextlib.contextmanager
def _tokenizer_threads():
    """Let the tokenizer use every core even where the environment switched its thread pool off.

    Threads inside this process (the tokenizer's pool and one writer), not a process pool: a forked child of the
    threaded Airflow task process can deadlock on a lock held at fork time, and a spawned one re-imports the
    `airflow` entry script, which fails inside a task (no metadata database there).
    """
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


class _Progress:
    """Logs documents, tokens, tokens/s and ETA (by characters) at most every `interval_s` seconds; thread-safe."""

    def __init__(self, total_documents: int, total_chars: int, interval_s: float):
        self.total_documents, self.total_chars, self.interval_s = total_documents, total_chars, interval_s
        self.documents = self.chars = self.tokens = 0
        self.started = self.last = time.perf_counter()
        self._lock = threading.Lock()

    def advance(self, documents: int, chars: int, tokens: int) -> None:
        with self._lock:
            self.documents += documents
            self.chars += chars
            self.tokens += tokens
            now = time.perf_counter()
            if now - self.last >= self.interval_s:
                self.last = now
                self._log(now)

    def finish(self) -> None:
        self._log(time.perf_counter())

    def _log(self, now: float) -> None:
        elapsed = max(now - self.started, 1e-9)
        done = self.chars / self.total_chars if self.total_chars else 1.0
        eta = elapsed * (1 - done) / done if done > 0 else float("inf")
        log.info(
            "tokenized %d/%d documents (%.0f%%), %d tokens, %s tokens/s, ETA %.0fs",
            self.documents, self.total_documents, 100 * done, self.tokens, _human_rate(self.tokens / elapsed), eta,
        )


def write_split(
    stream: Path, split: str, shards: int, block_size: int, per_record: int, dtype: str, stage: Path,
) -> dict[str, Any]:
    """Cut the split's token stream into `block_size` sequences (dropping the remainder) and write `shards`
    files whose sequence counts differ by at most one."""
    tokens = np.memmap(stream, dtype=np.dtype(dtype).newbyteorder("<"), mode="r") if stream.stat().st_size else \
        np.zeros(0, dtype=dtype)
    sequences = len(tokens) // block_size
    rows = tokens[: sequences * block_size].reshape(sequences, block_size)
    batch = per_record * 256  # sequences written per call, bounding memory for large shards
    entries = []
    for index in range(shards):
        low, high = index * sequences // shards, (index + 1) * sequences // shards
        name = f"{split}-{index:05d}-of-{shards:05d}.tfrecord"
        path = stage / name
        records = 0
        with open(path, "wb") as handle:
            for start in range(low, high, batch):
                records += write_sequence_records(handle, rows[start:min(start + batch, high)], per_record)
        entries.append({
            "name": name, "records": records, "sequences": high - low, "tokens": (high - low) * block_size,
            "bytes": path.stat().st_size, "sha256": storage.sha256_file(path),
        })
    return {"sequences": sequences, "tokens": sequences * block_size, "shards": entries}


# ---------------------------------------------------------------------------------------------------------------
# staging and publishing


@contextlib.contextmanager
def _staging(layout: StorageLayout, fingerprint: str):
    """A local directory to build in. For a local root it sits next to the target (same filesystem, so publishing
    is one rename) and leftovers of killed runs of this fingerprint are removed first."""
    fs, datasets_path = storage.filesystem(storage.join(layout.root, "datasets"))
    if storage.is_local(fs):
        for stale in Path(datasets_path).glob(f".{fingerprint}.partial-*"):
            log.info("removing %s left by an interrupted run", stale)
            shutil.rmtree(stale, ignore_errors=True)
        stage = Path(datasets_path) / f".{fingerprint}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        stage.mkdir(parents=True)
    else:
        stage = Path(tempfile.mkdtemp(prefix=f"stage-{fingerprint}-"))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _publish(stage: Path, dataset_url: str, manifest: dict[str, Any]) -> None:
    fs, target = storage.filesystem(dataset_url)
    if storage.is_local(fs):
        storage.write_bytes_atomic(str(stage / MANIFEST), _manifest_bytes(manifest))
        if os.path.exists(target):  # an incomplete or damaged earlier attempt: the manifest check rejected it
            shutil.rmtree(target)
        os.replace(stage, target)
        return
    try:
        if fs.exists(target):  # objects of an interrupted upload
            fs.rm(target, recursive=True)
        storage.upload_tree(stage, dataset_url)
        fs.pipe_file(f"{target}/{MANIFEST}", _manifest_bytes(manifest))  # one PUT: atomic on object stores
    except Exception as error:
        raise PrepareError(
            f"Writing the dataset to {dataset_url} failed ({type(error).__name__}: {error}). No manifest was "
            "written, so nothing is published; the next run uploads it again from the start."
        ) from error


# ---------------------------------------------------------------------------------------------------------------
# small helpers


def _result(manifest_url: str, manifest: dict[str, Any], *, cache_hit: bool, tokenized: int, started: float):
    return PreparedDataset(
        manifest_url=manifest_url,
        fingerprint=manifest["fingerprint"],
        cache_hit=cache_hit,
        train_sequences=manifest["splits"]["train"]["sequences"],
        validation_sequences=manifest["splits"]["validation"]["sequences"],
        train_tokens=manifest["splits"]["train"]["tokens"],
        tokenized_tokens=tokenized,
        elapsed_s=time.perf_counter() - started,
    )


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _file_entries(directory: Path) -> list[dict[str, Any]]:
    return [
        {"name": path.relative_to(directory).as_posix(), "bytes": path.stat().st_size,
         "sha256": storage.sha256_file(path)}
        for path in sorted(directory.rglob("*")) if path.is_file()
    ]


def _file_list(sources: Sources) -> str:
    names = [f.url for f in sources.files]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _human_bytes(count: float) -> str:
    return f"{count / 2**20:.1f} MB" if count >= 2**20 else f"{count / 2**10:.1f} KB"


def _human_count(count: float) -> str:
    return f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count / 1e3:.1f}k"


def _human_rate(rate: float) -> str:
    return f"{rate / 1e6:.2f}M" if rate >= 1e6 else f"{rate / 1e3:.1f}k"


__all__ = ["EOS_TOKEN", "FORMAT_VERSION", "PrepareError", "PreparedDataset", "prepare_dataset"]
