"""The GPT-2 model: built from a preset (random init) or loaded from a hub name / saved directory; its loss and cost.

Dropout is switched off for every model: the run is then a pure function of (seed, data order), which is what
lets a data-parallel run be compared step by step with its single-worker baseline. Fine-tuning GPT-2 on small
corpora for a few epochs does not need it (nanoGPT trains with dropout 0 as well).
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from core import storage
from core.config import MODEL_PRESETS

if TYPE_CHECKING:
    import tensorflow as tf
    from transformers import TFGPT2LMHeadModel

log = logging.getLogger("trainer.model")

NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


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


def build_model(spec: str, *, vocab_size: int, eos_token_id: int, block_size: int, work_dir: str | Path):
    """A TFGPT2LMHeadModel with built weights and `vocab_size` embeddings; call inside the strategy scope."""
    from transformers import GPT2Config, TFGPT2LMHeadModel

    if spec in MODEL_PRESETS:
        shape = MODEL_PRESETS[spec]
        config = GPT2Config(
            vocab_size=vocab_size, bos_token_id=eos_token_id, eos_token_id=eos_token_id, **shape, **NO_DROPOUT
        )
        model = TFGPT2LMHeadModel(config)
        model.build_in_name_scope()
        log.info("Model: preset %r (random init) %s, vocab %d", spec, shape, vocab_size)
    else:
        source = stage_model_dir(spec, work_dir) if is_model_location(spec) else spec
        # use_safetensors=False: the TF weights; a PyTorch-format model.safetensors beside them breaks this loader.
        model = TFGPT2LMHeadModel.from_pretrained(source, use_safetensors=False, **NO_DROPOUT)
        log.info("Model: %s loaded from %s", spec, source)
        if model.config.vocab_size != vocab_size:
            log.info("Resizing token embeddings %d -> %d to match the tokenizer", model.config.vocab_size, vocab_size)
            model.resize_token_embeddings(vocab_size)
    if block_size > model.config.n_positions:
        raise ValueError(
            f"block_size {block_size} exceeds the {model.config.n_positions} positions of model {spec!r}: "
            "lower 'block_size' in the run config."
        )
    return model


def token_losses(model: TFGPT2LMHeadModel, tokens: tf.Tensor, training: bool) -> tf.Tensor:
    """Next-token cross-entropy of every predicted token, `[batch, block_size - 1]` (labels are the inputs, shifted
    by one). Computed in float32 whatever the compute dtype, so bf16/fp16 runs report comparable losses."""
    import tensorflow as tf

    logits = model(input_ids=tokens, training=training, use_cache=False, return_dict=True).logits
    return tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tokens[:, 1:], logits=tf.cast(logits[:, :-1], tf.float32)
    )


def causal_lm_loss(model: TFGPT2LMHeadModel, tokens: tf.Tensor, training: bool) -> tf.Tensor:
    """Mean next-token cross-entropy over a batch of token sequences (`token_losses`, averaged)."""
    import tensorflow as tf

    return tf.reduce_mean(token_losses(model, tokens, training))


def count_parameters(model: TFGPT2LMHeadModel) -> int:
    return int(sum(math.prod(v.shape) for v in model.trainable_variables))


def flops_per_token(model: TFGPT2LMHeadModel, block_size: int) -> float:
    """Training FLOPs per token: 6N for the weights plus attention, as in PaLM appendix B / nanoGPT."""
    config = model.config
    head_dim = config.n_embd // config.n_head
    attention = 12 * config.n_layer * config.n_head * head_dim * block_size
    return 6 * count_parameters(model) + attention
