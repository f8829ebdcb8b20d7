"""The model: built from a preset (random init) or loaded from a saved directory; its loss and cost.

The model is the project's own decoder (trainer/decoders/: GPT2Decoder or LlamaDecoder, variables named as
Hugging Face's PyTorch state dict). It has no dropout: the run is then a pure function of (seed, data order), which
is what lets a data-parallel run be compared step by step with its single-worker baseline. Fine-tuning GPT-2 on
small corpora for a few epochs does not need it (nanoGPT trains with dropout 0 as well).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core import storage
from core.config import MODEL_PRESETS

if TYPE_CHECKING:
    import tensorflow as tf

    from trainer.decoders.base import Decoder

log = logging.getLogger("trainer.model")


def stage_model_dir(url: str, work_dir: str | Path) -> str:
    """A model or tokenizer directory usable by `from_pretrained`: local dirs as they are, object storage copied
    (into `work_dir`, one directory per URL: two URLs may end in the same name)."""
    local = storage.local_copy(url, Path(work_dir) / f"model-{hashlib.sha256(url.encode()).hexdigest()[:16]}")
    if not local.is_dir() or not any(local.iterdir()):
        raise FileNotFoundError(f"Model directory {url} is empty or missing: expected save_pretrained files there.")
    return str(local)


def is_model_location(spec: str) -> bool:
    """True for a URL or an existing local directory, False for a hub name such as `gpt2`."""
    return "://" in spec or Path(spec).expanduser().is_dir()


@dataclass(frozen=True)
class Vocabulary:
    """The tokenizer's side of the model: its token count and end-of-text id (the manifest's `tokenizer`)."""

    size: int
    eos_token_id: int

    @classmethod
    def of(cls, tokenizer: Mapping[str, Any]) -> Vocabulary:
        return cls(tokenizer["vocab_size"], tokenizer["eos_token_id"])


def build_model(spec: str, vocabulary: Vocabulary, *, block_size: int, work_dir: str | Path,
                compute_dtype: str = "float32", seed: int = 0, resize_embeddings: bool = True) -> Decoder:
    """A decoder (GPT-2, Llama or Qwen2) with one embedding per token of `vocabulary` computing in `compute_dtype`
    (float32 weights): a preset from `seed`, or the checkpoint directory `spec` (local or object storage, staged in
    `work_dir`); without `resize_embeddings` a checkpoint keeps its rows, which must cover the vocabulary. Call
    inside the strategy scope. A hub name is refused: prepare caches hub models in storage and names that
    directory."""
    from trainer.decoders.pretrained import build_preset, load_pretrained

    vocab_size = vocabulary.size

    if spec in MODEL_PRESETS:
        return build_preset(spec, vocab_size=vocab_size, eos_token_id=vocabulary.eos_token_id, block_size=block_size,
                            compute_dtype=compute_dtype, seed=seed)
    if not is_model_location(spec):
        raise ValueError(
            f"model {spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a checkpoint directory: the "
            "prepare task caches a hub model in storage (models/base/<name>@<sha>/) and names that directory; "
            "run the pipeline from prepare, or set 'model' to a directory holding config.json and model.safetensors."
        )
    model = load_pretrained(spec, vocab_size=vocab_size if resize_embeddings else None, block_size=block_size,
                            compute_dtype=compute_dtype, seed=seed, work_dir=work_dir)
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} tokens, model {spec!r} embeds {model.config.vocab_size}: "
                         "set 'resize_embeddings' to true, or use the model's own tokenizer.")
    return model


def token_losses(model: Decoder, tokens: tf.Tensor) -> tf.Tensor:
    """Next-token cross-entropy of every predicted token, float32 `[batch, block_size - 1]` whatever the compute
    dtype, so bf16/fp16 runs report comparable losses (trainer/decoders/ops.py)."""
    from trainer.decoders import ops

    return ops.token_losses(model, tokens)


def causal_lm_loss(model: Decoder, tokens: tf.Tensor) -> tf.Tensor:
    """Mean next-token cross-entropy over a batch of token sequences (`token_losses`, averaged)."""
    from trainer.decoders import ops

    return ops.causal_lm_loss(model, tokens)


def count_parameters(model: Decoder) -> int:
    from trainer.decoders import ops

    return ops.count_parameters(model)


def flops_per_token(model: Decoder, block_size: int) -> float:
    """Training FLOPs per token: 6N for the weights plus attention, as in PaLM appendix B / nanoGPT."""
    from trainer.decoders import ops

    return ops.flops_per_token(model, block_size)
