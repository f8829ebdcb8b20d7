"""Eval loss, perplexity and nats per character of a saved model on the validation shards, and a few short
generations with their known-word rate (trainer/text_quality.py).

    python -m trainer.evaluate --model URL --manifest URL --output JSON_URL [--max-batches N] [--prompt TEXT]...

The loss is the mean next-token cross-entropy over every predicted token of the validation split (the same
`causal_lm_loss` the trainer optimizes), in float32, in file order, so two evaluations of one model agree exactly.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from launcher.log_policy import configure_worker_logging
from trainer import runtime, storage
from trainer.data import (
    DataError,
    load_manifest,
    stage_shards,
    tokenizer_url,
    worker_shards,
)
from trainer.text_quality import known_word_rate, nats_per_character, words

log = logging.getLogger("trainer.evaluate")

EVAL_BATCH_SIZE = 8
PROMPT_TOKENS = 16
NUM_PROMPTS = 3
SAMPLE_NEW_TOKENS = 32
SAMPLE_TOP_K = 50
SAMPLE_SEED = 1234
# The known-word rate's vocabulary is read from at most this many training tokens (all of a small corpus).
VOCABULARY_MAX_TOKENS = 2_000_000


def validation_dataset(manifest_url: str, manifest: dict[str, Any], local_dir: Path, batch_size: int):
    from trainer.data import make_dataset

    shards = worker_shards(manifest, "validation", 0, 1)
    files = stage_shards(manifest_url, shards, local_dir)
    return make_dataset(
        files, block_size=manifest["block_size"], dtype=manifest["dtype"], batch_size=batch_size,
        shuffle=False, seed=0, repeat=False,
    )


def eval_loss(model, dataset, max_batches: int | None, tokenizer) -> tuple[float, int, int]:
    """Token-weighted mean loss over the dataset (every batch has the same shape), the tokens scored and the
    characters those predicted tokens spell (special tokens count none)."""
    import tensorflow as tf

    from trainer.model import causal_lm_loss

    @tf.function
    def batch_loss(tokens):
        return causal_lm_loss(model, tokens, training=False)

    total, batches, tokens, characters = 0.0, 0, 0, 0
    for batch in dataset.take(max_batches) if max_batches else dataset:
        total += float(batch_loss(batch))
        batches += 1
        tokens += int(batch.shape[0]) * (int(batch.shape[1]) - 1)
        predicted = tokenizer.batch_decode(batch[:, 1:].numpy().tolist(), skip_special_tokens=True)
        characters += sum(len(text) for text in predicted)
    if not batches:
        raise DataError("The validation split has no full batch to evaluate: prepare more validation data.")
    return total / batches, tokens, characters


def logits_function(model):
    """`forward(tokens [1, L]) -> logits [L, vocab]` as one traced function per length L (a few per evaluation):
    calling the model eagerly once per sampled token costs twice as long on a CPU."""
    import tensorflow as tf

    @tf.function(reduce_retracing=True)
    def forward(tokens):
        return model(input_ids=tokens, use_cache=False, training=False).logits[0]

    return forward


def continuation(forward, context_limit: int, prompt_ids: list[int], *, top_k: int | None, seed: int) -> list[int]:
    """SAMPLE_NEW_TOKENS tokens after the prompt, greedy (`top_k` None) or sampled from the k likeliest. Each step
    draws with its own stateless seed (seed, step): transformers' TF `generate` reuses one seed for every step, so
    its samples repeat one draw (`will will will`). The context is padded on the right to one length: attention is
    causal, so the padding never changes the logits read at the last real token."""
    import tensorflow as tf

    ids = list(prompt_ids)
    length = min(context_limit, len(prompt_ids) + SAMPLE_NEW_TOKENS)
    for step in range(SAMPLE_NEW_TOKENS):
        context = ids[-length:]
        logits = forward(tf.constant([context + [0] * (length - len(context))]))[len(context) - 1]
        if top_k is None:
            ids.append(int(tf.argmax(logits)))
        else:
            values, indices = tf.math.top_k(tf.cast(logits, tf.float32), k=top_k)
            ids.append(int(indices[tf.random.stateless_categorical(values[None], 1, seed=[seed, step])[0, 0]]))
    return ids[len(prompt_ids):]


def decode_sample(tokenizer, ids: list[int]) -> str:
    """A continuation as text. EOS separates the training text's documents (paragraphs, speeches), so the sample
    goes on past it, shown as a line break: the samples stay long enough for their known-word rate to mean much."""
    pieces = [list(group) for is_eos, group in itertools.groupby(ids, lambda token: token == tokenizer.eos_token_id)
              if not is_eos]
    return "\n".join(tokenizer.decode(piece) for piece in pieces)


def generate_samples(model, tokenizer, prompts: list[list[int]]) -> list[dict[str, str]]:
    """Per prompt: its text, the greedy continuation and a top-k sample (stateless seeds: reproducible)."""
    forward, context_limit = logits_function(model), model.config.n_positions

    def sample(prompt_ids: list[int], top_k: int | None, seed: int) -> str:
        return decode_sample(tokenizer, continuation(forward, context_limit, prompt_ids, top_k=top_k, seed=seed))

    return [{"prompt": tokenizer.decode(prompt_ids), "greedy": sample(prompt_ids, None, SAMPLE_SEED + index),
             "top_k": sample(prompt_ids, SAMPLE_TOP_K, SAMPLE_SEED + index)}
            for index, prompt_ids in enumerate(prompts)]


def known_words(samples: list[dict[str, str]], vocabulary: set[str]) -> dict[str, Any]:
    """The known-word rate of the greedy and of the top-k continuations, and how many words each rate counts."""
    figures: dict[str, Any] = {"words": {}}
    for mode in ("greedy", "top_k"):
        figures[mode], figures["words"][mode] = known_word_rate((sample[mode] for sample in samples), vocabulary)
    return figures


def training_vocabulary(manifest_url: str, manifest: dict[str, Any], tokenizer, local_dir: Path,
                        max_tokens: int = VOCABULARY_MAX_TOKENS) -> tuple[set[str], int]:
    """The words of the training text, decoded from the train shards in order, up to about `max_tokens` tokens
    (a large corpus's first shards: a split drawn by keyed hash, so representative). Returns (words, tokens read)."""
    import numpy as np
    import tensorflow as tf

    vocabulary: set[str] = set()
    tokens_read = 0
    for shard in manifest["splits"]["train"]["shards"]:
        if tokens_read >= max_tokens:
            break
        (path,) = stage_shards(manifest_url, [shard], local_dir)
        for record in tf.data.TFRecordDataset(path).as_numpy_iterator():
            ids = np.frombuffer(record, dtype=np.dtype(manifest["dtype"]).newbyteorder("<"))
            # One record is a run of consecutive sequences: decoded whole, few words are cut at its edges.
            vocabulary.update(words(tokenizer.decode(ids.tolist(), skip_special_tokens=True)))
            tokens_read += len(ids)
    return vocabulary, tokens_read


def validation_prompts(dataset, count: int = NUM_PROMPTS) -> list[list[int]]:
    """The openings of the first validation sequences: text the model has not trained on, in its domain."""
    batch = next(iter(dataset))
    return batch[:count, :PROMPT_TOKENS].numpy().tolist()


def evaluate(model_url: str, manifest_url: str, *, max_batches: int | None = None,
             prompts: list[str] | None = None, batch_size: int = EVAL_BATCH_SIZE) -> dict[str, Any]:
    from transformers import AutoTokenizer, TFGPT2LMHeadModel

    from trainer.model import stage_model_dir

    manifest = load_manifest(manifest_url)
    work_dir = Path(tempfile.mkdtemp(prefix="evaluate-"))
    try:
        model = TFGPT2LMHeadModel.from_pretrained(stage_model_dir(model_url, work_dir))
        tokenizer_dir = model_url if storage.exists(storage.join(model_url, "tokenizer_config.json")) else (
            tokenizer_url(manifest_url, manifest))
        tokenizer = AutoTokenizer.from_pretrained(stage_model_dir(tokenizer_dir, work_dir))
        dataset = validation_dataset(manifest_url, manifest, work_dir / "shards", batch_size)
        started = time.perf_counter()
        loss, tokens, characters = eval_loss(model, dataset, max_batches, tokenizer)
        eval_time = time.perf_counter() - started
        prompt_ids = ([tokenizer(prompt)["input_ids"] for prompt in prompts] if prompts
                      else validation_prompts(dataset))
        started = time.perf_counter()
        samples = generate_samples(model, tokenizer, prompt_ids)
        sample_time = time.perf_counter() - started
        vocabulary, vocabulary_tokens = training_vocabulary(manifest_url, manifest, tokenizer, work_dir / "train")
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    result = {
        "eval_loss": loss, "perplexity": math.exp(loss), "eval_tokens": tokens, "eval_characters": characters,
        "nats_per_char": nats_per_character(loss, tokens, characters), "eval_time_s": round(eval_time, 3),
        "samples": samples, "known_words": known_words(samples, vocabulary), "model": model_url,
        "sampling": {"seed": SAMPLE_SEED, "top_k": SAMPLE_TOP_K, "new_tokens": SAMPLE_NEW_TOKENS,
                     "time_s": round(sample_time, 3), "vocabulary_words": len(vocabulary),
                     "vocabulary_tokens": vocabulary_tokens},
    }
    rates = result["known_words"]
    log.info("eval loss %.4f, perplexity %.2f, %s nats/char over %d tokens in %.1f s; known words: greedy %s, "
             "top-k %s", loss, result["perplexity"], _figure(result["nats_per_char"], ".3f"), tokens, eval_time,
             _figure(rates["greedy"], ".0%"), _figure(rates["top_k"], ".0%"))
    return result


def _figure(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="save_pretrained directory (path or URL)")
    parser.add_argument("--manifest", required=True, help="manifest.json of the tokenized dataset")
    parser.add_argument("--output", required=True, help="where to write the result JSON (path or URL)")
    parser.add_argument("--max-batches", type=int, default=None, help=f"at most N batches of {EVAL_BATCH_SIZE}")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt for the samples, repeatable (default: openings of the validation text)")
    args = parser.parse_args(argv)
    if args.max_batches is not None and args.max_batches < 1:
        parser.error(f"--max-batches must be at least 1, got {args.max_batches}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_worker_logging()
    runtime.signal_ready()  # a group of one: up means joined; the launcher's hang watchdog takes over from here
    result = evaluate(args.model, args.manifest, max_batches=args.max_batches, prompts=args.prompt)
    storage.write_json_atomic(args.output, result)
    print(f"eval_loss {result['eval_loss']:.4f} perplexity {result['perplexity']:.2f} -> {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
