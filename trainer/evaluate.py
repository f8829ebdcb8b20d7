"""Eval loss, perplexity and nats per character of a saved model on the run's evaluation sample of the validation
split, and a few short generations with their known-word rate (core/text_quality.py).

    python -m trainer.evaluate --model URL --manifest URL --output JSON_URL [--eval-tokens N] [--prompt TEXT]...

The sample is `--eval-tokens` tokens of the validation split, the same for every model and every run on the same
dataset, read without the rest of the split (trainer/eval_sample.py). In a group (TF_CONFIG), worker r scores its
part of the sample and writes it next to the output (`core.eval_result.part_url`); the evaluate task combines
the parts exactly (core/eval_result.py). Alone, the worker writes the result itself. Rank 0 also writes the text
samples. Each sequence's loss is the mean next-token cross-entropy of its predicted tokens (the `token_losses` the
trainer optimizes), in float32, so a model scores the same on any number of workers to float32 rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from core import storage
from core.config import RunConfig
from core.config.core import EVAL_BATCH_SEQUENCES
from core.eval_result import EvalPart, EvalResult, combine, part_url
from core.text_quality import known_word_rate, words
from launcher.log_policy import configure_worker_logging
from trainer import runtime
from trainer.data import load_manifest, tokenizer_url
from trainer.eval_sample import draw_sample, leading_records, read_part, read_windows

log = logging.getLogger("trainer.evaluate")

EVAL_BATCH_SIZE = EVAL_BATCH_SEQUENCES
DEFAULT_EVAL_TOKENS = RunConfig.eval_tokens  # the run setting's default
PROMPT_TOKENS = 16
NUM_PROMPTS = 3
SAMPLE_NEW_TOKENS = 32
SAMPLE_TOP_K = 50
SAMPLE_SEED = 1234
# The known-word rate's vocabulary is read from at most this many training tokens (all of a small corpus).
VOCABULARY_MAX_TOKENS = 2_000_000


def sequence_losses(model, sequences: np.ndarray, tokenizer, batch_size: int = EVAL_BATCH_SIZE,
                    ) -> tuple[list[float], int, int]:
    """Each sequence's mean loss over its predicted tokens (float32, as Python floats), the tokens scored and the
    characters those predicted tokens spell (special tokens count none). A last batch may be short."""
    import tensorflow as tf

    from trainer.decoders.ops import token_losses

    @tf.function(input_signature=[tf.TensorSpec([None, sequences.shape[1]], tf.int32)])
    def batch_losses(tokens):
        return tf.reduce_mean(token_losses(model, tokens), axis=1)

    losses: list[float] = []
    characters = 0
    for first in range(0, len(sequences), batch_size):
        batch = sequences[first:first + batch_size]
        losses += batch_losses(tf.constant(batch)).numpy().tolist()
        predicted = tokenizer.batch_decode(batch[:, 1:].tolist(), skip_special_tokens=True)
        characters += sum(len(text) for text in predicted)
    return losses, len(sequences) * (sequences.shape[1] - 1), characters


def logits_function(model):
    """`forward(tokens [1, L]) -> logits [L, vocab]` as one traced function per length L (a few per evaluation):
    calling the model eagerly once per sampled token costs twice as long on a CPU."""
    import tensorflow as tf

    @tf.function(reduce_retracing=True)
    def forward(tokens):
        return model(tokens)[0]

    return forward


def continuation(forward, context_limit: int, prompt_ids: list[int], *, top_k: int | None, seed: int) -> list[int]:
    """SAMPLE_NEW_TOKENS tokens after the prompt, greedy (`top_k` None) or sampled from the k likeliest. Each step
    draws with its own stateless seed (seed, step), so no two steps repeat one draw. The context is padded on the
    right to one length: attention is causal, so the padding never changes the logits read at the last real token."""
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


def training_vocabulary(manifest_url: str, manifest: dict[str, Any], tokenizer,
                        max_tokens: int = VOCABULARY_MAX_TOKENS) -> tuple[set[str], int]:
    """The words of the training text, decoded from the train shards' first records in order, up to about
    `max_tokens` tokens (a large corpus's first records: a split drawn by keyed hash, so representative), read
    without the rest of the shards. Returns (words, tokens read)."""
    vocabulary: set[str] = set()
    records, _ = leading_records(manifest_url, manifest, "train", max_tokens)
    for ids in records:
        # One record is a run of consecutive sequences: decoded whole, few words are cut at its edges.
        vocabulary.update(words(tokenizer.decode(ids.tolist(), skip_special_tokens=True)))
    return vocabulary, sum(len(ids) for ids in records)


def validation_prompts(sequences: np.ndarray, count: int = NUM_PROMPTS) -> list[list[int]]:
    """The openings of the sample's first sequences: text the model has not trained on, in its domain."""
    return sequences[:count, :PROMPT_TOKENS].tolist()


def load_model(model_url: str, manifest_url: str, manifest: dict[str, Any], work_dir: Path):
    """The saved model (a Hugging Face checkpoint directory, float32) and its tokenizer (the model directory's own,
    else the dataset's)."""
    from transformers import AutoTokenizer

    from trainer.decoders.pretrained import load_pretrained
    from trainer.model import stage_model_dir

    local = stage_model_dir(model_url, work_dir)  # downloaded once: the weights and, when it has one, the tokenizer
    model = load_pretrained(local)
    tokenizer_dir = local if Path(local, "tokenizer_config.json").is_file() else stage_model_dir(
        tokenizer_url(manifest_url, manifest), work_dir)
    return model, AutoTokenizer.from_pretrained(tokenizer_dir)


def text_samples(model, tokenizer, manifest_url: str, manifest: dict[str, Any], prompts: list[list[int]],
                 ) -> dict[str, Any]:
    """Rank 0's share beside its losses, by `EvalPart` field: the samples, their known-word rates and how they were
    drawn."""
    started = time.perf_counter()
    samples = generate_samples(model, tokenizer, prompts)
    sample_time = time.perf_counter() - started
    vocabulary, vocabulary_tokens = training_vocabulary(manifest_url, manifest, tokenizer)
    return {"samples": samples, "known_words": known_words(samples, vocabulary),
            "sampling": {"seed": SAMPLE_SEED, "top_k": SAMPLE_TOP_K, "new_tokens": SAMPLE_NEW_TOKENS,
                         "time_s": round(sample_time, 3), "vocabulary_words": len(vocabulary),
                         "vocabulary_tokens": vocabulary_tokens}}


def score_windows(model, tokenizer, windows) -> dict[str, Any]:
    """Each window's sequences scored as it is read (bounded memory): the losses in order, tokens and characters
    scored, bytes read, the time spent reading and the time in all, and the first sequences (the prompts')."""
    scored: dict[str, Any] = {"sequence_losses": [], "scored_tokens": 0, "characters": 0, "read_bytes": 0,
                              "read_time_s": 0.0, "first": None}
    started = clock = time.perf_counter()
    for window, read_bytes in windows:
        scored["read_time_s"] += time.perf_counter() - clock
        if scored["first"] is None:
            scored["first"] = window[:NUM_PROMPTS]
        losses, tokens, characters = sequence_losses(model, window, tokenizer)
        scored["sequence_losses"] += losses
        scored["scored_tokens"] += tokens
        scored["characters"] += characters
        scored["read_bytes"] += read_bytes
        clock = time.perf_counter()
    scored["eval_time_s"] = round(time.perf_counter() - started, 3)
    scored["read_time_s"] = round(scored["read_time_s"], 3)
    scored["sequence_losses"] = tuple(scored["sequence_losses"])
    return scored


def evaluate_part(model_url: str, manifest_url: str, *, eval_tokens: int = DEFAULT_EVAL_TOKENS, rank: int = 0,
                  num_workers: int = 1, prompts: list[str] | None = None) -> EvalPart:
    """Worker `rank`'s part of the evaluation of `eval_tokens` validation tokens (0: the whole split)."""
    manifest = load_manifest(manifest_url)
    sample = draw_sample(manifest, eval_tokens)
    pieces = sample.part(rank, num_workers)
    work_dir = Path(tempfile.mkdtemp(prefix="evaluate-"))
    try:
        model, tokenizer = load_model(model_url, manifest_url, manifest, work_dir)
        scored = score_windows(model, tokenizer, read_windows(manifest_url, manifest, pieces))
        first = scored.pop("first")
        log.info("rank %d of %d: %d of the sample's %d sequences (sample %s: %d of %d validation tokens), %d bytes "
                 "read in %.2f s, scored in %.2f s in all", rank, num_workers, len(scored["sequence_losses"]),
                 sample.sequences, sample.sample_id, sample.identity["tokens"], sample.identity["split_tokens"],
                 scored["read_bytes"], scored["read_time_s"], scored["eval_time_s"])
        part = EvalPart(rank=rank, num_workers=num_workers, model=model_url, sample=sample.identity,
                        sequences=len(scored["sequence_losses"]), **scored)
        if rank == 0:
            if first is None or len(first) < NUM_PROMPTS:  # a part shorter than the prompts: the sample's opening
                first = read_part(manifest_url, manifest, sample.part(0, 1)[:NUM_PROMPTS])[0][:NUM_PROMPTS]
            prompt_ids = ([tokenizer(prompt)["input_ids"] for prompt in prompts] if prompts
                          else validation_prompts(first))
            part = dataclasses.replace(part, **text_samples(model, tokenizer, manifest_url, manifest, prompt_ids))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return part


def evaluate(model_url: str, manifest_url: str, *, eval_tokens: int = DEFAULT_EVAL_TOKENS,
             prompts: list[str] | None = None) -> EvalResult:
    """The one-worker evaluation: the whole sample on this process, as a result."""
    result = combine([evaluate_part(model_url, manifest_url, eval_tokens=eval_tokens, prompts=prompts)])
    log_result(result)
    return result


def log_result(result: EvalResult) -> None:
    rates, sample = result.known_words or {}, result.sample or {}
    log.info("eval loss %.4f ± %s, perplexity %.2f, %s nats/char over %s of %s validation tokens (sample %s) in "
             "%.1f s; known words: greedy %s, top-k %s", result.eval_loss, _figure(result.eval_loss_se, ".4f"),
             result.perplexity, _figure(result.nats_per_char, ".3f"), sample.get("tokens"),
             sample.get("split_tokens"), result.sample_id, result.eval_time_s, _figure(rates.get("greedy"), ".0%"),
             _figure(rates.get("top_k"), ".0%"))


def _figure(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="save_pretrained directory (path or URL)")
    parser.add_argument("--manifest", required=True, help="manifest.json of the tokenized dataset")
    parser.add_argument("--output", required=True, help="where to write the result JSON (path or URL)")
    parser.add_argument("--eval-tokens", type=int, default=DEFAULT_EVAL_TOKENS,
                        help=f"validation tokens to score (setting eval_tokens; default {DEFAULT_EVAL_TOKENS}); "
                             "0 = the whole split")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt for the samples, repeatable (default: openings of the validation text)")
    args = parser.parse_args(argv)
    if args.eval_tokens < 0:
        parser.error(f"--eval-tokens (setting eval_tokens) must be 0 or more, got {args.eval_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ["HF_HUB_OFFLINE"] = "1"  # models come from storage only: prepare fetched a hub model once
    args = parse_args(argv)
    configure_worker_logging()
    identity = runtime.worker_identity()
    runtime.signal_ready()  # up means joined; the launcher's hang watchdog takes over from here
    os.environ.pop("TF_CONFIG", None)  # no collective here: each worker scores its part on its own
    manifest = load_manifest(args.manifest)
    batch_tokens = EVAL_BATCH_SIZE * manifest["block_size"]
    if 0 < args.eval_tokens < batch_tokens:
        raise SystemExit(f"error: setting eval_tokens = {args.eval_tokens} is below one evaluation batch "
                         f"({EVAL_BATCH_SIZE} sequences x block_size {manifest['block_size']} = {batch_tokens} "
                         "tokens): raise it, or 0 for the whole validation split.")
    part = evaluate_part(args.model, args.manifest, eval_tokens=args.eval_tokens, rank=identity.rank,
                         num_workers=identity.num_workers, prompts=args.prompt)
    output = part_url(args.output, identity.rank, identity.num_workers)
    if identity.num_workers == 1:
        result = combine([part])
        log_result(result)
        storage.write_json_atomic(output, result.to_json())
        print(f"eval_loss {result.eval_loss:.4f} perplexity {result.perplexity:.2f} -> {output}", flush=True)
    else:
        storage.write_json_atomic(output, part.to_json())
        print(f"rank {identity.rank}: {part.sequences} sequences scored -> {output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
