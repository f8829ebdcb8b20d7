"""trainer/lora.py on every decoder (GPT-2, Llama, Qwen2): a frozen base, adapters that start at zero, train alone
and merge into the weights PEFT would merge them into; recomputed blocks give the same gradients."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from trainer.adamw import AdamW
from trainer.decoders import gpt2_config, llama_config, ops
from trainer.decoders.llama_config import LlamaConfig
from trainer.decoders.pretrained import build_decoder
from trainer.lora import attach_lora, merged_decoder, merged_weights
from trainer.lora_plan import AdaptedModule, LoraPlan, lora_plan
from trainer.model_shapes import shape_of

VOCAB = 320


# architecture -> (its config, an adapted matrix, an embedding, a norm or bias kept in float32)
CONFIGS = {
    "gpt2": (gpt2_config.preset_config("tiny", vocab_size=VOCAB, eos_token_id=0),
             "transformer.h.0.attn.c_attn.weight", "transformer.wte.weight", "transformer.h.0.attn.c_attn.bias"),
    "llama": (llama_config.preset_config("tiny-llama", vocab_size=VOCAB, eos_token_id=0),
              "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight",
              "model.layers.0.input_layernorm.weight"),
    "qwen2": (LlamaConfig(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, tie_word_embeddings=False),
              "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight",
              "model.layers.0.self_attn.k_proj.bias"),
}
ARCHITECTURES = pytest.mark.parametrize("architecture", list(CONFIGS))


def tiny(architecture: str = "gpt2", seed: int = 3):
    return build_decoder(CONFIGS[architecture][0], seed=seed)


def tokens(count: int = 4, length: int = 32, seed: int = 0) -> tf.Tensor:
    return tf.constant(np.random.default_rng(seed).integers(0, VOCAB, (count, length)), tf.int32)


def with_lora(model, rank: int = 4, targets=(), base_dtype: str = "float32"):
    plan = lora_plan(shape_of(model.config), rank=rank, alpha=2 * rank, targets=targets)
    return attach_lora(model, plan, seed=7, base_dtype=base_dtype)


def train(model, steps: int) -> None:
    optimizer = AdamW(model.trainable_variables, 1e-2, weight_decay=0.1)
    for step in range(steps):
        with tf.GradientTape() as tape:
            loss = ops.causal_lm_loss(model, tokens(seed=step))
        optimizer.apply_gradients(tape.gradient(loss, model.trainable_variables))


@ARCHITECTURES
def test_only_the_adapters_train_and_the_base_stays_bit_identical(architecture):
    model = tiny(architecture)
    before = {name: variable.numpy().copy() for name, variable in model.weights.items()}
    logits = model(tokens()).numpy()
    adapters = with_lora(model)
    np.testing.assert_array_equal(model(tokens()).numpy(), logits)  # B starts at zero
    assert [v.name for v in model.trainable_variables] == [v.name for v in adapters.tensors.values()]
    assert not any(isinstance(v, tf.Variable) for v in model.weights.values())
    train(model, 5)
    for name, variable in model.weights.items():
        np.testing.assert_array_equal(variable.numpy(), before[name], err_msg=name)
    assert max(np.abs(v.numpy()).max() for v in adapters._variables[1::2]) > 0  # the B matrices moved
    assert np.abs(model(tokens()).numpy() - logits).max() > 1e-3


@ARCHITECTURES
def test_the_merged_model_gives_the_adapted_models_logits(architecture):
    model = tiny(architecture)
    with_lora(model)
    train(model, 5)
    merged = merged_decoder(model)
    assert merged.adapters is None and all(v.trainable for v in merged.weights.values())  # a plain model again
    difference = np.abs(merged(tokens(seed=9)).numpy() - model(tokens(seed=9)).numpy()).max()
    assert difference < 1e-5, difference


def test_a_linear_layout_merges_b_a_untransposed():
    """Llama's nn.Linear weights are [out, in]: the delta is scaling * B A as it is (PEFT's fan_in_fan_out false)."""
    model = tiny()
    plan = lora_plan(shape_of(model.config), rank=2, alpha=2, targets=("c_fc",))
    adapters = attach_lora(model, plan, seed=1)
    for variable in adapters._variables:
        variable.assign(tf.random.normal(variable.shape, seed=5))
    module = "transformer.h.0.mlp.c_fc"
    lora_a, lora_b = (v.numpy() for v in adapters.pair(module))
    np.testing.assert_allclose(adapters.weight_delta(module), (lora_b @ lora_a).T, rtol=1e-6)
    linear = LoraPlan(2, 2.0, ("c_fc",), (AdaptedModule(module, 64, 256),), fan_in_fan_out=False)
    adapters.plan = linear
    np.testing.assert_allclose(adapters.weight_delta(module), lora_b @ lora_a, rtol=1e-6)


@ARCHITECTURES
def test_a_bfloat16_base_stores_its_matrices_in_half_and_still_trains(architecture):
    model = tiny(architecture)
    _, matrix, embedding, vector = CONFIGS[architecture]
    logits = model(tokens()).numpy()
    with_lora(model, base_dtype="bfloat16")
    dtypes = {name: v.dtype for name, v in model.weights.items()}
    assert dtypes[matrix] == dtypes[embedding] == tf.bfloat16
    assert dtypes[vector] == tf.float32
    assert np.abs(model(tokens()).numpy() - logits).max() < 0.05  # the weights rounded to bfloat16
    train(model, 2)
    assert all(v.dtype == np.float32 for v in merged_weights(model).values())


@ARCHITECTURES
@pytest.mark.parametrize("lora", [False, True])
def test_recomputed_blocks_give_the_same_loss_and_gradients(architecture, lora):
    model = tiny(architecture)
    if lora:
        with_lora(model)
        for variable in model.trainable_variables:
            variable.assign(tf.random.normal(variable.shape, stddev=0.05, seed=2))

    def loss_and_gradients():
        with tf.GradientTape() as tape:
            loss = ops.causal_lm_loss(model, tokens())
        return loss.numpy(), tape.gradient(loss, model.trainable_variables)

    loss, gradients = loss_and_gradients()
    model.recompute = True
    recomputed_loss, recomputed = loss_and_gradients()
    assert recomputed_loss == loss
    for variable, expected, got in zip(model.trainable_variables, gradients, recomputed, strict=True):
        np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), tf.convert_to_tensor(expected).numpy(),
                                   atol=1e-6, err_msg=variable.name)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_linear_model_merges_into_its_out_in_weights_and_adapts_what_the_targets_name(architecture):
    """nn.Linear weights [out, in]: the merged weight is W + scaling * B A; only the named projections change."""
    model = tiny(architecture)
    before = {name: variable.numpy().copy() for name, variable in model.weights.items()}
    adapters = with_lora(model, rank=2, targets=("v_proj", "down_proj"))
    assert sorted(adapters.modules) == [f"model.layers.{layer}.{path}" for layer in (0, 1)
                                        for path in ("mlp.down_proj", "self_attn.v_proj")]
    train(model, 2)
    merged = merged_weights(model)
    module = "model.layers.1.self_attn.v_proj"
    lora_a, lora_b = (v.numpy() for v in adapters.pair(module))
    np.testing.assert_allclose(merged[module + ".weight"] - before[module + ".weight"],
                               (lora_b @ lora_a) * adapters.plan.scaling, atol=1e-7)
    for name, value in merged.items():
        if name.removesuffix(".weight") not in adapters.modules:
            np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_a_frozen_base_costs_4_flops_per_weight_and_its_adapters_6():
    model = tiny("gpt2")
    config, block = model.config, 32
    attention = 12 * config.n_layer * config.n_head * config.head_width * block
    base = ops.count_parameters(model)
    assert ops.flops_per_token(model, block) == 6 * base + attention
    adapters = with_lora(model)
    assert ops.count_parameters(model) == base  # the adapters are counted apart
    assert ops.flops_per_token(model, block) == 4 * base + 6 * adapters.plan.parameters + attention
