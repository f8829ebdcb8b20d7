"""The tokenizer of a dataset: what it is (its fingerprint), where it comes from, and the file the units load.

`bpe:<n>` trains a byte-level BPE (GPT-2 style) offline on a bounded sample of the training documents: BPE training
memory grows with the text it counts (2 GB of text took 150 GB of RAM upstream, huggingface/tokenizers#1345), so it
reads at most `bpe_sample_mb` of text, chosen by window draws (`tasks.dataset.split`): every window of a corpus
smaller than that, an even spread over a larger one, the same for any fan-out. Anything else is a pretrained fast
tokenizer (a hub name, a directory, an object-storage URL). Either way its `save_pretrained` files are what the
dataset ships, and what every unit loads (`tokenizer.json`, through `tokenizers` alone: no transformers import).
"""

from __future__ import annotations

import hashlib
import logging
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import storage
from core.config import RunConfig
from core.config.launch import FLOAT_DTYPES
from core.document import Document
from core.layout import local_or_hub
from tasks.dataset.errors import PrepareError
from tasks.dataset.ranges import SourceReader
from tasks.dataset.readers import parquet_layout, read_documents
from tasks.dataset.sources import Sources
from tasks.dataset.split import SAMPLE_RULE, SAMPLE_WINDOW_BYTES, DocumentDraws, held_out, window_draw
from trainer.data import token_dtype

log = logging.getLogger("gpt_finetune.prepare")

BPE_RECIPE = "bytelevel-bpe/v1"  # bump when the BPE training recipe changes: it is part of the fingerprint
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class BpeSample(Document):
    """What a BPE is trained on (part of the fingerprint): the windows' draw `rule`, `window_bytes`, at most
    `cap_bytes` of text."""

    rule: str
    window_bytes: int
    cap_bytes: int


@dataclass(frozen=True)
class TokenizerPlan:
    spec: str
    fingerprint: str
    dtype: str
    pretrained: Any | None  # a loaded PreTrainedTokenizerFast, or None when a BPE is trained here
    sample: BpeSample | None  # None for a pretrained one


def plan_tokenizer(cfg: RunConfig) -> TokenizerPlan:
    vocab = cfg.bpe_vocab_size
    if vocab is not None:
        check_vocabulary(cfg, vocab)
        sample = BpeSample(rule=SAMPLE_RULE, window_bytes=SAMPLE_WINDOW_BYTES, cap_bytes=cfg.bpe_sample_mb << 20)
        return TokenizerPlan(cfg.tokenizer, _sha256_text(f"{BPE_RECIPE}:{vocab}:{EOS_TOKEN}"), token_dtype(vocab), None,
                             sample)
    tokenizer = load_pretrained_tokenizer(cfg.tokenizer)
    check_vocabulary(cfg, len(tokenizer))
    # The serialized tokenizer as it is: deterministic for a tokenizers version (vocabularies in id order), and
    # hashing it directly saves parsing and re-sorting megabytes of JSON on every run, cache hits included.
    identity = f"eos={tokenizer.eos_token!r}\n{tokenizer.backend_tokenizer.to_str()}"
    return TokenizerPlan(cfg.tokenizer, _sha256_text(identity), token_dtype(len(tokenizer)), tokenizer, None)


def check_vocabulary(cfg: RunConfig, vocab_size: int) -> None:
    """With 'resize_embeddings' off, refuse a tokenizer with more tokens than the checkpoint's embedding rows."""
    if cfg.resize_embeddings or cfg.is_preset_model:
        return
    rows = _model_config(cfg.model).get("vocab_size")
    if isinstance(rows, int) and vocab_size > rows:
        raise PrepareError(
            f"Setting 'tokenizer' = {cfg.tokenizer!r} has {vocab_size} tokens, more than the {rows} embedding rows of "
            f"model {cfg.model!r}, and 'resize_embeddings' is false: set it to true (new rows drawn at random), or "
            "use the model's own tokenizer.")


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
            tokenizer = AutoTokenizer.from_pretrained(local_or_hub(spec.removeprefix("file://")), use_fast=True)
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


def check_model(cfg: RunConfig) -> None:
    """Refuse a block size the model cannot embed, and gradients in bfloat16 on the wire for a model whose weights
    are not floating point; presets are already checked by RunConfig."""
    if cfg.is_preset_model:
        return
    config = _model_config(cfg.model)
    weights = str(config.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
    if cfg.allreduce_dtype == "bfloat16" and weights not in FLOAT_DTYPES:
        raise PrepareError(
            f"Setting 'allreduce_dtype' = 'bfloat16' needs floating-point weights, but model {cfg.model!r} holds "
            f"{weights}: set 'allreduce_dtype' to 'float32' or use a floating-point model.")
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

    try:
        return AutoConfig.from_pretrained(local_or_hub(model.removeprefix("file://"))).to_dict()
    except (OSError, ValueError) as error:
        raise PrepareError(
            f"Setting 'model' = {model!r} is no preset, no readable save_pretrained directory and no hub model "
            f"reachable from here: {error}"
        ) from error


# -- BPE on a bounded sample ------------------------------------------------------------------------------------


def train_bpe(sources: Sources, cfg: RunConfig, sample: BpeSample, progress_interval_s: float = 5.0):
    """A byte-level BPE trained on the sampled training documents, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast

    started = time.perf_counter()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.bpe_vocab_size, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    counted = _Counted()
    texts = sample_training_texts(sources, cfg, sample.cap_bytes, counted, progress_interval_s)
    tokenizer.train_from_iterator(texts, trainer)
    log.info("trained the BPE (%d tokens) on %d training documents (%.1f MB of text sampled from %.1f MB) in "
             "%.1fs", tokenizer.get_vocab_size(), counted.documents, counted.bytes / 1e6, sources.total_bytes / 1e6,
             time.perf_counter() - started)
    return GPT2TokenizerFast(tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN)


@dataclass
class _Counted:
    documents: int = 0
    bytes: int = 0


def sample_training_texts(sources: Sources, cfg: RunConfig, cap_bytes: int, counted: _Counted,
                          progress_interval_s: float) -> Iterator[list[str]]:
    """Batches of training documents from the windows whose draw is below cap / corpus size, in source order,
    until `cap_bytes` of text: all of a corpus that fits, an even spread of a larger one."""
    rate = min(1.0, cap_bytes / max(sources.total_bytes, 1))
    log.info("training a byte-level BPE with %d tokens on up to %.0f MB of training text (%.0f%% of the windows "
             "of %.1f MB)", cfg.bpe_vocab_size, cap_bytes / 1e6, 100 * rate, sources.total_bytes / 1e6)
    last = time.perf_counter()
    for source in sources.files:
        draws = DocumentDraws(cfg.seed, source.relpath)
        with SourceReader(source) as reader:
            if sources.kind == "parquet":
                windows = [(group, group + 1) for group in range(len(parquet_layout(reader, cfg.text_column)))]
            else:
                count = math.ceil(source.size / SAMPLE_WINDOW_BYTES)
                windows = [(w * SAMPLE_WINDOW_BYTES, (w + 1) * SAMPLE_WINDOW_BYTES) for w in range(count)]
            for index, (start, end) in enumerate(windows):
                if rate < 1.0 and window_draw(cfg.seed, source.relpath, index) >= rate:
                    continue
                for chunk in read_documents(reader, sources.kind, start, end, cfg.text_column,
                                            cfg.max_document_mb << 20):
                    validation = held_out(draws.array(chunk.keys), cfg.val_fraction).tolist()
                    texts = [text for text, out in zip(chunk.texts, validation, strict=True) if text and not out]
                    room = cap_bytes - counted.bytes
                    if room <= 0:
                        return
                    taken, size = _within(texts, room)
                    counted.documents += len(taken)
                    counted.bytes += size
                    yield taken
                    if time.perf_counter() - last >= progress_interval_s:
                        last = time.perf_counter()
                        log.info("BPE training: counted %d documents, %.1f MB of text", counted.documents,
                                 counted.bytes / 1e6)


def _within(texts: list[str], room: int) -> tuple[list[str], int]:
    """The leading texts whose UTF-8 size fits in `room` bytes, and that size."""
    taken, size = [], 0
    for text in texts:
        length = len(text.encode("utf-8"))
        if size + length > room:
            break
        taken.append(text)
        size += length
    return taken, size


# -- the file every unit loads -----------------------------------------------------------------------------------


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    tokenizer.save_pretrained(str(directory))


def load_backend(directory: Path):
    """The `tokenizers.Tokenizer` of a saved tokenizer directory, ready to pack (`packing_backend`)."""
    from tokenizers import Tokenizer

    return packing_backend(Tokenizer.from_file(str(directory / "tokenizer.json")))


def packing_backend(backend):
    """`backend` (a `tokenizers.Tokenizer`) with truncation and padding off: every token of a document is packed.

    A BPE's empty subword prefix and word suffix (transformers 5 loads a BPE saved without them with "") become
    none: the same ids, but with "" the BPE builds a new string for every character of a word it merges."""
    backend.no_truncation()
    backend.no_padding()
    model = backend.model
    for affix in ("continuing_subword_prefix", "end_of_word_suffix"):
        if getattr(model, affix, None) == "":
            setattr(model, affix, None)
    return backend


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
