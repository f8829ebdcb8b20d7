"""Eval loss and perplexity of a saved model on the validation shards, and a few short generations.

    python -m trainer.evaluate --model URL --manifest URL --output JSON_URL [--max-batches N] [--prompt TEXT]...

The loss is the mean next-token cross-entropy over every predicted token of the validation split (the same
`causal_lm_loss` the trainer optimizes), in float32, in file order, so two evaluations of one model agree exactly.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainer import runtime, storage
from trainer.data import (
    DataError,
    load_manifest,
    stage_shards,
    tokenizer_url,
    worker_shards,
)

log = logging.getLogger("trainer.evaluate")

EVAL_BATCH_SIZE = 8
PROMPT_TOKENS = 16
NUM_PROMPTS = 3
SAMPLE_NEW_TOKENS = 32
SAMPLE_TOP_K = 50
SAMPLE_SEED = 1234


def validation_dataset(manifest_url: str, manifest: dict[str, Any], local_dir: Path, batch_size: int):
    from trainer.data import make_dataset

    shards = worker_shards(manifest, "validation", 0, 1)
    files = stage_shards(manifest_url, shards, local_dir)
    return make_dataset(
        files, block_size=manifest["block_size"], dtype=manifest["dtype"], batch_size=batch_size,
        shuffle=False, seed=0, repeat=False,
    )


def eval_loss(model, dataset, max_batches: int | None) -> tuple[float, int]:
    """Token-weighted mean loss over the dataset (every batch has the same shape) and the tokens scored."""
    import tensorflow as tf

    from trainer.model import causal_lm_loss

    @tf.function
    def batch_loss(tokens):
        return causal_lm_loss(model, tokens, training=False)

    total, batches, tokens = 0.0, 0, 0
    for batch in dataset.take(max_batches) if max_batches else dataset:
        total += float(batch_loss(batch))
        batches += 1
        tokens += int(batch.shape[0]) * (int(batch.shape[1]) - 1)
    if not batches:
        raise DataError("The validation split has no full batch to evaluate: prepare more validation data.")
    return total / batches, tokens


def generate_samples(model, tokenizer, prompts: list[list[int]]) -> list[dict[str, str]]:
    """Per prompt: its text, the greedy continuation and a top-k sample (stateless seed: reproducible)."""
    import tensorflow as tf

    samples = []
    for prompt_ids in prompts:
        common = {"max_new_tokens": SAMPLE_NEW_TOKENS, "pad_token_id": tokenizer.eos_token_id}
        greedy = model.generate(tf.constant([prompt_ids]), do_sample=False, **common)
        top_k = model.generate(tf.constant([prompt_ids]), do_sample=True, top_k=SAMPLE_TOP_K,
                               seed=[SAMPLE_SEED, 0], **common)
        samples.append({
            "prompt": tokenizer.decode(prompt_ids),
            **{mode: tokenizer.decode(output.numpy()[0, len(prompt_ids):], skip_special_tokens=True)
               for mode, output in (("greedy", greedy), ("top_k", top_k))},
        })
    return samples


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
        loss, tokens = eval_loss(model, dataset, max_batches)
        eval_time = time.perf_counter() - started
        prompt_ids = ([tokenizer(prompt)["input_ids"] for prompt in prompts] if prompts
                      else validation_prompts(dataset))
        started = time.perf_counter()
        samples = generate_samples(model, tokenizer, prompt_ids)
        sample_time = time.perf_counter() - started
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    result = {
        "eval_loss": loss, "perplexity": math.exp(loss), "eval_tokens": tokens, "eval_time_s": round(eval_time, 3),
        "samples": samples, "model": model_url,
        "sampling": {"seed": SAMPLE_SEED, "top_k": SAMPLE_TOP_K, "new_tokens": SAMPLE_NEW_TOKENS,
                     "time_s": round(sample_time, 3)},
    }
    log.info("eval loss %.4f, perplexity %.2f over %d tokens in %.1f s", loss, result["perplexity"], tokens, eval_time)
    return result


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
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime.signal_ready()  # a group of one: up means joined; the launcher's hang watchdog takes over from here
    result = evaluate(args.model, args.manifest, max_batches=args.max_batches, prompts=args.prompt)
    storage.write_json_atomic(args.output, result)
    print(f"eval_loss {result['eval_loss']:.4f} perplexity {result['perplexity']:.2f} -> {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
