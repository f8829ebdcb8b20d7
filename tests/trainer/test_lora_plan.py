"""trainer/lora_plan.py and trainer/model_shapes.py: LoRA's targets and rank checked against the model's shape, for
GPT-2 and Llama/Qwen2 config.json fields, without TensorFlow."""

from __future__ import annotations

import dataclasses
import json

import pytest

from core.config import ConfigError, RunConfig
from trainer.lora_plan import lora_plan, model_shape, plan_lora
from trainer.model_shapes import decoder_shape

TINY = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 256, "vocab_size": 320}
# Qwen2-0.5B's config.json fields (grouped-query attention: 14 heads, 2 key/value heads).
QWEN2 = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
         "num_key_value_heads": 2, "num_hidden_layers": 24, "vocab_size": 151936, "tie_word_embeddings": True}


def test_gpt2_targets_name_huggingfaces_conv1d_modules_and_c_proj_is_both_projections():
    plan = lora_plan(decoder_shape(TINY), rank=4, alpha=8, targets=["c_attn", "c_proj"])
    assert [m.path for m in plan.modules] == [
        "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_proj",
        "transformer.h.1.attn.c_attn", "transformer.h.1.attn.c_proj", "transformer.h.1.mlp.c_proj"]
    assert (plan.modules[0].in_features, plan.modules[0].out_features) == (64, 192)
    assert (plan.modules[2].in_features, plan.modules[2].out_features) == (256, 64)
    assert plan.fan_in_fan_out and plan.scaling == 2.0
    assert plan.parameters == 2 * 4 * ((64 + 192) + (64 + 64) + (256 + 64))


def test_empty_targets_mean_all_of_the_architectures_and_llama_layouts_are_linear():
    plan = lora_plan(decoder_shape(QWEN2), rank=8, alpha=16, targets=())
    assert plan.targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert not plan.fan_in_fan_out and len(plan.modules) == 7 * 24
    widths = {m.path.rsplit(".", 1)[1]: (m.in_features, m.out_features) for m in plan.modules[:7]}
    assert widths["k_proj"] == (896, 128) and widths["q_proj"] == (896, 896) and widths["down_proj"] == (4864, 896)


@pytest.mark.parametrize("targets, fragments", [
    (["q_proj"], ["'lora_targets' names ['q_proj']", "GPT-2 lacks", "c_attn, c_proj, c_fc"]),
    (["c_attn", "wte"], ["['wte']", "GPT-2 lacks"]),
])
def test_a_target_the_architecture_lacks_is_refused_by_name(targets, fragments):
    with pytest.raises(ConfigError) as raised:
        lora_plan(decoder_shape(TINY), rank=4, alpha=8, targets=targets)
    assert all(fragment in str(raised.value) for fragment in fragments), raised.value


def test_a_gpt2_target_on_qwen2_is_refused_naming_its_projections():
    with pytest.raises(ConfigError, match=r"\['c_attn'\], which Qwen2 lacks: its projections are q_proj, k_proj"):
        lora_plan(decoder_shape(QWEN2), rank=4, alpha=8, targets=["c_attn"])


def test_a_gpt2_target_on_the_tiny_llama_preset_is_refused_naming_the_llama_modules():
    cfg = RunConfig(model="tiny-llama", adapter="lora", lora_rank=4, lora_targets=("c_attn", "q_proj"))
    with pytest.raises(ConfigError, match=r"\['c_attn'\], which Llama lacks: its projections are q_proj, k_proj, "
                                          r"v_proj, o_proj, gate_proj, up_proj, down_proj"):
        plan_lora(cfg, model_shape(cfg, 320))
    shape = model_shape(RunConfig(model="tiny-llama"), 320)
    assert (shape.model_type, shape.hidden, shape.kv_heads, shape.vocab) == ("llama", 64, 2, 320)


def test_a_rank_above_the_narrowest_adapted_layer_is_refused_naming_it():
    assert lora_plan(decoder_shape(TINY), rank=64, alpha=8, targets=()).rank == 64
    with pytest.raises(ConfigError) as raised:
        lora_plan(decoder_shape(TINY), rank=65, alpha=8, targets=())
    assert "'lora_rank' = 65 exceeds the width of transformer.h.0.attn.c_attn (64 in, 192 out)" in str(raised.value)
    assert "Lower 'lora_rank' to 64 or less" in str(raised.value)
    with pytest.raises(ConfigError, match=r"'lora_rank' = 129 exceeds the width of model.layers.0.self_attn.k_proj"):
        lora_plan(decoder_shape(QWEN2), rank=129, alpha=8, targets=["k_proj"])


def test_rank_zero_is_refused_by_the_config_and_by_the_plan():
    with pytest.raises(ConfigError, match="'lora_rank' = 0"):
        RunConfig(adapter="lora", lora_rank=0)
    with pytest.raises(ConfigError, match="'lora_rank' = 0 must be at least 1"):
        lora_plan(decoder_shape(TINY), rank=0, alpha=8, targets=())


def test_the_plan_reads_a_checkpoints_config_json_and_none_without_lora(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["GPT2LMHeadModel"]}))
    cfg = RunConfig(model=str(tmp_path), adapter="lora", lora_rank=2, lora_targets=("c_fc",))
    shape = model_shape(cfg, 400)
    assert (shape.hidden, shape.layers, shape.vocab) == (64, 2, 400)
    assert [m.path for m in plan_lora(cfg, shape).modules] == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
    assert plan_lora(RunConfig(model=str(tmp_path)), shape) is None
    # Without resize_embeddings the checkpoint keeps its own rows, and so does the shape the forecast counts.
    assert model_shape(dataclasses.replace(cfg, resize_embeddings=False), 400).vocab == TINY["vocab_size"]


def test_parameter_counts_match_the_architectures():
    gpt2 = decoder_shape({"model_type": "gpt2"})  # transformers' defaults: GPT-2 124M
    assert gpt2.matrix_parameters() + gpt2.vector_parameters() == 124_439_808
    qwen = decoder_shape(QWEN2)  # Qwen2-0.5B, its q/k/v biases included
    assert qwen.matrix_parameters() + qwen.vector_parameters() == 494_032_768
