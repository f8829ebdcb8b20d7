"""Model, loss, schedule and metrics helpers of the trainer, in process on CPU with the tiny preset."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.config import MODEL_PRESETS, RunConfig
from trainer.metrics import MetricsLog

VOCAB = 300


@pytest.fixture(scope="module")
def tiny():
    from trainer.model import Vocabulary, build_model

    return build_model("tiny", Vocabulary(VOCAB, 0), block_size=32, work_dir="/tmp")


def test_loss_is_the_shifted_next_token_cross_entropy(tiny):
    import tensorflow as tf

    from trainer.model import causal_lm_loss

    tokens = tf.constant(np.random.default_rng(0).integers(0, VOCAB, size=(2, 16)), tf.int32)
    logits = tiny(tokens).numpy()
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.mean(np.take_along_axis(log_probs[:, :-1], tokens.numpy()[:, 1:, None], axis=-1))
    assert float(causal_lm_loss(tiny, tokens)) == pytest.approx(expected, rel=1e-5)
    # A random init guesses about uniformly.
    assert expected == pytest.approx(np.log(VOCAB), abs=0.1)


def test_preset_has_the_gpt2_parameter_count_and_no_dropout(tiny):
    from trainer.model import count_parameters, flops_per_token

    shape = MODEL_PRESETS["tiny"]
    e, layers, positions = shape["n_embd"], shape["n_layer"], shape["n_positions"]
    # token + position embeddings, per block (attention 4e^2+4e, MLP 8e^2+5e, two LayerNorms 4e), final LayerNorm.
    expected = VOCAB * e + positions * e + layers * (12 * e * e + 13 * e) + 2 * e
    assert count_parameters(tiny) == expected
    assert flops_per_token(tiny, 32) == 6 * expected + 12 * layers * e * 32
    assert type(tiny).__name__ == "GPT2Decoder" and tiny.compute_dtype.name == "float32"


def test_loading_a_saved_model_resizes_embeddings_to_the_tokenizer(tiny, tmp_path):
    import tensorflow as tf

    from trainer.decoders.pretrained import save_pretrained
    from trainer.model import Vocabulary, build_model

    save_pretrained(tiny, str(tmp_path / "saved"))
    grown = build_model(str(tmp_path / "saved"), Vocabulary(VOCAB + 20, 0), block_size=32,
                        work_dir=tmp_path)
    assert grown.config.vocab_size == VOCAB + 20
    logits = grown(tf.constant([[1, 2, 3]]))
    assert logits.shape == (1, 3, VOCAB + 20)
    # The known rows keep their trained values.
    embedding = "transformer.wte.weight"
    np.testing.assert_allclose(grown.weights[embedding].numpy()[:VOCAB], tiny.weights[embedding].numpy())
    with pytest.raises(ValueError, match="block_size 512"):
        build_model(str(tmp_path / "saved"), Vocabulary(VOCAB, 0), block_size=512, work_dir=tmp_path)
    kept = build_model(str(tmp_path / "saved"), Vocabulary(VOCAB - 10, 0), block_size=32,
                       work_dir=tmp_path, resize_embeddings=False)
    assert kept.config.vocab_size == VOCAB
    with pytest.raises(ValueError, match=f"the tokenizer has {VOCAB + 20} tokens, model .* embeds {VOCAB}: set "
                                         "'resize_embeddings' to true"):
        build_model(str(tmp_path / "saved"), Vocabulary(VOCAB + 20, 0), block_size=32, work_dir=tmp_path,
                    resize_embeddings=False)


def test_a_preset_follows_the_seed_and_computes_in_the_run_precision():
    from trainer.model import Vocabulary, build_model

    def preset(seed, dtype="float32"):
        return build_model("tiny", Vocabulary(VOCAB, 0), block_size=32, work_dir="/tmp", seed=seed,
                           compute_dtype=dtype)

    first, again, other = preset(1), preset(1), preset(2)
    name = "transformer.h.0.attn.c_attn.weight"
    np.testing.assert_array_equal(first.weights[name].numpy(), again.weights[name].numpy())
    assert not np.array_equal(first.weights[name].numpy(), other.weights[name].numpy())
    half = preset(1, "bfloat16")
    assert half.compute_dtype.name == "bfloat16" and half.weights[name].dtype.name == "float32"


def test_a_hub_name_is_refused_with_what_to_do():
    from trainer.model import Vocabulary, build_model

    with pytest.raises(ValueError, match=r"'gpt2' is neither a preset .*models/base/"):
        build_model("gpt2", Vocabulary(VOCAB, 0), block_size=32, work_dir="/tmp")


def test_schedule_warms_up_linearly_then_decays_to_a_tenth():
    from trainer.optim import FINAL_LR_FRACTION
    from trainer.recipe import learning_rate_schedule

    cfg = RunConfig(max_steps=100, warmup_steps=10, learning_rate=1e-3)
    lr = [float(learning_rate_schedule(cfg)(step)) for step in range(101)]
    assert lr[0] == pytest.approx(1e-3 / 11) and lr[0] > 0
    assert np.all(np.diff(lr[:11]) > 0) and lr[10] == pytest.approx(1e-3)
    assert np.all(np.diff(lr[10:]) < 0) and lr[100] == pytest.approx(1e-3 * FINAL_LR_FRACTION)


def test_metrics_log_keeps_each_step_once_after_a_resume(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    first = MetricsLog(path, resume_from_step=0)
    for step in range(1, 8):
        first.write({"step": step, "loss": float(step)})
    first.close()
    resumed = MetricsLog(path, resume_from_step=4)  # the crash lost steps 5..7 with their checkpoint
    for step in range(5, 9):
        resumed.write({"step": step, "loss": 10.0 + step})
    resumed.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[4]["loss"] == 15.0
