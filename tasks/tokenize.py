"""The prepare stage: tokenize a dataset into verified TFRecord shards under `storage_root/datasets/<fingerprint>/`.

Order of work, cheapest checks first: resolve the source files, check the model's positions and the tokenizer,
compute the fingerprint, return at once when a complete manifest with that fingerprint exists, check that
`storage_root` is writable, and only then load, tokenize, pack and write. Everything is staged first (locally)
and published with the manifest last, so a run that dies leaves no manifest and the next run starts clean:
local roots get the whole staged directory renamed into place, object stores get the shards uploaded first and
`manifest.json` written after them.

Parallelism: documents are tokenized in contiguous batches by the fast tokenizer's `encode_batch`, which spreads
each batch over every available core (its own thread pool); the ids (EOS after every document) are appended to one
flat file per split, then the streams are cut into `block_size` sequences and equal shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from tasks.sources import TEXT, SourceError, Sources, load_documents, resolve_sources
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


def prepare_dataset(cfg: RunConfig, *, progress_interval_s: float = 5.0) -> PreparedDataset:
    """Tokenize `cfg.dataset` into shards + manifest under `cfg.storage_root`, or reuse a complete earlier result.

    Raises `PrepareError` naming the file, key or setting at fault; on any failure no manifest is published.
    """
    started = time.perf_counter()
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
        manifest, tokenized = _build(cfg, sources, plan, settings, fingerprint, stage, Path(workdir), progress_interval_s)
        _publish(stage, layout.dataset(fingerprint), manifest)
    elapsed = time.perf_counter() - started
    log.info(
        "published %s: %d train / %d validation sequences; %d tokens in %.1fs (%s tokens/s end to end)",
        manifest_url, manifest["splits"]["train"]["sequences"], manifest["splits"]["validation"]["sequences"],
        tokenized, elapsed, _human_rate(tokenized / elapsed),
    )
    return _result(manifest_url, manifest, cache_hit=False, tokenized=tokenized, started=started)


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
    identity = json.dumps(
        {"model": json.loads(tokenizer.backend_tokenizer.to_str()), "eos": tokenizer.eos_token}, sort_keys=True
    )
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
) -> tuple[dict[str, Any], int]:
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
    streams, tokenized = tokenize_to_streams(
        documents, tokenizer.backend_tokenizer, eos, np.dtype(plan.dtype), is_validation, workdir, progress_interval_s
    )
    if tokenized == count:  # nothing but the EOS after every document
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
    return manifest, tokenized


def validation_mask(count: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which documents go to validation: a seeded draw per document, at least one, never all."""
    draws = np.random.default_rng(seed).random(count)
    mask = draws < val_fraction
    if not mask.any():
        mask[np.argmin(draws)] = True
    if mask.all():
        mask[np.argmax(draws)] = False
    return mask


def train_bpe(documents, is_validation: np.ndarray, vocab_size: int, progress_interval_s: float = 5.0):
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
    documents, is_validation: np.ndarray, progress_interval_s: float, batch: int = 4096,
) -> Iterator[list[str]]:
    """The training documents in batches, logging how far the BPE trainer has read (merges come after)."""
    last = time.perf_counter()
    for start in range(0, len(documents), batch):
        texts = documents[start:start + batch][TEXT]
        yield [text for text, held_out in zip(texts, is_validation[start:start + batch]) if text and not held_out]
        if time.perf_counter() - last >= progress_interval_s:
            last = time.perf_counter()
            log.info("BPE training: counted %d/%d documents", min(start + batch, len(documents)), len(documents))
    log.info("BPE training: all documents counted, computing merges")


def _encode_texts(tokenizer, texts: list[str], eos: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `texts`, EOS after each, concatenated; and tokens per document (EOS included)."""
    # encode_batch_fast skips the character offsets, which packing never needs; it spreads the batch over every
    # core with the tokenizer's own thread pool.
    ids = [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1
    packed = np.full(int(lengths.sum()), eos, dtype=dtype)
    is_text = np.ones(len(packed), dtype=bool)
    is_text[np.cumsum(lengths) - 1] = False
    packed[is_text] = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=len(packed) - len(ids))
    return packed, lengths


def tokenize_to_streams(
    documents, tokenizer, eos: int, dtype: np.dtype, is_validation: np.ndarray, workdir: Path,
    progress_interval_s: float,
) -> tuple[dict[str, Path], int]:
    """Append every document's ids + EOS to `train.bin` / `validation.bin` in document order; returns the paths and
    the number of tokens written."""
    import pyarrow.compute as pc

    count = len(documents)
    texts = documents.data.column(TEXT)  # load_documents adds no indices mapping: table rows are the documents
    text_bytes = np.asarray(pc.binary_length(texts).fill_null(0), dtype=np.int64)
    cores = len(os.sched_getaffinity(0))
    # Batches large enough to keep every core busy, small enough for a progress line every few seconds.
    chunk = max(64, min(4096, math.ceil(count / 16)))
    ranges = [(start, min(start + chunk, count)) for start in range(0, count, chunk)]
    progress = _Progress(count, int(text_bytes.sum()), progress_interval_s)
    streams = {"train": workdir / "train.bin", "validation": workdir / "validation.bin"}
    log.info("tokenizing %d documents (%s) on %d core(s)", count, _human_bytes(progress.total_bytes), cores)

    with _tokenizer_threads(), open(streams["train"], "wb") as train, open(streams["validation"], "wb") as validation:
        for start, stop in ranges:
            # Straight from the memory-mapped Arrow column: cheaper than the datasets row formatting.
            batch = [text or "" for text in texts.slice(start, stop - start).to_pylist()]
            ids, lengths = _encode_texts(tokenizer, batch, eos, dtype)
            held_out = np.repeat(is_validation[start:stop], lengths)
            train.write(ids[~held_out].tobytes())
            validation.write(ids[held_out].tobytes())
            progress.advance(stop - start, int(text_bytes[start:stop].sum()), len(ids))
    progress.finish()
    return streams, progress.tokens


@contextlib.contextmanager
def _tokenizer_threads():
    """Let the tokenizer use every core even where the environment switched its thread pool off.

    Threads inside this process, not a process pool: a forked child of the threaded Airflow task process can
    deadlock on a lock held at fork time, and a spawned one re-imports the `airflow` entry script, which fails
    inside a task (no metadata database there).
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
    """Logs documents, tokens, tokens/s and ETA (by text bytes) at most every `interval_s` seconds."""

    def __init__(self, total_documents: int, total_bytes: int, interval_s: float):
        self.total_documents, self.total_bytes, self.interval_s = total_documents, total_bytes, interval_s
        self.documents = self.bytes = self.tokens = 0
        self.started = self.last = time.perf_counter()

    def advance(self, documents: int, text_bytes: int, tokens: int) -> None:
        self.documents += documents
        self.bytes += text_bytes
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last >= self.interval_s:
            self.last = now
            self._log(now)

    def finish(self) -> None:
        self._log(time.perf_counter())

    def _log(self, now: float) -> None:
        elapsed = max(now - self.started, 1e-9)
        done = self.bytes / self.total_bytes if self.total_bytes else 1.0
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


def _human_rate(rate: float) -> str:
    return f"{rate / 1e6:.2f}M" if rate >= 1e6 else f"{rate / 1e3:.1f}k"


__all__ = ["EOS_TOKEN", "FORMAT_VERSION", "PrepareError", "PreparedDataset", "prepare_dataset"]
