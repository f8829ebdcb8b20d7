"""The TensorFlow Llama / Qwen2 decoder against PyTorch + transformers 5 on the golden fixtures
(fixtures/make_llama_golden.py: llama3 rotary with grouped-query attention, an untied head and Llama's biases;
linear rotary with one key/value head and a tied head; Qwen2's q/k/v biases), its checkpoints and its preset."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.trainer.decoders.llama_golden import CASES, FIXTURES, GOLDEN, INPUT_IDS, logits

LOGITS_TOLERANCE = 1e-5  # absolute, float32 (issue 51)
LOSS_TOLERANCE = 1e-6  # relative


@pytest.fixture(scope="module")
def models():
    from trainer.decoders.pretrained import load_pretrained

    return {case: load_pretrained(FIXTURES / case) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_logits_greedy_tokens_and_loss_match_pytorchs(models, case):
    import tensorflow as tf

    from trainer.decoders.ops import causal_lm_loss

    model = models[case]
    for found in (model(INPUT_IDS).numpy(), tf.function(model.__call__, jit_compile=False)(INPUT_IDS).numpy()):
        assert found.dtype == np.float32 and found.shape == (2, 16, 100)
        difference = float(np.max(np.abs(found - logits(case))))
        print(f"{case}: largest |logit difference| {difference:.2e}")
        assert difference <= LOGITS_TOLERANCE
        np.testing.assert_array_equal(found.argmax(-1), GOLDEN["cases"][case]["greedy_next_tokens"])
    loss = float(causal_lm_loss(model, tf.constant(INPUT_IDS)))
    assert loss == pytest.approx(GOLDEN["cases"][case]["loss"], rel=LOSS_TOLERANCE)


def test_the_cases_cover_what_issue_51_names(models):
    configs = {case: model.config for case, model in models.items()}
    assert {config.rope["rope_type"] for config in configs.values()} == {"llama3", "linear", "default"}
    assert {config.tie_word_embeddings for config in configs.values()} == {True, False}
    assert all(config.kv_heads < config.num_attention_heads for config in configs.values())  # grouped-query
    assert configs["qwen2-bias-gqa"].architecture == "Qwen2ForCausalLM"
    assert "model.layers.0.self_attn.k_proj.bias" in models["qwen2-bias-gqa"].weights
    assert "model.layers.0.self_attn.o_proj.bias" not in models["qwen2-bias-gqa"].weights
    assert "model.layers.1.mlp.down_proj.bias" in models["llama3-gqa-untied"].weights


def test_attention_is_causal_a_later_token_changes_no_earlier_logit(models):
    model = models["qwen2-bias-gqa"]
    changed = INPUT_IDS.copy()
    changed[:, 10] = (changed[:, 10] + 1) % 100
    before, after = model(INPUT_IDS).numpy(), model(changed).numpy()
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert np.max(np.abs(before[:, 10:] - after[:, 10:])) > 1e-3


@pytest.mark.parametrize("case", CASES)
def test_save_then_load_is_bit_exact_and_writes_what_transformers_5_writes(models, case, tmp_path):
    from safetensors.numpy import load_file

    from trainer.decoders.pretrained import load_pretrained, save_pretrained

    model = models[case]
    names = save_pretrained(model, str(tmp_path / "saved"))
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    written = json.loads((tmp_path / "saved" / "config.json").read_text())
    original = json.loads((FIXTURES / case / "config.json").read_text())
    del original["transformers_version"]
    assert written == original
    ours, theirs = load_file(str(tmp_path / "saved" / "model.safetensors")), load_file(
        str(FIXTURES / case / "model.safetensors"))
    assert list(ours) == sorted(theirs) and all(np.array_equal(ours[name], theirs[name]) for name in theirs)
    generation = json.loads((FIXTURES / case / "generation_config.json").read_text())
    del generation["transformers_version"]
    assert json.loads((tmp_path / "saved" / "generation_config.json").read_text()) == generation
    reloaded = load_pretrained(tmp_path / "saved")
    np.testing.assert_array_equal(reloaded(INPUT_IDS).numpy(), model(INPUT_IDS).numpy())


def test_a_transformers_4_config_reads_as_the_same_model(models, tmp_path):
    """Hub checkpoints written by transformers 4 carry rope_theta and rope_scaling (with `type` in older ones)."""
    from trainer.decoders.pretrained import load_pretrained

    directory = tmp_path / "v4"
    shutil.copytree(FIXTURES / "llama3-gqa-untied", directory)
    config = json.loads((directory / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (directory / "config.json").write_text(json.dumps(config))
    found = load_pretrained(directory)(INPUT_IDS).numpy()
    assert np.max(np.abs(found - logits("llama3-gqa-untied"))) <= LOGITS_TOLERANCE


def test_a_larger_tokenizer_grows_the_embedding_and_an_untied_head_together(models):
    from trainer.decoders.pretrained import load_pretrained

    grown = load_pretrained(FIXTURES / "llama3-gqa-untied", vocab_size=120)
    weights, original = grown.weights, models["llama3-gqa-untied"].weights
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert tuple(weights[name].shape) == (120, 32)
        np.testing.assert_array_equal(weights[name].numpy()[:100], original[name].numpy())
    assert not np.array_equal(weights["model.embed_tokens.weight"].numpy()[100:],
                              weights["lm_head.weight"].numpy()[100:])
    np.testing.assert_allclose(grown(INPUT_IDS).numpy()[..., :100], logits("llama3-gqa-untied"), atol=LOGITS_TOLERANCE)


def test_the_tiny_llama_preset_trains_from_scratch_and_is_a_function_of_the_seed():
    import tensorflow as tf

    from trainer.decoders.ops import causal_lm_loss, count_parameters
    from trainer.decoders.pretrained import build_preset

    model = build_preset("tiny-llama", vocab_size=300, eos_token_id=0, block_size=32, seed=3)
    config = model.config
    assert (config.architecture, config.kv_heads, config.tie_word_embeddings) == ("LlamaForCausalLM", 2, True)
    assert "lm_head.weight" not in model.weights
    width, inner = 64, 176
    block = width * width * 2 + width * (width // 2) * 2 + 3 * width * inner + 2 * width
    assert count_parameters(model) == 300 * width + 2 * block + width
    again = build_preset("tiny-llama", vocab_size=300, eos_token_id=0, block_size=32, seed=3)
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(model.weights.values(), again.weights.values()))
    tokens = tf.constant(np.random.default_rng(0).integers(0, 300, (4, 32)), tf.int32)
    variables = list(model.weights.values())
    first = None
    for _ in range(5):
        with tf.GradientTape() as tape:
            loss = causal_lm_loss(model, tokens)
        first = first if first is not None else float(loss)
        for variable, gradient in zip(variables, tape.gradient(loss, variables), strict=True):
            variable.assign_sub(0.5 * gradient)
    assert float(loss) < first - 0.1


def test_built_in_a_strategy_scope_its_variables_are_mirrored():
    import tensorflow as tf

    from trainer.decoders.pretrained import build_preset

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = build_preset("tiny-llama", vocab_size=64, eos_token_id=0, block_size=16)
    assert all(isinstance(variable, tf.distribute.DistributedValues) for variable in model.trainable_variables)
    assert len(model.trainable_variables) == len(model.weights)
