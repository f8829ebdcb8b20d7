"""trainer.evaluate: the saved model (a Hugging Face checkpoint) loads with load_pretrained and scores exactly like
the trained weights, on a bounded sample of the validation split that any number of workers score alike."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.eval_result import EvalResult
from tests.trainer.shards import write_dataset

pytest_plugins = ["tests.support.s3server"]

REPO = Path(__file__).resolve().parents[2]
CONFIG = {
    "num_workers": 1, "model": "tiny", "tokenizer": "bpe:320", "block_size": 32, "batch_size_per_worker": 4,
    "max_steps": 8, "warmup_steps": 2, "learning_rate": 3e-3, "checkpoint_every_steps": 4,
}


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory):
    """The tiny preset trained 24 AdamW steps in this process, written by the chief's export_model (no formats
    checked: tests/trainer/test_export.py does), with the dataset it came from."""
    from tests.trainer.tiny_output import trained_decoder, write_output

    root = tmp_path_factory.mktemp("evaluate")
    manifest = write_dataset(root / "dataset", sorted((REPO / "data" / "sample").glob("*.txt")),
                             block_size=32, vocab_size=320, num_train_shards=2, max_chars=30_000)
    model = trained_decoder(manifest, steps=24)
    output = root / "train"
    write_output(model, manifest, str(output), root / "work", export_formats=[])
    return manifest, output, model


@pytest.fixture(scope="module")
def trained(trained_model):
    manifest, output, _ = trained_model
    return manifest, output


def test_saved_model_scores_like_the_trained_weights(trained_model):
    from transformers import AutoTokenizer

    from trainer.data import load_manifest
    from trainer.eval_sample import draw_sample, read_part
    from trainer.evaluate import evaluate, sequence_losses

    manifest_url, output, model = trained_model
    manifest = load_manifest(manifest_url)
    # The checkpoint and the tokenizer as transformers 5 saves a fast one (tokenizer.json, no vocab/merges files).
    assert sorted(path.name for path in (output / "model").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    sequences, _ = read_part(manifest_url, manifest, draw_sample(manifest, 0).part(0, 1))  # the whole split
    tokenizer = AutoTokenizer.from_pretrained(str(output / "model"))
    losses, tokens, characters = sequence_losses(model, sequences, tokenizer)

    result = evaluate(str(output / "model"), manifest_url, eval_tokens=0)
    assert result.eval_loss == pytest.approx(math.fsum(losses) / len(losses), abs=1e-6)
    assert result.eval_characters == characters > tokens
    assert result.eval_tokens == tokens == len(sequences) * 31 > 0
    assert result.sample["whole_split"] is True and result.eval_loss_se == 0.0
    assert result.perplexity == pytest.approx(math.exp(result.eval_loss))
    # Trained weights, not a fresh init: far below the uniform-guess loss log(vocab).
    assert result.eval_loss < math.log(manifest["tokenizer"]["vocab_size"]) - 0.3


def test_cli_writes_the_result_json(trained, tmp_path):
    manifest_url, output = trained
    result_path = tmp_path / "eval" / "result.json"
    completed = subprocess.run(
        [sys.executable, "-m", "trainer.evaluate", "--model", str(output / "model"), "--manifest", manifest_url,
         "--output", str(result_path), "--eval-tokens", "512", "--prompt", "Enter the king", "--prompt", "Thunder"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=180,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    written = json.loads(result_path.read_text())
    assert {"eval_loss", "perplexity", "eval_tokens", "eval_time_s", "samples"} <= set(written)
    result = EvalResult.from_json(written, str(result_path))
    assert result.eval_tokens == 2 * 8 * 31
    assert [sample["prompt"] for sample in result.samples] == ["Enter the king", "Thunder"]
    assert all(sample["greedy"] and sample["top_k"] for sample in result.samples)
    assert "eval_loss" in completed.stdout
    # Nats per character: the same total nats spread over the characters the scored tokens spell.
    assert result.eval_characters > result.eval_tokens
    assert result.nats_per_char == pytest.approx(
        result.eval_loss * result.eval_tokens / result.eval_characters)
    known = result.known_words
    assert set(known) == {"greedy", "top_k", "words"} and result.sampling["vocabulary_words"] > 100
    assert all(known[mode] is None or 0.0 <= known[mode] <= 1.0 for mode in ("greedy", "top_k"))


def test_eval_tokens_below_one_batch_is_refused_by_name(trained, tmp_path):
    manifest_url, output = trained
    completed = subprocess.run(
        [sys.executable, "-m", "trainer.evaluate", "--model", str(output / "model"), "--manifest", manifest_url,
         "--output", str(tmp_path / "result.json"), "--eval-tokens", "100"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=180,
        check=False)
    assert completed.returncode != 0 and not (tmp_path / "result.json").exists()
    assert "setting eval_tokens = 100 is below one evaluation batch (8 sequences x block_size 32" in completed.stderr


@pytest.fixture(scope="module")
def large_validation(tmp_path_factory):
    """The trained model's texts tokenized again with half of them held out (the same tokenizer: the same texts and
    vocabulary), in records of 16 sequences: a validation split of about 550 sequences."""
    return write_dataset(tmp_path_factory.mktemp("large-validation"), sorted((REPO / "data" / "sample").glob("*.txt")),
                         block_size=32, vocab_size=320, num_train_shards=2, max_chars=30_000, val_fraction=0.5,
                         sequences_per_record=16)


def test_a_split_20x_eval_tokens_is_sampled_within_bounds_alike_every_time_and_on_two_workers(
        trained, large_validation, monkeypatch):
    """Evaluate reads at most `eval_tokens` plus one batch of a split 20 times larger, scores the same sequences
    twice, reports tokens evaluated / total with a standard error, and two workers' parts combine to the one-worker
    result within 1e-5 nats."""
    from core.eval_result import combine
    from trainer import eval_sample
    from trainer.data import load_manifest
    from trainer.evaluate import EVAL_BATCH_SIZE, evaluate, evaluate_part

    manifest = load_manifest(large_validation)
    split_tokens = manifest["splits"]["validation"]["tokens"]
    eval_tokens = split_tokens // 20
    assert eval_tokens >= EVAL_BATCH_SIZE * 32
    reads: list[tuple[str, int, int]] = []
    read_ranges = eval_sample._read_ranges
    monkeypatch.setattr(eval_sample, "_read_ranges", lambda where, ranges: reads.extend(ranges) or read_ranges(
        where, ranges))
    model = str(trained[1] / "model")

    first = evaluate(model, large_validation, eval_tokens=eval_tokens)

    read_bytes = sum(end - start for name, start, end in reads if name.startswith("validation"))
    assert read_bytes == first.sample["read_bytes"] <= (eval_tokens + EVAL_BATCH_SIZE * 32) * 2  # uint16
    sample = first.sample
    assert (sample["tokens"], sample["split_tokens"]) == (eval_tokens // 32 * 32, split_tokens)
    assert sample["whole_split"] is False and sample["sequences"] == len(first.sequence_losses)
    assert 0 < first.eval_loss_se < 0.5 and math.isfinite(first.eval_loss)
    again = evaluate(model, large_validation, eval_tokens=eval_tokens)
    assert again.sample["id"] == sample["id"] and again.sequence_losses == first.sequence_losses
    assert again.eval_loss == first.eval_loss

    halves = combine([evaluate_part(model, large_validation, eval_tokens=eval_tokens, rank=rank, num_workers=2)
                      for rank in (1, 0)])
    print(f"one worker {first.eval_loss:.8f} ± {first.eval_loss_se:.4f}, two workers "
          f"{halves.eval_loss:.8f}: |delta| {abs(halves.eval_loss - first.eval_loss):.1e} nats over "
          f"{sample['tokens']} of {split_tokens} tokens")
    assert abs(halves.eval_loss - first.eval_loss) < 1e-5
    assert halves.sequence_losses == pytest.approx(first.sequence_losses, abs=1e-5)
    assert halves.eval_loss_se == pytest.approx(first.eval_loss_se, abs=1e-5)
    assert (halves.eval_tokens, halves.eval_characters) == (first.eval_tokens, first.eval_characters)
    assert halves.samples == first.samples  # rank 0 writes them, from the sample's first sequences


def test_samples_continue_validation_openings_the_same_way_every_time(trained):
    """Greedy and top-k continuations of the first validation sequences' openings, under a fixed seed."""
    from trainer.evaluate import NUM_PROMPTS, evaluate

    manifest_url, output = trained
    first = evaluate(str(output / "model"), manifest_url, eval_tokens=256)
    again = evaluate(str(output / "model"), manifest_url, eval_tokens=256)
    assert len(first.samples) == NUM_PROMPTS
    assert len({sample["prompt"] for sample in first.samples}) == NUM_PROMPTS  # distinct openings
    # A few steps of the tiny model continue greedily with line breaks alone; its top-k samples hold text.
    assert all(sample["prompt"] and sample["greedy"] and sample["top_k"].strip() for sample in first.samples)
    assert again.samples == first.samples
    assert first.sampling["seed"] == again.sampling["seed"]


def _uniform_logits(tokens):
    """Equal logits for every token: a sampler that reuses one draw picks the same token at every step."""
    import tensorflow as tf

    return tf.zeros([tokens.shape[1], 50])


def test_top_k_draws_anew_at_every_step_and_repeats_under_the_same_seed():
    """A sampler passing one stateless seed to every step repeats one draw (`will will will`); each step has its own
    seed, and the same seed still gives the same sample."""
    from trainer.evaluate import SAMPLE_NEW_TOKENS, continuation

    sample = continuation(_uniform_logits, 64, [1, 2, 3], top_k=50, seed=7)
    assert len(sample) == SAMPLE_NEW_TOKENS and len(set(sample)) > SAMPLE_NEW_TOKENS // 2
    assert continuation(_uniform_logits, 64, [1, 2, 3], top_k=50, seed=7) == sample
    assert continuation(_uniform_logits, 64, [1, 2, 3], top_k=50, seed=8) != sample


def test_padding_the_context_to_one_length_leaves_the_greedy_continuation_as_it_was(trained):
    """The traced forward pads every context on the right to one length: causal attention must make that
    invisible, so the greedy tokens equal those of the model called on the bare context at every step."""
    import tensorflow as tf

    from trainer.decoders.pretrained import load_pretrained
    from trainer.evaluate import SAMPLE_NEW_TOKENS, continuation, logits_function

    _, output = trained
    model = load_pretrained(output / "model")
    prompt = [5, 17, 42, 9, 77, 3]
    ids = list(prompt)
    for _ in range(SAMPLE_NEW_TOKENS):
        ids.append(int(tf.argmax(model(tf.constant([ids]))[0, -1])))
    padded = continuation(logits_function(model), model.config.n_positions, prompt, top_k=None, seed=0)
    assert padded == ids[len(prompt):]


def test_a_sample_goes_on_past_the_end_of_a_document_on_a_new_line():
    from trainer.evaluate import decode_sample

    class Tokenizer:
        eos_token_id = 0

        def decode(self, ids):
            return "".join(chr(ord("a") + token) for token in ids)

    assert decode_sample(Tokenizer(), [1, 2, 0, 3, 0, 0, 4]) == "bc\nd\ne"


def test_train_resume_and_evaluate_on_object_storage(trained, s3_bucket):
    """Dataset, checkpoints, metrics, model and result on a real S3-protocol server: a longer retry resumes."""
    from core import storage
    from trainer.evaluate import evaluate
    from trainer.train import main

    manifest_path, _ = trained
    dataset = f"{s3_bucket}/{Path(manifest_path).parent.name}"  # a dataset lies in the directory of its fingerprint
    storage.upload_tree(Path(manifest_path).parent, dataset)
    config_url, output = f"{s3_bucket}/config.json", f"{s3_bucket}/train"
    for steps in (4, 6):  # the second run finds step 4 in the bucket and trains two more
        storage.write_json_atomic(config_url, {**CONFIG, "max_steps": steps, "checkpoint_every_steps": 2})
        assert main(["--config", config_url, "--manifest", f"{dataset}/manifest.json", "--output", output]) == 0

    summary = storage.read_json(f"{output}/summary.json")
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6
    lines = storage.read_bytes(f"{output}/metrics/rank-0.jsonl").decode().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    checkpoints = set(storage.list_dir(f"{output}/checkpoints"))
    assert {"checkpoint", "ckpt-6.index"} <= checkpoints and "ckpt-2.index" not in checkpoints  # rotated
    result = evaluate(f"{output}/model", f"{dataset}/manifest.json", eval_tokens=512)  # ranged reads of the bucket
    assert math.isfinite(result.eval_loss) and result.eval_tokens == 2 * 8 * 31
