"""The TensorFlow GPT-2 against PyTorch + transformers 5 and transformers 4.57's TFGPT2LMHeadModel on the golden
fixture (fixtures/make_gpt2_golden.py), its init, mixed precision, strategies and checkpoints, on CPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.config import MODEL_PRESETS
from tests.trainer.decoders.golden import FIXTURES, GOLDEN, INPUT_IDS, arrays

LOGITS_TOLERANCE = 1e-5  # absolute, float32 (issue 50)
LOSS_TOLERANCE = 1e-6  # relative


@pytest.fixture(scope="module")
def golden_model():
    from trainer.decoders.pretrained import load_pretrained

    return load_pretrained(FIXTURES / "gpt2-tiny")


def test_logits_and_greedy_tokens_match_pytorch_and_tfgpt2(golden_model):
    import tensorflow as tf

    reference = arrays()
    for logits in (golden_model(INPUT_IDS).numpy(), tf.function(golden_model.__call__)(INPUT_IDS).numpy()):
        assert logits.dtype == np.float32 and logits.shape == (2, 16, 100)
        assert np.max(np.abs(logits - reference["logits"])) <= LOGITS_TOLERANCE
        np.testing.assert_array_equal(logits.argmax(-1), GOLDEN["greedy_next_tokens"])
    # The path this replaces computed the same: old == new == PyTorch.
    assert np.max(np.abs(reference["tf_gpt2_logits"] - reference["logits"])) <= LOGITS_TOLERANCE


def test_the_other_attention_settings_match_pytorchs_on_the_same_weights(golden_model):
    """Unscaled scores divided by the block's index + 1, and scores upcast to float32 (GPT2Config's VARIANT)."""
    import dataclasses

    from trainer.decoders.gpt2 import GPT2Decoder

    config = dataclasses.replace(golden_model.config, **GOLDEN["variant"])
    variant = GPT2Decoder(config, initializer=lambda name, shape: golden_model.weights[name].numpy())
    logits = variant(INPUT_IDS).numpy()
    reference = arrays()["variant_logits"]
    assert np.max(np.abs(logits - reference)) <= LOGITS_TOLERANCE
    assert np.max(np.abs(reference - arrays()["logits"])) > 0.1  # the settings change the logits


def test_loss_matches_pytorchs_causal_lm_loss(golden_model):
    from trainer.decoders.ops import causal_lm_loss, token_losses

    losses = token_losses(golden_model, INPUT_IDS).numpy()
    assert losses.shape == (2, 15) and losses.dtype == np.float32
    assert float(causal_lm_loss(golden_model, INPUT_IDS)) == pytest.approx(GOLDEN["loss"], rel=LOSS_TOLERANCE)


def test_greedy_continuation_matches_transformers_generate(golden_model):
    tokens = INPUT_IDS[:1]
    for _ in GOLDEN["greedy_continuation"]:
        next_token = golden_model(tokens).numpy()[:, -1].argmax(-1)
        tokens = np.concatenate([tokens, next_token[:, None].astype(np.int32)], axis=1)
    assert tokens[0, INPUT_IDS.shape[1]:].tolist() == GOLDEN["greedy_continuation"]


def test_attention_is_causal_a_later_token_changes_no_earlier_logit(golden_model):
    changed = INPUT_IDS.copy()
    changed[:, 10] = (changed[:, 10] + 1) % 100
    before, after = golden_model(INPUT_IDS).numpy(), golden_model(changed).numpy()
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert np.max(np.abs(before[:, 10:] - after[:, 10:])) > 1e-4


def test_preset_init_is_gpt2s_and_a_function_of_the_seed():
    from trainer.decoders.gpt2 import GPT2Decoder
    from trainer.decoders.gpt2_config import preset_config

    config = preset_config("tiny", vocab_size=300, eos_token_id=0)
    weights = {name: variable.numpy() for name, variable in GPT2Decoder(config, seed=3).weights.items()}
    assert all(not value.any() for name, value in weights.items() if name.endswith(".bias"))
    assert all((value == 1).all() for name, value in weights.items() if ".ln_" in name and name.endswith("weight"))
    assert np.std(weights["transformer.wte.weight"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(weights["transformer.h.0.mlp.c_fc.weight"]) == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / math.sqrt(2 * config.n_layer)
    assert np.std(weights["transformer.h.1.mlp.c_proj.weight"]) == pytest.approx(scaled, rel=0.05)
    assert not np.array_equal(weights["transformer.h.0.attn.c_attn.weight"],
                              weights["transformer.h.1.attn.c_attn.weight"])
    again = GPT2Decoder(config, seed=3).weights["transformer.h.1.attn.c_attn.weight"].numpy()
    other = GPT2Decoder(config, seed=4).weights["transformer.h.1.attn.c_attn.weight"].numpy()
    np.testing.assert_array_equal(again, weights["transformer.h.1.attn.c_attn.weight"])
    assert not np.array_equal(other, again)


def test_parameter_count_and_flops_per_token_of_a_preset():
    from trainer.decoders.gpt2 import GPT2Decoder
    from trainer.decoders.gpt2_config import preset_config
    from trainer.decoders.ops import count_parameters, flops_per_token

    vocab = 300
    model = GPT2Decoder(preset_config("tiny", vocab_size=vocab, eos_token_id=0))
    shape = MODEL_PRESETS["tiny"]
    e, layers, positions = shape["n_embd"], shape["n_layer"], shape["n_positions"]
    # token + position embeddings, per block (attention 4e^2+4e, MLP 8e^2+5e, two LayerNorms 4e), final LayerNorm.
    expected = vocab * e + positions * e + layers * (12 * e * e + 13 * e) + 2 * e
    assert count_parameters(model) == expected
    assert flops_per_token(model, 32) == 6 * expected + 12 * layers * e * 32


# Logits reach 3.4: bfloat16 keeps 8 bits of mantissa, float16 11 (measured 0.039 and 0.0047).
@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 0.1), ("float16", 0.02)])
def test_mixed_precision_keeps_float32_variables_and_logits_and_trains(golden_model, dtype, tolerance):
    import tensorflow as tf

    from trainer.decoders.ops import causal_lm_loss
    from trainer.decoders.pretrained import load_pretrained

    model = load_pretrained(FIXTURES / "gpt2-tiny", compute_dtype=dtype)
    logits = model(INPUT_IDS)
    assert logits.dtype == tf.float32 and all(v.dtype == tf.float32 for v in model.trainable_variables)
    reference = golden_model(INPUT_IDS).numpy()
    assert 0 < np.max(np.abs(logits.numpy() - reference)) <= tolerance
    with tf.GradientTape() as tape:
        loss = causal_lm_loss(model, INPUT_IDS)
    gradients = tape.gradient(loss, model.trainable_variables)
    assert all(g is not None and g.dtype == tf.float32 for g in gradients)
    assert float(loss) == pytest.approx(GOLDEN["loss"], rel=1e-2)


def test_built_in_a_strategy_scope_its_variables_are_mirrored_and_a_checkpoint_restores_them(tmp_path):
    import tensorflow as tf

    from trainer.decoders.ops import causal_lm_loss
    from trainer.decoders.pretrained import load_pretrained

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # one worker: no TF_CONFIG
    with strategy.scope():
        model = load_pretrained(FIXTURES / "gpt2-tiny")
    assert all(isinstance(v, tf.distribute.DistributedValues) for v in model.trainable_variables)

    @tf.function
    def replica_loss(tokens):
        per_replica = strategy.run(lambda tokens: causal_lm_loss(model, tokens), args=(tokens,))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

    assert float(replica_loss(tf.constant(INPUT_IDS))) == pytest.approx(GOLDEN["loss"], rel=LOSS_TOLERANCE)
    saved = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    before = model(INPUT_IDS).numpy()
    for variable in model.trainable_variables:
        variable.assign_add(tf.fill(variable.shape, 0.01))
    assert np.max(np.abs(model(INPUT_IDS).numpy() - before)) > 1e-3
    tf.train.Checkpoint(model=model).restore(saved).assert_consumed()
    np.testing.assert_array_equal(model(INPUT_IDS).numpy(), before)


def test_unknown_compute_dtype_is_refused():
    from trainer.decoders.gpt2 import GPT2Decoder
    from trainer.decoders.gpt2_config import GPT2Config

    with pytest.raises(ValueError, match="compute_dtype 'float64' is not one of float32, bfloat16, float16"):
        GPT2Decoder(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, n_positions=8), compute_dtype="float64")
